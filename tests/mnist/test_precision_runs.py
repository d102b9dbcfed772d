"""An MNIST checkpoint trained without loss scaling (fp32 here, bf16 on an L4: an empty scaler state)
resumes in fp16 with loss scaling, as on a T4; this CPU stands in with fp16 autocast and
GradScaler("cpu")."""

from __future__ import annotations

import json
import math

from helpers import write_dataset
from runs import forced_fp16_on_cpu, in_process, metrics, only_run

from dtrain.mnist import train as mnist_train

# 512 images, batch 64: 8 steps an epoch.
ARGS = ["--batch-size", "64", "--log-every", "4", "--eval-split", "test[:64]"]


def test_an_fp32_checkpoint_resumes_in_fp16(tmp_path, monkeypatch):
    data = write_dataset(tmp_path / "data", 512, 64, seed=5)
    out = str(tmp_path / "runs")
    argv = [*ARGS, "--data-dir", str(data), "--output", out]
    assert in_process(mnist_train.main, [*argv, "--epochs", "1"], monkeypatch) == 0
    run = only_run(tmp_path / "runs")

    forced_fp16_on_cpu(monkeypatch)
    assert in_process(mnist_train.main, ["--resume", run.name, "--output", out, "--epochs", "2"], monkeypatch) == 0
    rows = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    (event,) = [e for e in rows if e["event"] == "precision"]
    assert not [m for m in metrics(run) if "event" in m]  # the metrics stay measurements
    assert (event["step"], event["precision"]) == (8, "fp16")
    assert event["message"].startswith("precision changed since the checkpoint: fp32 -> fp16;")
    losses = {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}
    assert sorted(losses) == [4, 8, 12, 16] and all(math.isfinite(v) for v in losses.values())
