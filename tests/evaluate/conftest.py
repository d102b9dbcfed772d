"""Real runs to evaluate, trained once per session through the CLI (torchrun, one process): a tiny
Fashion-MNIST run and a tiny LoRA run (tiny-llama on a few KB of Python's own source)."""

from __future__ import annotations

import json
import subprocess
import sysconfig
from pathlib import Path

import pytest
from runs import CLI, Result, isolated_env, only_run

FASHION = Path("/usr/share/datasets/fashion-mnist")
# 2048 images, batch 64: 32 steps, one checkpoint at 16 and one at the end; 1000 test images.
MNIST_ARGS = ["--dataset", "fashion-mnist", "--train-split", "train[:2048]", "--eval-split", "test[:1000]",
              "--batch-size", "64", "--epochs", "1", "--checkpoint-every", "16", "--nproc", "1"]  # fmt: skip
MNIST_STEPS = 32
LORA_ARGS = ["--model", "tiny-llama", "--seq-len", "64", "--batch-size", "8", "--max-steps", "6",
             "--checkpoint-every", "3", "--nproc", "1"]  # fmt: skip


# Longer than tests/runs.py's 120 s: a LoRA evaluation loads transformers and samples token by token,
# which on two cores shared with other test jobs has taken 80 s.
CLI_TIMEOUT_S = 600


def cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    """The dtrain CLI in a subprocess (runs.cli with a longer timeout)."""
    p = subprocess.run([*CLI, *args], cwd=cwd, env=env if env is not None else isolated_env(cwd),
                       capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False)  # fmt: skip
    return Result(p.returncode, p.stdout, p.stderr)


def env(tmp: Path) -> dict[str, str]:
    return isolated_env(tmp, DTRAIN_LOG_EVERY="4")


@pytest.fixture(scope="session")
def mnist_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (FASHION / "t10k-images-idx3-ubyte.gz").exists():
        pytest.fail("needs Debian's dataset-fashion-mnist (scripts/setup.sh installs it)")
    cwd = tmp_path_factory.mktemp("mnist")
    r = cli(cwd, "train", "mnist", *MNIST_ARGS, "--output", "runs", env=env(cwd))
    assert r.code == 0, r.out + r.err
    return only_run(cwd / "runs")


@pytest.fixture(scope="session")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("lora")
    corpus = cwd / "corpus.txt"
    corpus.write_text((Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8"))
    r = cli(cwd, "train", "lora", *LORA_ARGS, "--data", str(corpus), "--output", "runs", env=env(cwd))
    assert r.code == 0, r.out + r.err
    return only_run(cwd / "runs")


def result(run: Path) -> dict:
    """The final figures the run recorded in status.json."""
    return json.loads((run / "status.json").read_text())["result"]
