"""Jobs that outlive a Slurm time limit, without a cluster: `--time` in Slurm's formats (one line for a bad
one), the batch script's --time and warning signal, whether a warned job continues, how a continuation is
counted in the job's comment and shown by `dtrain jobs` and the dashboard, and what the run records. The
whole thing on a real Slurm: tests/slurm/test_slurm_time_limit.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runs import CLI, isolated_env

from dtrain.common import slurmstep
from dtrain.common.errors import UserError
from dtrain.control.slurm import commands, script
from dtrain.control.slurm.joblist import JobRow, time_limit_state
from dtrain.control.slurm.session import JobRecord
from dtrain.control.slurm.spec import check_time, job_options, limit_seconds, warning_lead_s

from .test_slurm_files import cluster, files


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2", 120), ("90", 5400), ("1:30", 90), ("01:00:00", 3600), ("2-0", 172800), ("1-12", 129600),
     ("1-2:30", 95400), ("1-00:00:05", 86405), ("UNLIMITED", None), ("infinite", None), ("0", None)],
)  # fmt: skip
def test_slurm_time_formats(text: str, seconds: int | None) -> None:
    assert limit_seconds(text) == seconds
    assert check_time(text, "--time") == text


@pytest.mark.parametrize("text", ["1:75", "abc", "5x", "1:2", "-1", "1-0:0:5", "1.5", ""])
def test_a_bad_time_is_one_line(text: str) -> None:
    with pytest.raises(UserError) as e:
        check_time(text, "--time")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"--time {text!r} is not a Slurm time limit")
    with pytest.raises(UserError, match="time"):
        job_options({"time": text}, "[clusters.c]")


def test_the_warning_comes_two_minutes_or_half_a_short_limit_before() -> None:
    """Slurm may send it up to 60 s early: a short limit's lead leaves room for that."""
    leads = [warning_lead_s(s) for s in (60, 120, 200, 240, 300, 360, 3600, 86400, None)]
    assert leads == [15, 15, 40, 60, 90, 120, 120, 120, 120]


def test_batch_script_asks_for_the_warning(tmp_path: Path) -> None:
    c = cluster(tmp_path, managed=False)  # its table: time = "1:00:00"

    def options(**kw: str) -> list[str]:
        f = files(c, nodes=1, **kw)
        assert f.job["max_continuations"] == 20
        return [ln.removeprefix("#SBATCH ") for ln in f.script.splitlines() if ln.startswith("#SBATCH --")][8:-1]

    assert options() == ["--partition=gpu", "--account=proj", "--time=1:00:00", "--signal=B:USR1@120"]
    assert options(time="2") == ["--partition=gpu", "--account=proj", "--time=2", "--signal=B:USR1@15"]
    assert options(time="UNLIMITED") == ["--partition=gpu", "--account=proj", "--time=UNLIMITED"]
    assert script.time_options("") == ["--signal=B:USR1@120"]  # the partition's limit, whatever it is


def test_the_table_sets_the_continuations(tmp_path: Path) -> None:
    assert job_options({"max_continuations": 3, "time": "2-0"}, "w") == {"max_continuations": 3, "time": "2-0"}
    with pytest.raises(UserError, match="max_continuations must be >= 0"):
        job_options({"max_continuations": -1}, "w")


def test_a_warned_job_continues_only_after_a_checkpoint_and_within_its_limit() -> None:
    go = dict(warned=True, signalled=False, done=0, limit=20)
    assert slurmstep.should_continue(3, **go)
    assert slurmstep.should_continue(3, **{**go, "done": 19})
    assert not slurmstep.should_continue(3, **{**go, "done": 20})  # max_continuations reached
    assert not slurmstep.should_continue(3, **{**go, "limit": 0})  # continuations off
    assert not slurmstep.should_continue(0, **go)  # the run finished before it stopped
    assert not slurmstep.should_continue(1, **go)  # a failure is not retried by a time limit
    assert not slurmstep.should_continue(3, **{**go, "signalled": True})  # scancel'd, or the limit came first
    assert not slurmstep.should_continue(3, **{**go, "warned": False})  # a preemption: requeued as before


def test_continuations_are_counted_in_the_jobs_comment() -> None:
    assert slurmstep.continuations(slurmstep.time_limit_comment(2)) == (2, False)
    assert slurmstep.continuations(slurmstep.time_limit_comment(20, stopped=True)) == (20, True)
    assert slurmstep.continuations("") == (0, False)
    assert slurmstep.continuations("someone else's comment") == (0, False)


def state(job_state: str, comment: str) -> commands.JobState:
    line = f"JobId=7 JobName=mnist JobState={job_state} Reason=None Restarts=2 ExitCode=0:0 Comment={comment}"
    return commands.job_from_scontrol(commands.parse_kv(line))


def test_jobs_show_a_time_limit_with_its_continuations() -> None:
    from dtrain.cli.jobs_cmd import _cells

    assert state("PENDING", "dtrain:time-limit:2").continuations == 2
    assert time_limit_state(state("PENDING", "dtrain:time-limit:2")) == "continuing (time limit, 2)"
    assert time_limit_state(state("RUNNING", "dtrain:time-limit:2")) == "continuing (time limit, 2)"
    assert time_limit_state(state("COMPLETED", "dtrain:time-limit:3")) == "completed (time limit, 3)"
    assert time_limit_state(state("FAILED", "dtrain:time-limit:20:max")) == (
        "stopped at the time limit (20, max_continuations)"
    )
    assert time_limit_state(state("RUNNING", "(null)")) == ""
    rec = JobRecord("7", "mnist", "mnist", "r", "/s/r", "/w/runs/r", 1, 0.0, "c")
    row = JobRow(rec, state("PENDING", "dtrain:time-limit:2"), {}).as_dict()
    assert (row["state"], row["continuations"], row["time_limit"]) == ("PENDING", 2, "continuing (time limit, 2)")
    assert _cells(row)["state"][0] == "continuing (time limit, 2) (PENDING)"
    done = JobRow(rec, state("COMPLETED", "dtrain:time-limit:2"), {}).as_dict()
    assert _cells(done)["state"][0] == "completed (time limit, 2)"


def test_the_dashboard_shows_the_continuations(tmp_path: Path) -> None:
    from dtrain.dashboard import pages

    rec = JobRecord("7", "mnist", "mnist", "r", "/s/r", "/w/runs/r", 1, 0.0, "c")
    row = JobRow(rec, state("PENDING", "dtrain:time-limit:2"), {}).as_dict()
    html = pages.templates.env.get_template("cluster.html").render(
        cluster=cluster(tmp_path, managed=False), named=True, nodes=[], slurm=True, jobs=[row], queue_error=""
    )
    assert '<span class="detail time-limit">continuing (time limit, 2)</span>' in html


def test_the_run_says_continuing_not_preempted(tmp_path: Path) -> None:
    """What the batch step records in the run at a continuation: status.json requeued for a time limit (no
    longer the workload's "preempted"), and an events.jsonl row; at max_continuations it stays preempted."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "preempted", "exit_code": 3, "starts": 1}))
    job = {"run_url": str(run), "specs": {}}
    slurmstep.record_time_limit(job, 1, 20, "time limit: continuing", stopped=False)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "requeued" and status["reason"] == "time limit" and status["continuations"] == 1
    assert "exit_code" not in status and status["starts"] == 1
    (row,) = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert (row["event"], row["continuation"], row["continued"]) == ("time-limit", 1, True)
    slurmstep.record_time_limit(job, 20, 20, "time limit: not continued", stopped=True)
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "preempted" and status["exit_code"] == 3 and status["continuations"] == 20


def test_time_on_the_command_line(tmp_path: Path) -> None:
    from dtrain.control.program import parse_command_line

    assert parse_command_line(["train.py", "--time", "1-12", "--", "--lr", "1"]).options["time"] == "1-12"
    with pytest.raises(UserError, match=r"^--time '9:99' is not a Slurm time limit"):
        parse_command_line(["train.py", "--time", "9:99"])
    # A built-in on a cluster without Slurm, and a bad value to submit: one line each, nothing started.
    env = isolated_env(tmp_path)
    for argv in (["train", "mnist", "--time", "5"], ["submit", "mnist", "--time", "1:75"]):
        p = subprocess.run([*CLI, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "--time" in p.stderr
    assert not (tmp_path / "runs").exists()


def test_train_following_the_job_reports_each_continuation() -> None:
    """`dtrain train` through Slurm follows the job across its continuations: a `time-limit` event each time
    the job's count goes up (or it stops at max_continuations), besides the requeue's own stage line."""
    from dtrain.control.events import Collector
    from dtrain.control.slurm.joblogs import _report

    events = Collector()
    one = "dtrain:time-limit:1"
    steps = [state("RUNNING", "(null)"), state("RUNNING", one), state("PENDING", one), state("RUNNING", one),
             state("RUNNING", one + ":max")]  # fmt: skip
    for before, now in zip([None, *steps], steps, strict=False):
        _report(before, now, events)
    got = [(e.data["continuations"], e.data["continued"]) for e in events.of("time-limit")]
    assert got == [(1, True), (1, False)]
    assert events.of("time-limit")[0].message == "dtrain: job 7 reached its time limit: continuing (time limit, 1)"
