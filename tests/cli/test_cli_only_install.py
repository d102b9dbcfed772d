"""The CLI on an install without torch (`pip install dtrain`, no extras), as a laptop that only
drives clusters has it: every command that does not train here works, and training here says what
to install. The install is a real `pip install .` (not editable) into a fresh virtualenv."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cli_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv holding dtrain as `pip install .` makes it, without extras; yields its dtrain."""
    root = tmp_path_factory.mktemp("cli-only")
    # A copy of the checkout: building the wheel writes build/ and *.egg-info next to the sources.
    source = root / "src"
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "runs", "wheels", "__pycache__", "*.egg-info")
    shutil.copytree(REPO, source, ignore=skip, symlinks=True)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(source)], capture_output=True, text=True
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch"], capture_output=True)
    assert probe.returncode != 0, "torch must not be installed with the CLI alone"
    return venv / "bin" / "dtrain"


def _run_dir(root: Path) -> str:
    """A finished two-node run as the launchers leave it, written by hand (no torch here)."""
    run_id = "mnist-20261101-120000-abcd"
    run = root / run_id
    (run / "checkpoints" / "step-00000120").mkdir(parents=True)
    (run / "logs").mkdir()
    (run / "config.json").write_text(
        json.dumps({"workload": "mnist", "run_id": run_id, "created": time.time(), "world_size": 4, "config": {}})
    )
    (run / "status.json").write_text(json.dumps({"state": "completed", "exit_code": 0}))
    (run / "metrics.jsonl").write_text('{"step": 60, "eval_accuracy": 0.85}\n{"step": 120, "eval_accuracy": 0.9125}\n')
    (run / "checkpoints" / "step-00000120" / "meta.json").write_text('{"step": 120, "files": {}}')
    (run / "checkpoints" / "LATEST").write_text("step-00000120")
    (run / "logs" / "h0.log").write_text("2026-11-01T12:00:01.000+00:00 epoch 1/1: eval accuracy 0.9125\n")
    (run / "logs" / "h1.log").write_text("2026-11-01T12:00:00.500+00:00 joined\n")
    return run_id


def test_commands_that_do_not_train_work_without_torch(cli_only: Path, tmp_path: Path):
    run_id = _run_dir(tmp_path / "runs")

    def dtrain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(cli_only), *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)

    for args in (["--help"], ["train", "mnist", "--help"], ["config", "show"], ["runs"]):
        r = dtrain(*args)
        assert r.returncode == 0, (args, r.stdout + r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
    rows = json.loads(dtrain("runs", "--json").stdout)
    assert [(r["run_id"], r["status"], r["step"], r["best_value"], r["world_size"]) for r in rows] == [
        (run_id, "completed", 120, 0.9125, 4)
    ]
    logs = dtrain("logs", run_id)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() == ["[h1] joined", "[h0] epoch 1/1: eval accuracy 0.9125"]


def test_training_here_without_torch_says_what_to_install(cli_only: Path, tmp_path: Path):
    r = subprocess.run([str(cli_only), "train", "mnist"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in r.stderr
    assert line.startswith("error: training on this machine needs torch, which this Python (")
    assert line.endswith(
        "pip install 'dtrain[train]' (scripts/setup.sh does it), or train on a cluster with --cluster NAME"
    )
    assert not (tmp_path / "runs").exists()
