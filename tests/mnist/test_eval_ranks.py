"""Evaluation on a split smaller than the world size (gloo, 2 real processes): the rank whose shard
is empty must not skip a collective its peer makes. Evaluating through DDP broadcast BatchNorm's
statistics inside the forward pass, which only the rank with an image ran: a hang until the
collective timeout."""

from __future__ import annotations

import math
from pathlib import Path

import runs
from helpers import write_dataset
from runs import metrics, only_run

DIST_TIMEOUT_S = "30"  # a hang fails the test in well under a minute


def test_one_eval_image_two_ranks_completes(tmp_path: Path):
    data = write_dataset(tmp_path / "data", 256, 16, seed=3)
    args = ["train", "mnist", "--data-dir", str(data), "--eval-split", "test[:1]", "--batch-size", "64",
            "--epochs", "1", "--nproc", "2", "--output", "runs"]  # fmt: skip
    r = runs.dtrain(args, tmp_path, timeout=180, DTRAIN_DIST_TIMEOUT=DIST_TIMEOUT_S)
    assert r.returncode == 0, r.stdout + r.stderr
    (row,) = [m for m in metrics(only_run(tmp_path / "runs")) if "eval_accuracy" in m]
    assert row["step"] == 4 and row["eval_accuracy"] in (0.0, 1.0)  # one image: right or wrong
    assert math.isfinite(row["eval_loss"]) and row["eval_loss"] > 0
