"""Accuracy bars of the default MNIST configuration, on real data that is available offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from shared_data import SHARED_MNIST, SHARED_SKIP_REASON

FASHION = Path("/usr/share/datasets/fashion-mnist")
CLI = [sys.executable, "-c", "from dtrain.cli.main import main; main()"]


def train(cwd: Path, *args: str, timeout: float = 900) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_")}
    r = subprocess.run(
        [*CLI, "train", "mnist", "--output", "runs", *args],
        cwd=cwd,
        env={**env, "DTRAIN_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = (cwd / "runs").iterdir()
    return json.loads((run / "status.json").read_text())["result"]


@pytest.mark.skipif(not (SHARED_MNIST / "t10k-images-idx3-ubyte.gz").exists(), reason=SHARED_SKIP_REASON)
def test_real_mnist_first_8000_train_last_2000_eval_reach_97_5(tmp_path):
    """The only real MNIST offline is the 10k test split: train on its first 8,000 images with
    the default config, evaluate on the last 2,000."""
    result = train(
        tmp_path,
        "--dataset",
        "mnist",
        "--data-dir",
        str(SHARED_MNIST),
        "--train-split",
        "test[:8000]",
        "--eval-split",
        "test[8000:]",
    )
    assert result["accuracy"] >= 0.975, result


@pytest.mark.slow
@pytest.mark.skipif(not FASHION.exists(), reason="needs Debian's dataset-fashion-mnist")
def test_readme_default_run_reaches_91_on_fashion_mnist(tmp_path):
    """The README's first command, as written (the timing is in benchmarks/, not asserted here)."""
    result = train(tmp_path, "--dataset", "fashion-mnist")
    assert result["accuracy"] >= 0.91, result
