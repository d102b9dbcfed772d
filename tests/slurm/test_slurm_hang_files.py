"""Hangs and stragglers on Slurm, without a cluster: the hang timeout and the requeue allowance reach job.json,
the job's Slurm comment keeps its fields apart (time-limit continuations, hang requeues, stragglers), `dtrain
jobs` rows show the stragglers, when a hung job is requeued, and what the batch step writes into the run from an
agent's hang report. The whole thing on a real Slurm: tests/slurm/test_slurm_hangs.py."""

from __future__ import annotations

import json
from pathlib import Path

from dtrain.common import slurmstep
from dtrain.control.slurm import commands, script
from dtrain.control.slurm.joblist import JobRow
from dtrain.control.slurm.session import JobRecord

from .test_slurm_files import cluster, files


def _files(tmp_path: Path, **kw: object) -> script.BatchFiles:
    return files(cluster(tmp_path, managed=False), nodes=1, **kw)


def test_the_hang_timeout_and_the_restarts_reach_the_job(tmp_path: Path) -> None:
    f = _files(tmp_path, hang_timeout=45.0, max_restarts=2)
    assert [s["hang"] for s in f.job["specs"].values()] == [{"timeout_s": 45.0}]
    assert f.job["max_restarts"] == 2
    auto = _files(tmp_path)
    assert [s["hang"] for s in auto.job["specs"].values()] == [{"timeout_s": None}] and auto.job["max_restarts"] == 0
    off = _files(tmp_path, hang_timeout=0.0)
    assert [s["hang"] for s in off.job["specs"].values()] == [{"timeout_s": 0.0}]


def test_the_comment_keeps_its_fields_apart() -> None:
    c = slurmstep.with_field("", slurmstep.TIME_LIMIT_COMMENT, "2")
    c = slurmstep.with_field(c, slurmstep.HANGS_COMMENT, "1")
    c = slurmstep.with_field(c, slurmstep.STRAGGLERS_COMMENT, slurmstep.stragglers_field({"h1 rank 1": 2.31}))
    assert c == "dtrain:time-limit:2;dtrain:hangs:1;dtrain:stragglers:h1/1/2.31" and " " not in c
    assert slurmstep.continuations(c) == (2, False) and slurmstep.hang_requeues(c) == 1
    assert slurmstep.stragglers_of(c) == {"h1 rank 1": 2.31}
    c = slurmstep.with_field(c, slurmstep.TIME_LIMIT_COMMENT, "3:max")
    assert slurmstep.continuations(c) == (3, True) and slurmstep.hang_requeues(c) == 1
    c = slurmstep.with_field(c, slurmstep.STRAGGLERS_COMMENT, slurmstep.stragglers_field({}))
    assert slurmstep.stragglers_of(c) == {} and "stragglers" not in c
    assert slurmstep.hang_requeues("someone else's comment") == 0 and slurmstep.stragglers_of("x") == {}


def test_a_hung_job_is_requeued_within_its_allowance() -> None:
    go = dict(signalled=False, done=0, allowance=1, run_started=True)
    assert slurmstep.should_requeue_hang(**go)
    assert not slurmstep.should_requeue_hang(**{**go, "done": 1})  # its restarts are spent
    assert not slurmstep.should_requeue_hang(**{**go, "allowance": 0})  # --max-restarts 0
    assert not slurmstep.should_requeue_hang(**{**go, "signalled": True})  # scancel'd meanwhile
    assert not slurmstep.should_requeue_hang(**{**go, "run_started": False})  # nothing to resume
    assert slurmstep.job_code({"h0": 3, "h1": 4}) == 4  # the others were stopped: the hang is the job's end
    assert slurmstep.job_code({"h0": 1, "h1": 4}) == 1


def test_jobs_rows_show_the_stragglers() -> None:
    line = ("JobId=7 JobName=mnist JobState=RUNNING Reason=None Restarts=1 ExitCode=0:0 "
            "Comment=dtrain:hangs:1;dtrain:stragglers:h1/1/2.3,h0/0/1.62")  # fmt: skip
    s = commands.job_from_scontrol(commands.parse_kv(line))
    rec = JobRecord("7", "mnist", "mnist", "r", "/s/r", "/w/runs/r", 2, 0.0, "c")
    row = JobRow(rec, s, {}).as_dict()
    assert row["stragglers"] == "h0 rank 0 (1.6x), h1 rank 1 (2.3x)" and row["hang_restarts"] == 1
    assert row["time_limit"] == "" and row["continuations"] == 0
    plain = commands.job_from_scontrol(commands.parse_kv("JobId=8 JobName=m JobState=RUNNING Comment=(null)"))
    assert JobRow(rec, plain, {}).as_dict()["stragglers"] == ""
    assert JobRow(rec, None, {}).as_dict()["stragglers"] == ""


def test_a_hang_report_goes_into_the_run(tmp_path: Path, capsys) -> None:
    """An agent's control line as the node step forwards it, and what the batch step writes from it."""
    ev = {"event": "hang", "host": "h1", "rank": "1", "step": 25, "state": "T", "age_s": 31.2, "timeout_s": 30.0,
          "stacks": {"1": 'File "mnist/train.py", line 80 in train_step\n', "3": "x" * 300_000},
          "line": "dtrain: hang on h1 rank 1: ...; stacks in hangs/h1-rank1.txt"}  # fmt: skip
    assert slurmstep.forward_control(slurmstep.CONTROL_PREFIX + json.dumps(ev), "h1") == ev["line"]
    assert slurmstep.forward_control(slurmstep.CONTROL_PREFIX + '{"event": "started", "pid": 1}', "h1") is None
    (out,) = capsys.readouterr().out.splitlines()
    sent = json.loads(out[len(slurmstep.CONTROL_PREFIX) :])
    assert sent["node"] == "h1" and len(sent["stacks"]["3"]) == slurmstep.STACK_MAX_CHARS
    run = tmp_path / "run"
    run.mkdir()
    line, facts, files = slurmstep.hang_report(str(run), "h1", sent)
    assert line == (
        f"dtrain: hang on h1 rank 1: no progress for 31 s since step 25; stacks in {run}/hangs/h1-rank1.txt"
    )
    assert facts["node"] == "h1" and facts["step"] == 25 and facts["stacks"] == f"{run}/hangs/h1-rank1.txt"
    (run / "status.json").write_text(json.dumps({"state": "running", "pid": 7}))
    job = {"run_url": str(run), "specs": {"*": {"env": {}}}, "image": ""}
    slurmstep.record_run(job, files=files, events=[{"event": "hang", "message": line}],
                         status={"state": "failed", "exit_code": 4, "error": "hung"}, drop=("pid",))  # fmt: skip
    assert "train_step" in (run / "hangs" / "h1-rank1.txt").read_text()
    assert json.loads((run / "events.jsonl").read_text())["event"] == "hang"
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 4 and "pid" not in status
    before = slurmstep.hang_report(str(run), "h1", {**sent, "stacks": {}, "step": None})[0]
    assert "before its first step" in before and "the agent's hangs/ on h1" in before


def test_the_batch_step_finds_stragglers_and_a_silent_agent(tmp_path: Path, monkeypatch) -> None:
    """The batch step's Hangs on its nodes' forwarded lines, where Slurm's commands are absent (they are best
    effort): the straggler rows and lines, and an agent silent for its timeout taken for hung."""
    import time

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))
    monkeypatch.setenv("SLURMD_NODENAME", "h0")
    watch = slurmstep.Hangs({"run_url": str(run), "specs": {"*": {"env": {}}}, "image": ""})

    def alive(node: str, medians: dict[str, float], timeout: float = 30.0) -> str:
        ev = {"event": "alive", "timeout_s": timeout, "medians": medians, "node": node}
        return slurmstep.CONTROL_PREFIX + json.dumps(ev)

    watch.on_control(alive("h0", {"0": 0.1}), judge=True)
    watch.on_control(alive("h1", {"1": 0.25}), judge=True)
    assert watch.stragglers.now == {"h1 rank 1": 2.5}
    watch.on_control(alive("h1", {"1": 0.25}), judge=True)  # the same set: said once
    watch.on_control(alive("h1", {"1": 0.11}), judge=True)
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["stragglers"]) for e in events] == [("straggler", {"h1 rank 1": 2.5}), ("straggler", {})]
    log = (tmp_path / "logs" / "h0.log").read_text()
    assert "dtrain: straggler: h1 rank 1 (2.5x the others' median step)" in log and "no straggler any more" in log
    watch.check_silent(set())
    assert watch.hang is None  # both heard just now
    watch.alive["h1"] = (time.monotonic() - 31, 0.5)
    watch.heard("[h0] step 5")
    watch.check_silent({"h1"})
    assert watch.hang is None  # h1's step has ended: its agent is done, not silent
    watch.check_silent(set())
    assert watch.hang is not None and watch.hang["node"] == "h1", watch.hang
    assert watch.hang["message"] == "dtrain: hang on h1: its agent has printed nothing for 30 s; stopping the job"
    assert json.loads((run / "events.jsonl").read_text().splitlines()[-1])["event"] == "hang"
