"""Driving real runs from tests: the CLI in a subprocess, waiting on a run's files, and checking
that nothing of a run is left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.common.checkpoint import find_latest
from dtrain.common.storage import open_store

CLI = [sys.executable, "-c", "from dtrain.cli.main import main; main()"]
ENV = {"DTRAIN_OFFLINE": "1"}  # tests never reach the internet
POLL_S = 0.05


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ENV, **extra}


def dtrain(args: list[str], cwd: Path, timeout: float = 240, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=cwd, env=env(**extra_env), capture_output=True, text=True, timeout=timeout, check=False
    )


def start(args: list[str], cwd: Path, **extra_env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*CLI, *args], cwd=cwd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def only_run(out: Path) -> Path:
    (run,) = [p for p in out.iterdir() if p.is_dir()]
    return run


def metrics(run: Path) -> list[dict]:
    return [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n{out}")
        time.sleep(POLL_S)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def latest_step(run: Path) -> int:
    found = find_latest(open_store(str(run / "checkpoints"))) if (run / "checkpoints").exists() else None
    return found.step if found else 0


def peers(run: Path) -> list[dict]:
    status = json.loads((run / "status.json").read_text())
    return status.get("peers", []) if status.get("state") == "running" else []


def assert_no_workers_left(run_dirs: list[Path]) -> None:
    """No process of these runs survives (the launcher and PR_SET_PDEATHSIG see to it)."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    for run in run_dirs:
        assert run.name not in out, f"processes of {run.name} are still running:\n{out}"


def run_dir_of(cwd: Path, proc: subprocess.Popen) -> Path:
    """The one run directory under cwd/runs, once the run has made it."""
    runs = cwd / "runs"
    return wait_for(lambda: runs.exists() and any(runs.iterdir()) and only_run(runs), proc, what="the run directory")
