"""A running job with a straggler in `dtrain jobs`: its own column first of those that are not kept, where it
fits; where even that does not fit, the job's state says "(straggler)" and the column is named as left out.
Jobs without one get no column of dashes."""

from __future__ import annotations

import io

from rich.console import Console

from dtrain.cli.jobs_cmd import JOB_COLUMNS, KEPT, STRAGGLER_MARK, jobs_table

from .test_jobs_table import header, rows

SLOW = "h1 rank 1 (2.3x)"


def render(width: int, slow: str = SLOW) -> tuple[str, list[str], list[str]]:
    jobs = rows()
    jobs[0]["stragglers"] = slow  # the running job (what dtrain.control.slurm.joblist puts in its row)
    jobs[1]["stragglers"] = ""
    table, hidden = jobs_table(jobs, "demo", width)
    out = Console(file=io.StringIO(), width=width, color_system=None)
    out.print(table)
    text = out.file.getvalue()
    assert all(len(ln) <= width for ln in text.splitlines()), text
    return text, header(text.splitlines()), hidden


def line_of(text: str, job: str) -> str:
    return next(ln for ln in text.splitlines() if f" {job} " in ln)


def test_wide_the_straggler_has_its_column_beside_the_state() -> None:
    text, shown, hidden = render(220)
    assert hidden == [] and shown == list(JOB_COLUMNS)
    assert shown.index("stragglers") == shown.index("state") + 1
    cells = [c.strip() for c in line_of(text, "1042").strip("│ ").split("│")]
    assert cells[shown.index("stragglers")] == SLOW and cells[shown.index("state")] == "RUNNING"
    pending = [c.strip() for c in line_of(text, "1043").strip("│ ").split("│")]
    assert pending[shown.index("stragglers")] == "-" and STRAGGLER_MARK not in text


def test_at_80_columns_the_straggler_comes_before_every_other_optional_column() -> None:
    text, shown, hidden = render(80)
    assert set(KEPT) | {"stragglers"} == set(shown), shown
    assert "stragglers" not in hidden and "duration" in hidden
    assert SLOW in line_of(text, "1042") and STRAGGLER_MARK not in text


def test_too_narrow_for_the_column_the_state_says_straggler() -> None:
    many = "h1 rank 1 (2.3x), h3 rank 0 (1.9x), h2 rank 2 (1.6x)"
    text, shown, hidden = render(80, many)
    # The marked state is as wide as "PENDING (Resources)": the columns that fit are those without stragglers.
    assert "stragglers" in hidden and shown == ["job", "state", "nodes", "duration", "run"], shown
    assert "RUNNING (straggler)" in line_of(text, "1042")
    assert "PENDING (Resources)" in line_of(text, "1043") and text.count("straggler") == 1
    for whole in ("mnist-20261125-170102-3f9a", "lora-20261125-171500-77c1"):
        assert whole in text
