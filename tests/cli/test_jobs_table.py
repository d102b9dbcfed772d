"""`dtrain jobs`' table fits the terminal: all its columns where there is room, and at 80 columns (or piped,
which is 80) the job, its state and its run in full plus what else fits, in a set order, the rest named."""

from __future__ import annotations

import io
import time

from rich.console import Console

from dtrain.cli.jobs_cmd import BY_PRIORITY, JOB_COLUMNS, KEPT, jobs_table
from dtrain.control.slurm.commands import JobState
from dtrain.control.slurm.joblist import JobRow
from dtrain.control.slurm.session import JobRecord


def rows() -> list[dict]:
    now = time.time()
    running = JobRow(
        record=JobRecord(job_id="1042", name="mnist-sweep", workload="mnist", run_id="mnist-20261125-170102-3f9a",
                         url="gs://bucket/runs/mnist-20261125-170102-3f9a", dir="/w/runs/x", nodes=2,
                         submitted=now - 3600, cluster="demo"),
        state=JobState(job_id="1042", name="mnist-sweep", state="RUNNING", started="2026-11-25T16:02:11",
                       elapsed="01:00:03", nodes=2, nodelist="demo-worker-[0-1]", restarts=1),
        last_metric={"step": 1242, "loss": 0.3512}, node_hours=2.0, usd=1.42,
    )  # fmt: skip
    pending = JobRow(
        record=JobRecord(job_id="1043", name="lora", workload="lora", run_id="lora-20261125-171500-77c1",
                         url="/w/runs/lora-20261125-171500-77c1", dir="/w/runs/y", nodes=1, submitted=now,
                         cluster="demo"),
        state=JobState(job_id="1043", name="lora", state="PENDING", reason="Resources"),
        last_metric={},
    )  # fmt: skip
    return [running.as_dict(), pending.as_dict()]


def render(width: int) -> tuple[list[str], list[str]]:
    table, hidden = jobs_table(rows(), "demo", width)
    out = Console(file=io.StringIO(), width=width, color_system=None)
    out.print(table)
    return out.file.getvalue().splitlines(), hidden


def header(lines: list[str]) -> list[str]:
    line = next(ln for ln in lines if " job " in ln)
    return [cell.strip() for cell in line.strip("┃ ").split("┃") if cell.strip()]


def test_a_wide_terminal_shows_every_column():
    lines, hidden = render(200)
    assert hidden == []
    assert header(lines) == [c for c in JOB_COLUMNS if c != "stragglers"]  # no job has one: no column of dashes
    assert all(len(ln) <= 200 for ln in lines)
    assert any("RUNNING" in ln and "11-25 16:02 " in ln and "1.42" in ln and "loss 0.3512 (step 1242)" in ln
               for ln in lines)  # fmt: skip


def test_80_columns_keep_job_state_and_run_whole_and_name_what_they_leave_out():
    lines, hidden = render(80)
    assert all(len(ln) <= 80 for ln in lines), "\n".join(lines)
    shown = header(lines)
    assert set(KEPT) <= set(shown) and len(shown) < len(JOB_COLUMNS)
    # besides the kept ones, the columns that fit, in their order of priority: here the job's duration and nodes
    assert [c for c in BY_PRIORITY if c in shown] == ["duration", "nodes"], shown
    assert shown == [c for c in JOB_COLUMNS if c in shown]
    assert hidden == [c for c in JOB_COLUMNS if c not in shown and c != "stragglers"]
    text = "\n".join(lines)
    for whole in ("1042", "1043", "mnist-20261125-170102-3f9a", "lora-20261125-171500-77c1", "PENDING (Resources)"):
        assert whole in text, (whole, text)
    assert "…" not in text
