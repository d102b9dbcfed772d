"""The run record (dtrain.common.runrecord): status.json's start and end, and the one rule that labels a stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dtrain.common import runrecord
from dtrain.common.errors import ExitCode
from dtrain.common.storage import open_store

P, F = int(ExitCode.PREEMPTED), int(ExitCode.FAILURE)


@pytest.mark.parametrize(
    ("code", "codes", "asked", "want"),
    [
        # A Spot notice to one node's processes: its torchrun died of SIGTERM (143), the other node's ranks
        # checkpointed and exited 3; the launcher combined them to a failure. Preempted, once.
        (F, [P, 143], False, P),
        (F, [P, -15], False, P),
        (P, [P, P], True, P),  # dtrain asked (a cancel): every node checkpointed
        (F, [F, P], True, P),  # torchrun reports its SIGTERM'd workers as a failure
        (P, [P, P], False, F),  # exit 3 that nobody asked for is a failure (issue 30, item 3)
        (F, [F, 0], False, F),  # a failure stays one
        (F, [137, 143], False, F),  # a node killed outright is not a stop as asked
        (0, [0, 0], False, 0),
        (int(ExitCode.USAGE), [2, 0], False, int(ExitCode.USAGE)),
    ],
)
def test_job_outcome_is_one_rule_for_every_launcher(code: int, codes: list[int], asked: bool, want: int) -> None:
    assert runrecord.job_outcome(code, codes, asked=asked) == want


def _events(run: Path) -> list[dict]:
    path = run / runrecord.EVENTS
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_a_start_then_a_preempted_end_records_one_label_at_the_last_checkpoint(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    runrecord.write_status(store, {"state": "failed", "exit_code": 1, "error": "x", "pid": 7, "starts": 1})
    before = runrecord.record_start(store, starts=2, host="h0", pid=42)
    assert before is not None and before["state"] == "failed"
    started = runrecord.read_status(store)
    assert started["state"] == "running" and started["starts"] == 2 and started["pid"] == 42
    assert "exit_code" not in started and "error" not in started
    (tmp_path / "checkpoints" / "step-00000020").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-00000020" / "meta.json").write_text(json.dumps({"step": 20, "files": {}}))
    assert runrecord.record_end(store, P) == P
    ended = runrecord.read_status(store)
    assert (ended["state"], ended["exit_code"]) == ("preempted", P) and "pid" not in ended
    rows = _events(tmp_path)
    assert [(r["event"], r["step"]) for r in rows] == [("preempted", 20)], rows


def test_a_completed_run_stopped_in_its_teardown_stays_completed_with_no_label(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    runrecord.write_status(store, {"state": "completed", "exit_code": 0})
    assert runrecord.record_end(store, P, requeued=True) == 0
    assert runrecord.read_status(store)["state"] == "completed" and _events(tmp_path) == []


def test_requeued_keeps_the_exit_code_and_failures_get_no_launcher_label(tmp_path: Path) -> None:
    store = open_store(str(tmp_path))
    runrecord.write_status(store, {"state": "running"})
    runrecord.record_end(store, P, requeued=True)
    assert runrecord.read_status(store)["state"] == "requeued" and "exit_code" not in runrecord.read_status(store)
    assert [r["event"] for r in _events(tmp_path)] == ["preempted"]
    runrecord.record_end(store, F, error="boom")
    st = runrecord.read_status(store)
    assert (st["state"], st["exit_code"], st["error"]) == ("failed", F, "boom")
    assert [r["event"] for r in _events(tmp_path)] == ["preempted"]  # the program's own row labels a failure


def test_a_builtin_under_a_launcher_leaves_the_stop_label_to_it(tmp_path: Path, monkeypatch) -> None:
    """A Slurm time-limit stop was recorded twice: the built-in's own `preempted (SIGTERM): checkpoint saved` and
    the batch step's `time-limit`. Under dtrain's launcher (DTRAIN_RUN_URL names the run) the built-in writes no
    `preempted` row; the launcher's row is the one label, at the last complete checkpoint. Alone (a plain
    torchrun) the built-in still labels its own stop."""
    from runs import stop_labels

    from dtrain.common import jobenv, slurmstep, workload

    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000040").mkdir(parents=True)
    (run / "checkpoints" / "step-00000040" / "meta.json").write_text(json.dumps({"step": 40, "files": {}}))
    store = open_store(str(run))
    runrecord.write_status(store, {"state": "running", "starts": 1})
    monkeypatch.setenv(jobenv.RUN_URL, str(run))
    workload._status(None, store, "preempted", ExitCode.PREEMPTED, None)
    slurmstep.record_time_limit({"run_url": str(run), "specs": {}}, 1, 20, "time limit: continuing", stopped=False)
    rows = _events(run)
    assert stop_labels(rows) == ["time-limit"], rows
    assert rows[-1]["step"] == 40, rows
    monkeypatch.delenv(jobenv.RUN_URL)
    workload._status(None, store, "preempted", ExitCode.PREEMPTED, None)
    assert stop_labels(_events(run)) == ["time-limit", "preempted"], _events(run)


def test_a_builtin_that_fails_after_sigterm_under_a_launcher_leaves_the_label_to_it(
    tmp_path: Path, monkeypatch
) -> None:
    """A Slurm hang: the batch step's `hang` row, then SIGTERM to every step; rank 0, whose peer was frozen, failed
    in its collective and wrote `failed` beside the `hang` row. A failure once SIGTERM came is that stop's."""
    from types import SimpleNamespace

    from runs import stop_labels

    from dtrain.common import jobenv, workload

    run = tmp_path / "run"
    run.mkdir()
    store = open_store(str(run))
    runrecord.append_events(store, [runrecord.event_row("hang", "dtrain: hang on h1 rank 1")])
    monkeypatch.setenv(jobenv.RUN_URL, str(run))
    ckpt = SimpleNamespace(close=lambda: None, last_saved_step=40)
    stopped = SimpleNamespace(ckpt=ckpt, preempt=SimpleNamespace(requested=True))
    workload._status(None, store, "failed", ExitCode.FAILURE, stopped, error="peer gone")  # type: ignore[arg-type]
    assert stop_labels(_events(run)) == ["hang"], _events(run)
    unasked = SimpleNamespace(ckpt=ckpt, preempt=SimpleNamespace(requested=False))
    workload._status(None, store, "failed", ExitCode.FAILURE, unasked, error="boom")  # type: ignore[arg-type]
    assert stop_labels(_events(run)) == ["hang", "failed"], _events(run)  # a failure of its own is labelled
