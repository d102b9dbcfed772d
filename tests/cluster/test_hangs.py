"""Hang detection on the two-host test bed (docs/hangs.md): a worker of a built-in MNIST run on h1 is frozen
with SIGSTOP (what a GPU, NCCL or filesystem hang looks like from outside); its node agent finds it, the
stacks land in the run, the job is stopped on both hosts and, with --max-restarts 1, trains again from its last
complete checkpoint to the end. Real CLI, OpenSSH, torchrun and gloo, as in test_launch.py (whose module-scoped
fixtures this module reuses: it builds no test bed of its own).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from runs import stop_labels

from dtrain.common import progress
from dtrain.common.rundir import read_json
from dtrain.common.storage import open_store

from .bed import Testbed
from .test_launch import (
    MNIST,
    TOTAL_STEPS,
    bucket,
    cwd,
    emulator,
    job_processes,
    latest_checkpoint,
    start,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.root
__all__ = ["cwd", "emulator"]  # module-scoped fixtures, shared with test_launch's way of using the bed


def _rows(run, name: str) -> list[dict]:
    with_text = run.read_bytes(name).decode() if run.exists(name) else ""
    return [json.loads(x) for x in with_text.splitlines() if x.strip()]


# The job's --hang-timeout (HANG_TIMEOUT_S), not the automatic 30 s: the bed proves the agent's finding, stopping and
# relaunch, which do not depend on the bound; the automatic rule (its 30 s floor) is proven on this machine by
# tests/control/test_local_hangs.py, through the same Watcher, and by the unit tests of dtrain.common.progress.
HANG_TIMEOUT_S = 12


@pytest.mark.slow  # about a minute: the 12 s hang timeout, a relaunch, the rest of the training
def test_frozen_worker_is_found_named_stopped_and_the_job_resumes(cwd: Path, emulator: str, testbed: Testbed) -> None:
    out = bucket(emulator)
    p = start(cwd, emulator, *MNIST, "--output", out, "--checkpoint-every", "20", "--max-restarts", "1",
              "--hang-timeout", str(HANG_TIMEOUT_S))  # fmt: skip
    pid = None
    try:
        run_url = wait_for_checkpoint(p, out, 20)
        ckpt = latest_checkpoint(run_url)
        workers = job_processes(testbed, workers_only=True)["h1"]
        assert len(workers) == 2, workers
        pid = int(workers[0].split()[0])
        rank = progress._rank_of(pid)
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()
        text, _ = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            if pid:
                os.kill(pid, signal.SIGCONT)
            p.kill()
    assert p.returncode == 0, text
    lines = text.splitlines()
    hang = [ln for ln in lines if ln.startswith("dtrain: hang on ")]
    assert len(hang) == 1 and hang[0].startswith(f"dtrain: hang on h1 rank {rank}: no progress for "), text
    assert "since step " in hang[0] and f"/hangs/h1-rank{rank}.txt" in hang[0], hang
    run = open_store(run_url)
    stack = run.read_bytes(f"hangs/h1-rank{rank}.txt").decode()
    assert "mnist/train.py" in stack, stack  # where the frozen rank was: in the training loop
    events = _rows(run, "events.jsonl")
    hangs = [e for e in events if e.get("event") == "hang"]
    assert len(hangs) == 1 and hangs[0]["node"] == "h1" and str(hangs[0]["rank"]) == rank, hangs
    assert hangs[0]["time"] - frozen_at >= HANG_TIMEOUT_S - 1.0, (hangs, frozen_at)  # not before its bound
    assert stop_labels(events) == ["hang"], events  # one label for the stop: not rank 0's `preempted` too
    resumed = [e for e in events if e.get("event") == "resumed" and e["time"] > hangs[0]["time"]]
    assert resumed and resumed[0]["step"] >= ckpt, events  # from the last complete checkpoint
    again = [m for m in _rows(run, "metrics.jsonl") if m["time"] > resumed[0]["time"] and "loss" in m]
    assert again, "no training metrics after the relaunch"
    status = read_json(run, "status.json")
    assert status["state"] == "completed" and status["result"]["steps"] == TOTAL_STEPS, status
    assert job_processes(testbed) == {"h0": [], "h1": []}  # nothing left on either host
    detect_s = hangs[0]["time"] - frozen_at
    again_s = again[0]["time"] - frozen_at
    print(f"\nfreeze -> detection {detect_s:.1f} s (its bound {HANG_TIMEOUT_S} s); freeze -> training again "
          f"{again_s:.1f} s (target 90 s: the first metrics row after the relaunch, step {again[0]['step']}; "
          f"checkpoint restored at {resumed[0]['time'] - frozen_at:.1f} s)")  # fmt: skip
