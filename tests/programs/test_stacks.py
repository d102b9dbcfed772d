"""The training stacks users already use, unchanged (tests/programs/projects/accelerate and lightning: no dtrain
code in them), under `dtrain train` on this machine, 2 processes under dtrain's torchrun (DDP on gloo): each
run is killed mid-way (the launcher SIGKILLed, its workers follow), its checkpoint folder is lost as on a
fresh machine, and `dtrain train --resume` carries on from the run's copy of it, to the end.

That it carried on, not restarted: the script says the step it resumed at (the stack's own counter, loaded
from the checkpoint), and its first step after it prints the very loss the killed run printed for that step
(same weights, same optimizer state, same batch)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from runs import assert_no_workers_left, dtrain, start
from stacks import make_stack_project, resumed_at, saved_in, step_losses

# Copies every 0.5 s: neither stack marks a whole checkpoint, so a copy holds what two scans saw unchanged.
FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", "DTRAIN_INTERNAL_STOP_GRACE_S": "3"}
STEPS, SAVE_EVERY = 40, 10


def copied(stack: str, run: Path) -> int:
    """The newest checkpoint of the stack in the newest manifest of the run's copy (0: none yet)."""
    found = sorted((run / "ckpt" / "node-00000").glob("0*.json")) if (run / "ckpt").exists() else []
    return max(saved_in(stack, found[-1].read_text()), default=0) if found else 0


def killed_and_resumed(stack: str, project: Path, out: Path) -> tuple[str, str, Path, int]:
    """Runs the project's train.py on 2 processes, SIGKILLs the launcher once the run's copy holds the checkpoint
    of step 20 or later, removes the project's checkpoint folder and resumes the run: the killed run's output, the
    resumed run's, the run's folder and the newest checkpoint its copy held."""
    args = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    base = ["train", "train.py", "--nproc", "2", "--checkpoint-dir", "out", "--output", str(out)]
    # A pause after each step (0.15 s: 1.5 s between saves) gives time to see a copy and kill mid-way.
    proc = start([*base, "--", *args, "--sleep", "0.15"], project, **FAST)
    seen: list[str] = []
    deadline, run = time.monotonic() + 180, None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, "".join(seen)[-4000:]
        seen.append(line)
        runs = list(out.glob("train-*")) if out.exists() else []
        run = runs[0] if runs else None
        if run is not None and copied(stack, run) >= 2 * SAVE_EVERY:
            break
    else:
        proc.kill()
        pytest.fail(f"no copy of step {2 * SAVE_EVERY} or later within 180 s:\n{''.join(seen)[-4000:]}")
    os.kill(proc.pid, signal.SIGKILL)  # the launcher dies at once: no last copy, no goodbye
    seen.append(proc.stdout.read())
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            assert_no_workers_left([run])
            break
        except AssertionError:
            time.sleep(0.2)
    assert_no_workers_left([run])
    last_copy = copied(stack, run)
    assert 2 * SAVE_EVERY <= last_copy < STEPS, last_copy
    shutil.rmtree(project / "out")  # a fresh machine: only the run's copy is left
    # The rest at full speed: `--sleep 0` after the run's own line (the last one wins).
    resumed = dtrain(["train", "--resume", run.name, "--output", str(out), "--", "--sleep", "0"], project, **FAST)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr
    return "".join(seen), resumed.stdout, run, last_copy


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["accelerate", "lightning"])
def test_a_stacks_script_killed_mid_run_resumes_from_the_runs_copy_of_its_checkpoint(stack: str, tmp_path: Path):
    project = make_stack_project(stack, tmp_path / "proj")
    killed, resumed, run, last_copy = killed_and_resumed(stack, project, tmp_path / "out")
    at = resumed_at(resumed)
    assert at >= last_copy, (at, last_copy)
    before, after = step_losses(killed), step_losses(resumed)
    assert min(after) == at + 1 and max(after) == STEPS, sorted(after)
    assert after[at + 1] == before[at + 1], (at, before, after)  # carried on: the very loss of the same step
    assert f"done at step {STEPS}" in resumed
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["starts"] == 2
