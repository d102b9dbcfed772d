"""The chunked cross-entropy (dtrain.lora.loss): the loss and LoRA gradients of the stock transformers
loss, with ignored labels, in fp32 and under bf16 autocast, through DDP's and peft's wrappers; and a
peak that holds one chunk's fp32 logits, not every token's."""

from __future__ import annotations

import benchmark_scripts
import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.lora import loss as lossmod  # noqa: E402
from dtrain.lora.model import apply_lora  # noqa: E402

IGNORE = lossmod.IGNORE


def lora_llama(vocab: int = 300, tied: bool = False) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model, _ = apply_lora(model, "m", r=4, alpha=8, dropout=0.0, targets=["q_proj", "v_proj", "down_proj"], seed=0)
    for n, p in model.named_parameters():  # LoRA B starts at zero: give the gradients something to carry
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model


def stock(model, ids, labels):
    logits = model(input_ids=ids, use_cache=False).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE, reduction="sum"
    )


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_equals_the_stock_loss_and_gradients(precision, tied):
    model = lora_llama(tied=tied)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 40), generator=g)
    labels = ids.clone()
    labels[0, :15] = IGNORE  # a prompt that trains nothing
    labels[2, 30:] = IGNORE
    tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        want = stock(model, ids, labels)
    want_g = grads(model, want)
    for chunk in (7, 64, 10_000):  # chunks that split rows, a row and more, everything at once
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            got, count = lossmod.causal_lm_loss(model, ids, labels, chunk=chunk)
        assert int(count) == int((labels[:, 1:] != IGNORE).sum())
        torch.testing.assert_close(got, want, **tol)
        got_g = grads(model, got)
        assert got_g.keys() == want_g.keys() and len(got_g) == 12
        for n in want_g:
            torch.testing.assert_close(got_g[n], want_g[n], **tol, msg=n)
    # the output layer is itself again: its logits, not the hidden states
    assert model(input_ids=ids[:, :5]).logits.shape[-1] == 300


def test_a_trained_output_layer_gets_the_stock_gradient():
    model = lora_llama()
    head = lossmod.output_layer(model)
    head.weight.requires_grad_(True)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    want = stock(model, ids, ids)
    want_g = grads(model, want)["base_model.model.lm_head.weight"]
    got, _ = lossmod.causal_lm_loss(model, ids, ids, chunk=9)
    got_g = grads(model, got)["base_model.model.lm_head.weight"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=1e-6)


def test_the_chunked_loss_peak_holds_one_chunk_of_logits():
    """A 32k vocabulary at 512 tokens: the stock loss's fp32 logits and their gradients (12 B x V a
    token, 192 MiB) against the chunked one's (64-token chunks), measured by the memory benchmark's
    storage tracker; the chunked step peaks at less than a third of the stock one."""
    bench = benchmark_scripts.load_script("memory_plan")
    model = lora_llama(vocab=32_000)
    ids = torch.randint(0, 32_000, (1, 512), generator=torch.Generator().manual_seed(3))

    def peak(fn) -> int:
        with bench.LiveBytes() as live:
            for t in [*model.parameters(), ids]:
                live.track(t)
            start = live.current
            fn().backward()
        model.zero_grad(set_to_none=True)
        return live.peak - start

    stock_peak = peak(lambda: stock(model, ids, ids))
    chunked_peak = peak(lambda: lossmod.causal_lm_loss(model, ids, ids, chunk=64)[0])
    assert stock_peak > 12 * 32_000 * 511
    assert chunked_peak < stock_peak / 3, (chunked_peak, stock_peak)
