"""dtrain.lora.lean: the 16-bit step keeps less (norms' 16-bit inputs, SwiGLU's gate and up, one copy
of each shared LoRA input) and computes exactly the same loss and gradients as the stock step."""

from __future__ import annotations

import benchmark_scripts
import pytest

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

import torch  # noqa: E402

SHAPE = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def build(lean: bool, checkpointing: bool, adapter_dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtrain.lora import model as modelmod
    from dtrain.lora.fused import fuse_model
    from dtrain.lora.lean import lean_model

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=300, **SHAPE)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.05)  # B is zero at init: make every gradient flow
            p.data = p.data.to(adapter_dtype)
    fuse_model(model)  # as dtrain.lora.train.build_model: the fused forwards first
    counts = lean_model(model) if lean else {}
    if checkpointing:
        modelmod.enable_activation_checkpointing(model)
    model.train()
    return model, counts


def step(model, ids, live=None):
    from dtrain.lora.train import lm_loss

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, ids)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_lean_step_is_bitwise_the_stock_step(checkpointing, adapter_dtype):
    ids = torch.randint(0, 300, (2, 96), generator=torch.Generator().manual_seed(1))
    stock, _ = build(False, checkpointing, adapter_dtype)
    lean, counts = build(True, checkpointing, adapter_dtype)
    assert counts == {"norms": 5, "mlps": 2, "lora_inputs": 14}  # 2 per layer + the final norm; 7 per layer
    loss_a, grads_a = step(stock, ids)
    loss_b, grads_b = step(lean, ids)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 28
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
        assert grads_a[name].abs().sum() > 0, name


def _peak(model, ids) -> int:
    bench = benchmark_scripts.load_script("memory_plan")
    step(model, ids)  # the first step: nothing pending from the build
    model.zero_grad(set_to_none=True)
    with bench.LiveBytes() as live:
        for t in [*model.parameters(), ids]:
            live.track(t)
        start = live.current
        step(model, ids)
    return live.peak - start


def test_lean_step_keeps_less():
    # Without checkpointing every layer's saved tensors are alive at the backward's start: the lean
    # step drops, per token and layer, the norms' fp32 copies (2 x 4h -> 2 x 2h), silu(gate) (2f) and
    # peft's per-projection input copies under fp32 adapters (2 x (5h + q + f) -> 2 x (2h + f)).
    ids = torch.randint(0, 300, (2, 128), generator=torch.Generator().manual_seed(1))
    stock = _peak(build(False, False)[0], ids)
    lean = _peak(build(True, False)[0], ids)
    h, f, tokens, layers = 64, 176, 256, 2
    saved = tokens * layers * (2 * 2 * h + 2 * f + 2 * (3 * h + h + 0))  # norms, silu, the 4 extra input copies
    assert stock - lean > 0.8 * saved, (stock, lean, saved)
