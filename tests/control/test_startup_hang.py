"""A rank that hangs before its first steps (rendezvous, NCCL init, data loading, the first collective) is found
by the start-up bound (`startup_timeout`, --startup-timeout), not left to the 900 s that a rank without a step
time used to get: the rule, and a real job on this machine whose rank 1 freezes (SIGSTOP) before its first step.
tests/cluster/test_startup_hang.py and tests/slurm/test_slurm_startup_hang.py are the same over SSH and Slurm."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest
from projects import make_freeze_project
from runs import CLI, isolated_env

from dtrain.common import progress
from dtrain.common.errors import ExitCode
from dtrain.common.progress import hang_timeout
from dtrain.common.rundir import read_json
from dtrain.common.storage import open_store

HOST = socket.gethostname()


def test_the_start_up_bound_applies_until_the_step_time_is_known():
    # Starting (fewer than MIN_STEPS steps seen): the start-up bound, or the shorter explicit hang timeout.
    assert hang_timeout([], None, startup=20.0) == 20.0
    assert hang_timeout([0.1], None, steps=1, startup=20.0) == 20.0
    assert hang_timeout([], 5.0, startup=20.0) == 5.0
    assert hang_timeout([], None, startup=None) == progress.NO_STEP_TIMEOUT_S  # 0 / None: none of its own
    # Then the step time's rule (or --hang-timeout), whatever the start-up bound.
    assert hang_timeout([2.0, 4.0, 6.0], None, startup=20.0) == pytest.approx(40.0)
    assert hang_timeout([0.05] * 20, None, startup=1.0) == progress.FLOOR_S
    assert hang_timeout([0.05] * 20, 7.0, startup=1.0) == 7.0


def test_the_start_up_timeout_is_a_setting_refused_when_negative(tmp_path: Path):
    r = subprocess.run([*CLI, "train", "train.py", "--startup-timeout", "-1"], cwd=tmp_path, env=isolated_env(tmp_path),
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == ExitCode.USAGE and "--startup-timeout must be >= 0 seconds" in r.stderr, r.stderr


def test_a_rank_frozen_before_its_first_step_is_a_start_up_hang(tmp_path: Path):
    """Automatic hang timeout (900 s for a rank with no step time), --startup-timeout 3: the frozen rank is named,
    as a start-up hang, within seconds, and the job ends (exit 4) with the run failed for that reason."""
    make_freeze_project(tmp_path)  # rank 1 freezes its torchrun and itself before its first step
    out = tmp_path / "runs"
    args = ["train", "train.py", "--nproc", "2", "--startup-timeout", "3", "--output", str(out)]
    r = subprocess.run([*CLI, *args], cwd=tmp_path, env=isolated_env(tmp_path), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    text = r.stdout + r.stderr
    assert r.returncode == ExitCode.HUNG, text
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    lines = [ln for ln in text.splitlines() if ln.startswith("dtrain: hang on ")]
    assert len(lines) == 1, text
    assert lines[0].startswith(f"dtrain: hang on {HOST} rank 1: no progress for "), lines
    assert "before its first step, at start-up; stacks in " in lines[0], lines
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    hangs = [e for e in events if e["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["rank"] == "1" and hangs[0]["phase"] == "startup", hangs
    assert hangs[0]["timeout_s"] == 3.0 and hangs[0]["state"] == "T", hangs
    assert not [e for e in events if e["event"] == "preempted"], events
    status = read_json(open_store(str(run)), "status.json")
    assert (status["state"], status["exit_code"]) == ("failed", ExitCode.HUNG), status
    assert "before its first step, at start-up" in status["error"], status
