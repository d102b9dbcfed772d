"""A start-up hang on the two-host test bed (docs/hangs.md): the worker host's torchrun and its rank are frozen
(SIGSTOP) before the rank's first step, as in issue 31, where after 240 s there was still no hang event and no end.
With --startup-timeout 5 the node agent on h1 names the rank as a start-up hang, its stacks land in the run, and
the job ends on both hosts with exit 4. Real CLI, OpenSSH, torchrun; the run goes to a gcp-storage-emulator bucket.

Needs root (skips otherwise; CI runs as root)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from projects import make_freeze_project
from runs import CLI

from dtrain.common.errors import ExitCode
from dtrain.common.storage import open_store

from .bed import Testbed
from .test_launch import bucket, cli_env, job_processes, run_of

pytestmark = [pytest.mark.root, pytest.mark.slow]

STARTUP_S = 5


@pytest.fixture(scope="module")
def emulator(testbed: Testbed) -> str:
    return testbed.start_gcs_emulator(testbed.hosts[0])


def test_a_rank_frozen_with_its_torchrun_before_its_first_step_ends_the_job_as_a_start_up_hang(
    testbed: Testbed, known_hosts: Path, emulator: str, tmp_path: Path
) -> None:
    make_freeze_project(tmp_path)  # the last rank (on h1) freezes its torchrun and itself
    toml = testbed.cluster_toml("bed", sys.executable, env={"STORAGE_EMULATOR_HOST": emulator}, known_hosts=known_hosts)
    (tmp_path / "dtrain.toml").write_text(toml)
    out = bucket(emulator)
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "train", "train.py", "--cluster", "bed", "--nproc", "1", "--output", out,
                        "--startup-timeout", str(STARTUP_S)], cwd=tmp_path, env=cli_env(tmp_path, emulator),
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    took = time.monotonic() - t0
    text = r.stdout + r.stderr
    assert r.returncode == ExitCode.HUNG, text
    hang = [ln for ln in text.splitlines() if "dtrain: hang on " in ln]
    assert len(hang) == 1 and "dtrain: hang on h1 rank 1: no progress for " in hang[0], text
    assert "before its first step, at start-up; stacks in " in hang[0], hang
    run = open_store(f"{out.rstrip('/')}/{run_of(r.stdout)}")
    events = [json.loads(x) for x in run.read_bytes("events.jsonl").decode().splitlines() if x.strip()]
    hangs = [e for e in events if e.get("event") == "hang"]
    assert len(hangs) == 1 and hangs[0]["node"] == "h1" and hangs[0]["phase"] == "startup", hangs
    assert hangs[0]["timeout_s"] == STARTUP_S, hangs
    status = json.loads(run.read_bytes("status.json"))
    assert (status["state"], status["exit_code"]) == ("failed", ExitCode.HUNG), status
    assert "at start-up" in status["error"], status
    assert not any(job_processes(testbed).values()), job_processes(testbed)  # no agent or torchrun left on a host
    print(f"start-up hang over SSH: found and the job ended {took:.1f} s after `dtrain train` started")
