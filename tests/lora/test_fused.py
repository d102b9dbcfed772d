"""The fused LoRA step computes what transformers + peft compute: same loss, same gradients, the stock
path wherever a fused one does not apply, and each fused function's backward is its forward's
derivative (gradcheck in float64)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.lora import fused as fused_module  # noqa: E402
from dtrain.lora.fused import RMSNormFn, RopeFn, fuse_lora_linears, fuse_model, linear  # noqa: E402
from dtrain.lora.model import apply_lora, load_base  # noqa: E402

TINY_QWEN2 = dict(  # grouped-query attention (4 query heads, 2 key/value heads) and q/k/v biases
    vocab_size=258,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def with_lora(m, name: str, dropout: float = 0.0):
    m, _ = apply_lora(m, name, r=4, alpha=8, dropout=dropout, targets=[], seed=0)
    torch.manual_seed(1)
    for n, p in m.named_parameters():
        if "lora_B" in n:  # B starts at zero; give the low-rank path something to carry
            torch.nn.init.normal_(p, std=0.05)
    return m


def lora_model(name: str, dropout: float = 0.0):
    m, _ = load_base(name, torch.float32, seed=0)
    return with_lora(m, name, dropout)


def qwen2_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **TINY_QWEN2)
    m = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return with_lora(m, "tiny-qwen2")


def loss_and_grads(m, x, **kw):
    m.zero_grad(set_to_none=True)
    loss = m(input_ids=x, labels=x, use_cache=False, **kw).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


def graph_nodes(loss: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind `loss`: which functions actually ran."""
    seen, todo, names = set(), [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


def assert_same(stock, fused, x, **kw):
    l1, g1 = loss_and_grads(stock, x, **kw)
    l2, g2 = loss_and_grads(fused, x, **kw)
    assert l2 == pytest.approx(l1, rel=1e-6)
    assert g1.keys() == g2.keys() and g1
    for k in g1:
        torch.testing.assert_close(g2[k], g1[k], rtol=1e-4, atol=1e-7)


def test_fused_llama_equals_stock_in_loss_and_every_lora_gradient():
    stock, fused = lora_model("tiny-llama"), lora_model("tiny-llama")
    assert fuse_model(fused) == {"lora_linears": 4 * 7, "rms_norms": 4 * 2 + 1, "attention": 4}
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert_same(stock, fused, x)
    nodes = graph_nodes(fused(input_ids=x, labels=x, use_cache=False).loss)
    assert {"LoraLinearFnBackward", "RMSNormFnBackward", "RopeFnBackward"} <= nodes  # the fused path ran


def test_fused_qwen2_with_grouped_query_attention_and_biases_equals_stock():
    stock, fused = qwen2_model(), qwen2_model()
    assert fuse_model(fused) == {"lora_linears": 2 * 7, "rms_norms": 2 * 2 + 1, "attention": 2}
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    assert_same(stock, fused, x)


def test_padding_mask_goes_through_the_stock_attention_function():
    stock, fused = lora_model("tiny-llama"), lora_model("tiny-llama")
    fuse_model(fused)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(x)
    mask[1, 20:] = 0  # the second row is padded: is_causal alone would be wrong here
    assert_same(stock, fused, x, attention_mask=mask)


def test_rms_norm_and_rotary_backward_are_their_forward_derivatives():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(16, dtype=torch.float64, generator=g)
    assert torch.autograd.gradcheck(lambda t: RMSNormFn.apply(t, w, 1e-6), (x,))
    q = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()  # strided, as q is
    angle = torch.randn(2, 5, 4, dtype=torch.float64, generator=g)
    angle = torch.cat([angle, angle], -1).unsqueeze(1)  # rotary's cos/sin repeat over the two halves
    assert torch.autograd.gradcheck(lambda t: RopeFn.apply(t, angle.cos(), angle.sin()), (q,))


def test_layers_it_cannot_fuse_keep_the_stock_forward():
    gpt2 = lora_model("tiny-gpt2")
    assert fuse_model(gpt2) == {"lora_linears": 0, "rms_norms": 0, "attention": 0}  # Conv1D, LayerNorm, no rotary

    with_dropout, reference = lora_model("tiny-llama", dropout=0.1), lora_model("tiny-llama", dropout=0.1)
    fuse_lora_linears(with_dropout)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    l1, _ = loss_and_grads(reference, x)
    torch.manual_seed(5)
    l2, _ = loss_and_grads(with_dropout, x)
    assert l1 == l2  # dropout > 0: the patched layer ran peft's own forward, same random mask


def test_autocast_falls_back_to_the_stock_linear_and_norm():
    stock, fused = lora_model("tiny-llama"), lora_model("tiny-llama")
    fuse_model(fused)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l1, _ = loss_and_grads(stock, x)
        l2, _ = loss_and_grads(fused, x)
        nodes = graph_nodes(fused(input_ids=x, labels=x, use_cache=False).loss)
    assert not {"LoraLinearFnBackward", "RMSNormFnBackward"} & nodes
    assert l2 == pytest.approx(l1, rel=1e-3)  # the rotary pass rounds differently in bf16: close, not equal


def test_linear_equals_mm_with_strided_operands_through_onednn_and_without(monkeypatch):
    if torch.backends.mkldnn.is_available():
        assert fused_module._ONEDNN  # where torch has oneDNN, the fused step really uses it
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 8, generator=g).t()  # 8 x 64, transposed as u^T is in the backward
    w = torch.randn(48, 64, generator=g)[:40]  # rows of a bigger matrix, as W' is of [W'; A]
    want = x.double() @ w.double().t()
    torch.testing.assert_close(linear(x, w).double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, w.t().contiguous().t()).double(), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(fused_module, "_ONEDNN", False)
    torch.testing.assert_close(linear(x, w).double(), want, rtol=1e-5, atol=1e-5)


def test_the_fused_linear_runs_on_the_cpu_only():
    """The fused linear exists for oneDNN. On a GPU its [W'; A] would be a second copy of every adapted
    weight, kept for the backward, for a product cuBLAS runs as fast unfused. A meta tensor stands in
    for a CUDA one here: on any device but the CPU the layer takes peft's own forward."""
    m = lora_model("tiny-llama")
    assert fuse_lora_linears(m) == 4 * 7
    layer = m.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 8, 256, requires_grad=True)
    assert "LoraLinearFnBackward" in graph_nodes(layer(x).sum())
    layer.to("meta")
    y = layer(x.detach().to("meta").requires_grad_())
    assert y.device.type == "meta" and y.shape == (2, 8, 256)
    assert "LoraLinearFnBackward" not in graph_nodes(y.sum())


def sdpa_backends(monkeypatch) -> list[tuple[str, int, int]]:
    """Record, for every SDPA call from here on, the backend torch's dispatcher picks for it and the
    query and key head counts."""
    from torch.nn.attention import SDPBackend

    stock, calls = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        calls.append((SDPBackend(choice).name, q.shape[1], k.shape[1]))
        return stock(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_grouped_query_attention_on_the_cpu_runs_a_fused_kernel(monkeypatch):
    """Qwen2-style heads (4 query, 2 key/value) with no mask: transformers passes enable_gqa, and on the
    CPU torch's flash kernel takes it. (On a GPU only flash and cuDNN take grouped heads, and neither
    runs in fp32 or on a T4: benchmarks/gpu_smoke.py checks the choice there.)"""
    fused = qwen2_model()
    fuse_model(fused)
    calls = sdpa_backends(monkeypatch)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    fused(input_ids=x, labels=x, use_cache=False).loss.backward()
    assert calls == [("FLASH_ATTENTION", 4, 2)] * 2  # both layers, grouped heads, not the math backend
    assert fused_module.grouped_heads_fused(
        torch.ones(1, 4, 8, 16), torch.ones(1, 2, 8, 16), torch.ones(1, 2, 8, 16), 0.0
    )


def test_where_grouped_heads_are_not_fused_keys_and_values_are_repeated_exactly(monkeypatch):
    """The path a T4 or fp32 on a GPU takes, forced here: the key/value heads repeated to the query
    heads before SDPA, the same loss and gradients as stock, and a fused kernel instead of math."""
    stock, fused = qwen2_model(), qwen2_model()
    fuse_model(fused)
    monkeypatch.setattr(fused_module, "grouped_heads_fused", lambda q, k, v, dropout: False)
    calls = sdpa_backends(monkeypatch)
    x = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    l_stock, _ = loss_and_grads(stock, x)
    del calls[:]
    l_fused, _ = loss_and_grads(fused, x)
    assert calls == [("FLASH_ATTENTION", 4, 4)] * 2  # on a GPU: the memory-efficient kernel (equal heads)
    assert l_fused == pytest.approx(l_stock, rel=1e-6)
    assert_same(stock, fused, x)
