"""The LoRA run's exports work with the stock libraries, end to end through the real `dtrain` CLI:
final/adapter loads with plain `peft.PeftModel.from_pretrained(base, path)` and final/merged with
plain `transformers.AutoModelForCausalLM.from_pretrained(path)`, and both give the eval loss the
run reported. A run in a bucket exports there too and resumes from the bucket's checkpoint.

The base model is rebuilt here as training built it: presets are random weights drawn from the
run's seed (--seed, default 0), so `load_base("tiny-llama", float32, seed=0)` is the same model.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import runs
import torch

from dtrain.common.errors import ExitCode
from dtrain.common.storage import open_store
from dtrain.lora.data import load_blocks
from dtrain.lora.model import LLAMA_TARGETS, ByteTokenizer, load_base

CLI_TIMEOUT_S = 240  # the 12-step run with --merge takes ~25 s on 2 shared CPU cores
SEED = 0  # the run's --seed default: presets draw their base weights from it
SEQ_LEN, BATCH = 64, 4
EVAL_FRACTION = 0.05  # the --eval-fraction default
TINY = ["--model", "tiny-llama", "--seq-len", str(SEQ_LEN), "--batch-size", str(BATCH), "--nproc", "1"]


def train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`dtrain train lora` on tiny-llama; asserts it completed without a traceback."""
    r = runs.dtrain(["train", "lora", *TINY, *args], cwd, timeout=CLI_TIMEOUT_S)
    assert r.returncode == ExitCode.OK, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return r


def base_model() -> torch.nn.Module:
    """A fresh copy of the run's base model (PeftModel.from_pretrained changes the one it is given)."""
    model, _ = load_base("tiny-llama", torch.float32, seed=SEED)
    return model


@torch.no_grad()
def eval_loss(model: torch.nn.Module, blocks: torch.Tensor, micro: int = BATCH) -> float:
    """What dtrain.lora.train.evaluate computes on one process: the mean loss of each micro-batch
    (batch_size / processes / grad_accum blocks), weighted by its number of blocks."""
    model.eval()
    total, count = 0.0, 0
    threads = torch.get_num_threads()
    # One thread: on a shared 2-core machine, OpenMP threads waiting on a busy core make these tiny
    # forward passes 10-30x slower. The sum is the same to ~1e-7.
    torch.set_num_threads(1)
    try:
        for i in range(0, blocks.shape[0], micro):
            x = blocks[i : i + micro]
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            total += loss.double().item() * x.shape[0]
            count += x.shape[0]
    finally:
        torch.set_num_threads(threads)
    return total / count


def held_out(corpus: str) -> torch.Tensor:
    """The run's held-out blocks, rebuilt from the same file, tokenizer, block size and seed."""
    return load_blocks(corpus, "text", ByteTokenizer(), SEQ_LEN, EVAL_FRACTION, SEED).eval


@dataclasses.dataclass
class Trained:
    run: Path
    result: dict
    eval_blocks: torch.Tensor


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Trained:
    """A completed 12-step run with --merge, and the held-out blocks it was evaluated on."""
    cwd = tmp_path_factory.mktemp("interop")
    args = ["--data", str(corpus), "--max-steps", "12", "--lr", "2e-3", "--merge", "--output", "runs"]
    train(cwd, *args)
    run = runs.only_run(cwd / "runs")
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed", status
    return Trained(run, status["result"], held_out(str(corpus)))


def test_the_adapter_is_in_peft_format_with_the_run_settings(trained):
    adapter = trained.run / "final" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0  # --lora-r / --lora-alpha defaults
    assert sorted(cfg["target_modules"]) == sorted(LLAMA_TARGETS)  # attention and MLP projections
    assert trained.result["target_modules"] == list(LLAMA_TARGETS)
    assert trained.result["steps"] == 12


def test_the_adapter_loads_with_stock_peft_and_gives_the_runs_eval_loss(trained):
    from peft import PeftModel

    base = base_model()
    base_loss = eval_loss(base, trained.eval_blocks)
    # The rebuilt base is the run's: LoRA starts as a no-op, so the run's step-0 eval is the base's loss.
    (step0,) = [m["eval_loss"] for m in runs.metrics(trained.run) if m["step"] == 0 and "eval_loss" in m]
    assert base_loss == pytest.approx(step0, abs=1e-5)

    model = PeftModel.from_pretrained(base, str(trained.run / "final" / "adapter"))
    adapted = eval_loss(model, trained.eval_blocks)
    assert adapted == pytest.approx(trained.result["eval_loss"], abs=1e-5)
    # The adapter is not a no-op: 12 steps at lr 2e-3 moved the loss (5.61 -> 4.28 at the time of writing).
    assert base_loss - adapted > 1e-3


def test_the_merged_model_loads_with_stock_transformers_and_gives_the_same_loss(trained):
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(trained.run / "final" / "merged"))
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not [n for n in merged.state_dict() if "lora" in n]  # a plain model: LoRA folded in
    assert eval_loss(merged, trained.eval_blocks) == pytest.approx(trained.result["eval_loss"], abs=1e-4)


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_a_run_in_a_bucket_exports_there_and_resumes_from_it(tmp_path, gcs_bucket, corpus):
    out = f"{gcs_bucket}/runs"
    train(tmp_path, "--data", str(corpus), "--max-steps", "4", "--output", out)
    root = open_store(out)
    run_id = runs.only_run_in_bucket(
        out,
        tmp_path,
        (*runs.RUN_FILES, "final/adapter/adapter_config.json", "final/adapter/adapter_model.safetensors"),
    )
    have = runs.bucket_checkpoints(out, run_id)  # written locally, copied to the run's ckpt/ (as for any program)
    assert {"LATEST", "step-00000004/state.pt", "step-00000004/meta.json"} <= set(have), have

    # --resume takes the run's saved settings (model, data, sizes); only the step count changes.
    r = train(tmp_path, "--resume", run_id, "--output", out, "--max-steps", "6")
    assert "checkpoint directory restored" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "/checkpoints/step-00000004 (step 4)" in r.stdout, r.stdout
    status = json.loads(root.read_bytes(f"{run_id}/status.json"))
    assert status["state"] == "completed" and status["result"]["steps"] == 6
    assert "step-00000006/meta.json" in runs.bucket_checkpoints(out, run_id)

    # The bucket's adapter is the resumed run's: fetched as is, it gives the eval loss of step 6.
    local = tmp_path / "adapter"
    run = root.child(run_id)
    local.mkdir()
    for name in run.list("final/adapter"):
        (local / Path(name).name).write_bytes(run.read_bytes(name))
    from peft import PeftModel

    model = PeftModel.from_pretrained(base_model(), str(local))
    assert eval_loss(model, held_out(str(corpus))) == pytest.approx(status["result"]["eval_loss"], abs=1e-5)
