"""Precision across a run's life, on this CPU with fp16 autocast and GradScaler("cpu") standing in
for a T4: a checkpoint trained without loss scaling (fp32 here; bf16 on an L4 is the same, an empty
scaler state) resumes in fp16 and back; a loss that turns NaN, or an fp16 loss scale that collapses
while the loss stays finite, fails the run with one line naming the precision to use."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from runs import forced_fp16_on_cpu, in_process, metrics, only_run

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.lora import train as lora_train  # noqa: E402 - after the skip

ARGS = ["--model", "micro-llama", "--seq-len", "32", "--batch-size", "4", "--lr", "1e-2",
        "--log-every", "2", "--checkpoint-every", "2", "--eval-batches", "1"]  # fmt: skip


@pytest.fixture(autouse=True)
def _micro(micro_llama):
    """Every run here uses the micro preset (conftest.py)."""


def state_at(run: Path, step: int) -> dict:
    data = (run / "checkpoints" / f"step-{step:08d}" / "state.pt").read_bytes()
    return torch.load(io.BytesIO(data), weights_only=True)


def events(run: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run / "events.jsonl").read_text().splitlines()]
    return [{k: e[k] for k in ("step", "event", "message")} for e in rows if e["event"] == "precision"]


def test_a_checkpoint_without_loss_scaling_resumes_in_fp16_and_back(tmp_path, corpus, monkeypatch):
    out = str(tmp_path / "runs")
    base = [*ARGS, "--data", str(corpus), "--output", out]
    assert in_process(lora_train.main, [*base, "--max-steps", "4"], monkeypatch) == 0  # fp32: auto on a CPU
    run = only_run(tmp_path / "runs")
    assert state_at(run, 4)["scaler"] == {}  # what GradScaler refuses to load

    with monkeypatch.context() as m:
        forced_fp16_on_cpu(m)
        assert in_process(lora_train.main, ["--resume", run.name, "--output", out, "--max-steps", "8"], m) == 0
    assert state_at(run, 4)["precision"] == "fp32"
    fp16 = state_at(run, 8)
    assert fp16["precision"] == "fp16" and fp16["scaler"]["scale"] == 65536.0  # no step overflowed

    assert in_process(lora_train.main, ["--resume", run.name, "--output", out, "--max-steps", "10"], monkeypatch) == 0
    assert events(run) == [
        {"step": 4, "event": "precision", "message": "precision changed since the checkpoint: fp32 -> fp16; "
         "fp16 loss scaling starts from its initial scale (65536)"},
        {"step": 8, "event": "precision", "message": "precision changed since the checkpoint: fp16 -> fp32; "
         "the checkpoint's fp16 loss scale is not needed and is dropped"},
    ]  # fmt: skip
    losses = {m["step"]: m["loss"] for m in metrics(run) if "loss" in m}
    assert sorted(losses) == [2, 4, 6, 8, 10] and all(math.isfinite(v) for v in losses.values())
    assert losses[10] < losses[2]  # it went on training through both changes


def failed_run(tmp_path: Path, corpus: Path, monkeypatch, capsys, loss_fn) -> tuple[int, str, Path]:
    monkeypatch.setattr(lora_train, "lm_loss", loss_fn)
    forced_fp16_on_cpu(monkeypatch)
    argv = [*ARGS, "--data", str(corpus), "--output", str(tmp_path / "runs"), "--max-steps", "24"]
    code = in_process(lora_train.main, argv, monkeypatch)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, lines
    return code, lines[0], only_run(tmp_path / "runs")


def test_a_nan_loss_fails_the_run_with_one_line(tmp_path, corpus, monkeypatch, capsys):
    stock = lora_train.lm_loss
    code, line, run = failed_run(tmp_path, corpus, monkeypatch, capsys, lambda model, x: stock(model, x) * float("nan"))
    assert code == 1
    assert line == (
        "error: the training loss is nan at step 2 (fp16): rerun with --precision fp32, or --precision bf16 "
        "on a GPU that has it (not a T4)"
    )
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 1  # kept, with its metrics, for a look
    assert [m["step"] for m in metrics(run) if "loss" in m] == [2] and not (run / "checkpoints").exists()


class InfiniteGradient(torch.autograd.Function):
    """The loss unchanged going forward; an infinite gradient coming back (an fp16 overflow)."""

    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def test_a_collapsed_loss_scale_fails_the_run_with_one_line(tmp_path, corpus, monkeypatch, capsys):
    stock = lora_train.lm_loss
    code, line, run = failed_run(
        tmp_path, corpus, monkeypatch, capsys, lambda model, x: InfiniteGradient.apply(stock(model, x))
    )
    assert code == 1
    # 2**16 halved at every skipped step: below 1 after 17, seen at the next logged step, 18, as 2**-2.
    assert line == (
        "error: fp16 loss scale fell to 0.25 at step 18: the gradients overflow fp16 and the optimizer has been "
        "skipping steps; rerun with --precision fp32, or --precision bf16 on a GPU that has it (not a T4)"
    )
    losses = [m["loss"] for m in metrics(run) if "loss" in m]
    assert len(losses) == 9 and all(math.isfinite(v) for v in losses)  # finite all along: only the scale told
