"""QLoRA (--quant 4bit): on a machine without a CUDA GPU the CLI refuses it in one line that says what to
do instead, before loading anything; and the QLoRA model path itself (NF4 with double quantization
through transformers' bitsandbytes loader, peft's k-bit preparation, LoRA, activation checkpointing, a
few optimizer steps, the adapter saved and reloaded with stock peft) run here on bitsandbytes' CPU
kernels, with a micro Llama. benchmarks/gpu_smoke.py runs the same path on a GPU, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import runs
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.common.errors import ExitCode  # noqa: E402
from dtrain.lora import quant  # noqa: E402
from dtrain.lora.model import apply_lora, enable_activation_checkpointing, load_base  # noqa: E402

TEXT = "def add(a, b):\n    return a + b\n\n" * 8


def test_qlora_without_a_gpu_is_refused_in_one_line(tmp_path: Path, corpus: Path):
    env = runs.isolated_env(tmp_path, CUDA_VISIBLE_DEVICES="")
    r = runs.cli(tmp_path, "train", "lora", "--model", "tiny-llama", "--data", str(corpus), "--quant", "4bit",
                 "--nproc", "1", "--output", "runs", env=env)  # fmt: skip
    assert r.code == ExitCode.USAGE, r.err
    line = r.error_line()
    assert "--quant 4bit needs a CUDA GPU" in line and "use --quant none" in line, line
    assert "memory:" not in r.out and "model tiny-llama" not in r.out  # refused before loading the model
    assert not any((tmp_path / "runs").glob("*/checkpoints/*"))


@pytest.fixture
def nf4_llama(monkeypatch: pytest.MonkeyPatch) -> str:
    """A 2-layer Llama 64 wide: bitsandbytes' CPU kernels need rows of at least one 64-value block."""
    from dtrain.lora import model

    shape = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    monkeypatch.setitem(model.PRESETS, "nf4-llama", model.Preset("llama", shape, model.LLAMA_TARGETS))
    return "nf4-llama"


def quantized(preset: str) -> torch.nn.Module:
    compute = quant.compute_dtype(torch.device("cpu"))
    model, _ = load_base(preset, compute, seed=0, quantization=quant.nf4_config(compute))
    return model


@pytest.mark.slow  # ~30 s: bitsandbytes' CPU kernels take over a second a step even for this model
def test_the_qlora_path_trains_on_nf4_weights_and_its_adapter_loads_with_stock_peft(nf4_llama, tmp_path):
    from peft import PeftModel

    model = quantized(nf4_llama)
    q_proj = model.model.layers[0].self_attn.q_proj
    state = q_proj.weight.quant_state
    assert type(q_proj).__name__ == "Linear4bit" and state.quant_type == "nf4"
    assert state.nested  # double quantization: the block scales quantized too
    assert q_proj.weight.numel() == 64 * 64 // 2  # two 4-bit values a byte
    model = quant.prepare(model)
    model, _ = apply_lora(model, nf4_llama, r=8, alpha=16, dropout=0.0, targets=[], seed=0)
    enable_activation_checkpointing(model)
    assert quant.is_quantized(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 2 and {p.dtype for p in trainable} == {torch.float32}

    x = torch.tensor([list(TEXT.encode())[:64]])
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # Rank-8 updates on a random base learn slowly: 5.58 -> 5.08 in 10 steps measured.
    assert losses[-1] < losses[0] - 0.2, losses

    model.save_pretrained(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and "dtrain-preset-" not in str(config["base_model_name_or_path"])
    model.eval()
    reloaded = PeftModel.from_pretrained(quantized(nf4_llama), str(tmp_path / "adapter")).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = model(input_ids=x).logits.float(), reloaded(input_ids=x).logits.float()
    # peft's preparation keeps the norms and embeddings in fp32, the reloaded base has them in bf16:
    # the same adapter on the same NF4 weights, up to that rounding.
    assert (want - got).abs().max().item() < 0.05 * want.abs().max().item()
