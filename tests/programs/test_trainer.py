"""A script driven by Hugging Face's own Trainer (projects/hf_trainer: no dtrain code in it) under
`dtrain train` on this machine, 2 processes (DDP on gloo): it learns, and a run killed mid-way on a
machine that then loses its checkpoint folder resumes from the run's copy and ends with the very
weights of an uninterrupted run.

Trainer's resume is bit-exact here (checked on CPU, 1 and 2 processes): its checkpoint holds the
model, the optimizer, the scheduler, every rank's RNG state and the step, and on resume it skips the
batches already seen in the epoch, so the digest of the final weights is compared for equality."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from runs import dtrain, processes_in, start
from trainer_project import complete_checkpoints, digest, losses, make_trainer_project, resumed_from

# Copies every 0.5 s: a Trainer checkpoint is several files written one after another within
# milliseconds, so a manifest (written only over a directory unchanged for a whole interval) holds
# whole checkpoints.
FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", "DTRAIN_INTERNAL_STOP_GRACE_S": "3", "HF_HUB_OFFLINE": "1"}
STEPS, SAVE_EVERY = 60, 10
ARGS = ["--max-steps", str(STEPS), "--save-steps", str(SAVE_EVERY)]
SLOW_ARGS = [*ARGS, "--sleep", "0.15"]  # about 2 s between two saves: time to see a copy and kill mid-way


def run_dir(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.name.startswith("train-")]
    return run


def copied(run: Path) -> int:
    """The newest whole Trainer checkpoint in the newest manifest of the run's copy (0: none yet)."""
    found = sorted((run / "ckpt" / "node-00000").glob("0*.json")) if (run / "ckpt").exists() else []
    return max(complete_checkpoints(found[-1].read_text()), default=0) if found else 0


@pytest.fixture
def project(tmp_path: Path) -> Path:
    return make_trainer_project(tmp_path / "proj")


@pytest.mark.slow
def test_trainer_script_learns_and_a_killed_run_resumes_to_the_uninterrupted_weights(project: Path, tmp_path: Path):
    base = ["train", "train.py", "--checkpoint-dir", "out", "--nproc", "2"]
    whole = dtrain([*base, "--output", str(tmp_path / "whole"), "--", *ARGS], project, **FAST)
    assert whole.returncode == 0, whole.stdout[-4000:] + whole.stderr
    assert re.search(r"2 process\(es\) x \d+ thread\(s\) under torchrun", whole.stdout), whole.stdout
    seen = losses(whole.stdout)
    assert len(seen) == STEPS // 10 and seen[-1] < 0.7 * seen[0], seen  # 5.4 -> 2.3 on this data
    expected = digest(whole.stdout)
    assert sorted(p.name for p in (project / "out").iterdir()) == ["checkpoint-50", "checkpoint-60"]  # limit 2
    assert json.loads((run_dir(tmp_path / "whole") / "status.json").read_text())["state"] == "completed"

    # The same run, killed mid-way: the launcher dies at once (no last copy), and so do its workers.
    shutil.rmtree(project / "out")
    out = tmp_path / "out"
    proc = start([*base, "--output", str(out), "--", *SLOW_ARGS], project, **FAST)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        run = run_dir(out) if out.exists() and any(out.iterdir()) else None
        if run is not None and copied(run) >= 20:
            break
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    else:
        pytest.fail("no copy of checkpoint-20 or later within 180 s")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while processes_in(project) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_in(project)
    last_copy = copied(run)
    assert last_copy < STEPS
    assert (project / "out").is_dir()
    shutil.rmtree(project / "out")  # a fresh machine: only the run's copy is left

    # The rest at full speed: `--sleep 0` after the run's own line (the last one wins) drops the pause, which only
    # let the launcher be killed between two saves; it changes no weight.
    resumed = dtrain(["train", "--resume", run.name, "--output", str(out), "--", "--sleep", "0"], project, **FAST)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr
    assert resumed_from(resumed.stdout) >= last_copy >= 20
    assert digest(resumed.stdout) == expected
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["starts"] == 2
