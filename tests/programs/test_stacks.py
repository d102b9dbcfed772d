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
import subprocess
import threading
import time
from pathlib import Path

import pytest
from runs import CLI, assert_no_workers_left, dtrain, env, free_port, processes_in, start
from stacks import make_stack_project, make_trl_project, resumed_at, saved_in, step_losses, trl_losses
from trainer_project import complete_checkpoints

# Copies every 0.5 s: neither stack marks a whole checkpoint, so a copy holds what two scans saw unchanged.
FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", "DTRAIN_INTERNAL_STOP_GRACE_S": "3"}
STEPS, SAVE_EVERY = 40, 10


def copied(stack: str, run: Path) -> int:
    """The newest checkpoint of the stack in the newest manifest of the run's copy (0: none yet)."""
    found = sorted((run / "ckpt" / "node-00000").glob("0*.json")) if (run / "ckpt").exists() else []
    return max(saved_in(stack, found[-1].read_text()), default=0) if found else 0


def copied_hf(run: Path) -> int:
    """The newest whole HF Trainer checkpoint-N in the newest manifest of the run's copy (0: none yet)."""
    found = sorted((run / "ckpt" / "node-00000").glob("0*.json")) if (run / "ckpt").exists() else []
    return max(complete_checkpoints(found[-1].read_text()), default=0) if found else 0


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


TRL_STEPS = 150  # 25 to 35 steps a second on 2 processes here: the run lasts long enough to be killed mid-way
SFT = ["trl", "sft", "--multi_gpu", "--num_processes", "2", "--model_name_or_path", "model", "--dataset_name",
       "data", "--output_dir", "out", "--max_steps", str(TRL_STEPS), "--save_steps", "10", "--save_total_limit", "2",
       "--logging_steps", "1", "--per_device_train_batch_size", "4", "--max_length", "32", "--learning_rate", "0.01",
       "--use_cpu", "--bf16", "false", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true"]  # fmt: skip
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.slow
def test_trl_sft_killed_mid_run_resumes_from_the_runs_copy_of_its_checkpoint(tmp_path: Path):
    """TRL's own `trl sft` command (accelerate launch of its sft.py inside, 2 processes), as a command under
    `dtrain train`: the whole process group is SIGKILLed (a lost machine) once the run's copy holds a
    checkpoint-N folder, the folder is removed, and `--resume RUN -- --resume_from_checkpoint out/checkpoint-N`
    carries on from N: its first loss is the one the killed run logged for step N+1, and it logs the rest."""
    project = make_trl_project(tmp_path / "proj")
    out = tmp_path / "out"
    # accelerate's rendezvous port, free here: its default, 29500, is any other job's on this machine too.
    sft = [*SFT[:2], "--main_process_port", str(free_port()), *SFT[2:]]
    proc = subprocess.Popen([*CLI, "train", "--checkpoint-dir", "out", "--output", str(out), "--", *sft], cwd=project,
                            env=env(**FAST, **OFFLINE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True)
    reader.start()
    deadline, run = time.monotonic() + 180, None
    while time.monotonic() < deadline:
        runs = list(out.glob("trl-*")) if out.exists() else []  # a command's run is named after it
        run = runs[0] if runs else None
        if run is not None and copied_hf(run) >= 20:
            break
        assert proc.poll() is None, "".join(seen)[-4000:]
        time.sleep(0.05)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"no copy of a checkpoint within 180 s:\n{''.join(seen)[-4000:]}")
    os.killpg(proc.pid, signal.SIGKILL)  # everything at once: the launcher, trl, accelerate's workers
    proc.wait()
    reader.join(10)
    deadline = time.monotonic() + 30
    while processes_in(project) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not processes_in(project)  # trl, accelerate's launcher and its workers all ended
    last_copy = copied_hf(run)
    assert 20 <= last_copy < TRL_STEPS, last_copy
    before = trl_losses("".join(seen))
    assert len(before) < TRL_STEPS, len(before)  # killed mid-run
    shutil.rmtree(project / "out")  # a fresh machine: only the run's copy is left

    more = ["--resume_from_checkpoint", f"out/checkpoint-{last_copy}"]
    resumed = dtrain(["train", "--resume", run.name, "--output", str(out), "--", *more], project, **FAST, **OFFLINE)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr
    after = trl_losses(resumed.stdout)
    assert len(after) == TRL_STEPS - last_copy, (len(after), last_copy)  # steps N+1 .. the last, no more
    assert len(before) > last_copy and after[0] == before[last_copy], (after[:3], before[last_copy - 1 : last_copy + 2])
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["starts"] == 2
