"""The fused LoRA linear computes what peft's own forward computes: same loss, same gradients, and
peft's path wherever the fused one does not apply."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.lora.fused import fuse_lora_linears  # noqa: E402
from dtrain.lora.model import apply_lora, load_base  # noqa: E402


def lora_model(name: str, dropout: float = 0.0):
    m, _ = load_base(name, torch.float32, seed=0)
    m, _ = apply_lora(m, name, r=4, alpha=8, dropout=dropout, targets=[], seed=0)
    torch.manual_seed(1)
    for n, p in m.named_parameters():
        if "lora_B" in n:  # B starts at zero; give the low-rank path something to carry
            torch.nn.init.normal_(p, std=0.05)
    return m


def loss_and_grads(m, x):
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


def test_fused_equals_peft_in_loss_and_every_lora_gradient():
    peft_path, fused = lora_model("tiny-llama"), lora_model("tiny-llama")
    assert fuse_lora_linears(fused) == 4 * 7  # every projection of every layer
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    l1, g1 = loss_and_grads(peft_path, x)
    l2, g2 = loss_and_grads(fused, x)
    assert l2 == pytest.approx(l1, rel=1e-6)
    assert g1.keys() == g2.keys()
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-4, atol=1e-7)


def test_layers_it_cannot_fuse_keep_peft_forward():
    gpt2 = lora_model("tiny-gpt2")
    assert fuse_lora_linears(gpt2) == 0  # GPT-2's Conv1D projections are not nn.Linear

    with_dropout, reference = lora_model("tiny-llama", dropout=0.1), lora_model("tiny-llama", dropout=0.1)
    fuse_lora_linears(with_dropout)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    l1, _ = loss_and_grads(reference, x)
    torch.manual_seed(5)
    l2, _ = loss_and_grads(with_dropout, x)
    assert l1 == l2  # dropout > 0: the patched layer ran peft's own forward, same random mask


def test_autocast_falls_back_to_peft():
    peft_path, fused = lora_model("tiny-llama"), lora_model("tiny-llama")
    fuse_lora_linears(fused)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l1, _ = loss_and_grads(peft_path, x)
        l2, _ = loss_and_grads(fused, x)
    assert l1 == l2
