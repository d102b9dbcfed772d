"""Packed attention that skips the masked blocks (--attention sdpa_packed, dtrain.lora.attention):
which kernel loads where, the same loss and gradients as the dense-mask sdpa on packed rows, documents
that do not see each other, no dense mask built, and stock sdpa wherever a mask is still needed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from gpu_check import GPU_SKIP_REASON  # noqa: E402

from dtrain.lora import model as modelmod  # noqa: E402
from dtrain.lora import sft  # noqa: E402
from dtrain.lora.fused import fuse_lora_linears  # noqa: E402

from .conftest import MICRO_LLAMA  # noqa: E402

CPU = torch.device("cpu")
FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
GQA_LLAMA = {**MICRO_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 2}  # grouped k/v heads
DOCS = [[5, 17, 3], [11, 7, 9, 2], [29]]  # rows of document lengths; the last row is one document


def build(shape: dict, impl: str, fused: bool = False, checkpointing: bool = False) -> torch.nn.Module:
    """A LoRA model (r 4 on the seven projections, B not zero) seeded alike for every `impl`."""
    modelmod.PRESETS["packed-test"] = modelmod.Preset("llama", shape, modelmod.LLAMA_TARGETS)
    try:
        model, _ = modelmod.load_base("packed-test", torch.float32, 0, attention=impl)
        model, _ = modelmod.apply_lora(model, "packed-test", r=4, alpha=8, dropout=0.0, targets=[], seed=0)
    finally:
        del modelmod.PRESETS["packed-test"]
    with torch.no_grad():  # peft starts B at zero, which would leave A's gradients zero
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    if fused:
        fuse_lora_linears(model)
    if checkpointing:
        modelmod.enable_activation_checkpointing(model)
    return model.train()


def packed_rows(vocab: int, seq_len: int = 32) -> torch.Tensor:
    """Rows as dtrain.lora.sft packs them (ids, labels, position ids restarting), padding at the ends."""
    g = torch.Generator().manual_seed(2)
    out = torch.full((len(DOCS), 3, seq_len), -100, dtype=torch.long)
    out[:, 0], out[:, 2] = 0, -1
    for r, lens in enumerate(DOCS):
        at = 0
        for n in lens:
            ids = torch.randint(1, vocab, (n,), generator=g)
            out[r, 0, at : at + n], out[r, 1, at : at + n - 1], out[r, 2, at : at + n] = ids, ids[1:], torch.arange(n)
            at += n
    return out


def test_kernel_choice_where_flash_attention_is_missing():
    """auto loads sdpa_packed wherever flash-attention 2 cannot run: on the CPU, and on a GPU without
    the flash_attn package (the package check comes before any GPU is asked); sdpa stays sdpa."""
    assert modelmod.attention_kernel("auto", CPU, torch.float32)[0] == "sdpa_packed"
    assert modelmod.attention_kernel("sdpa_packed", CPU, torch.float32) == ("sdpa_packed", "as flagged")
    assert modelmod.attention_kernel("sdpa", CPU, torch.float32) == ("sdpa", "as flagged")
    if not FLASH_ATTN:
        kernel, why = modelmod.attention_kernel("auto", torch.device("cuda", 0), torch.bfloat16)
        assert kernel == "sdpa_packed" and "flash_attn package is not installed" in why


def test_plan_counts_the_dense_mask_only_for_sdpa():
    from types import SimpleNamespace

    from dtrain.lora.config import LoraConfig
    from dtrain.lora.train import _dense_mask_runs

    d = SimpleNamespace(device=CPU)
    assert _dense_mask_runs(LoraConfig(model="tiny-llama", data="x.txt", attention="sdpa"), d)
    assert not _dense_mask_runs(LoraConfig(model="tiny-llama", data="x.txt"), d)  # auto: sdpa_packed here
    assert not _dense_mask_runs(LoraConfig(model="tiny-llama", data="x.txt", attention="sdpa_packed"), d)


@pytest.mark.parametrize(
    ("shape", "fused", "checkpointing"),
    [(MICRO_LLAMA, False, False), (MICRO_LLAMA, True, False), (GQA_LLAMA, True, False), (GQA_LLAMA, True, True)],
)
def test_same_loss_and_gradients_as_the_dense_mask(shape, fused, checkpointing):
    """forward_rows on packed rows (three documents in a row, padding after): the loss and every
    LoRA gradient equal the dense-mask sdpa's, with stock and with dtrain's fused attention block,
    and with activation checkpointing (each layer recomputed in the backward)."""
    rows = packed_rows(shape["vocab_size"])
    grads = {}
    for impl in ("sdpa", "sdpa_packed"):
        model = build(shape, impl, fused, checkpointing)
        total, count = sft.forward_rows(model, rows)
        (total / count).backward()
        grads[impl] = (total.item(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    (loss_d, g_d), (loss_p, g_p) = grads["sdpa"], grads["sdpa_packed"]
    assert loss_p == pytest.approx(loss_d, rel=1e-5)
    assert g_d.keys() == g_p.keys() and len(g_d) == 2 * 7 * shape["num_hidden_layers"]
    for name in g_d:
        assert g_d[name].abs().max() > 0, name  # every gradient takes part in the comparison
        torch.testing.assert_close(g_p[name], g_d[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_document_does_not_see_the_others():
    """Changing the middle document's tokens changes its own logits and no other document's."""
    model = build(GQA_LLAMA, "sdpa_packed", fused=True).eval()
    lens = [6, 10, 8]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    ids = torch.randint(1, 258, (1, sum(lens)), generator=torch.Generator().manual_seed(3))
    other = ids.clone()
    other[0, 6:16] = (other[0, 6:16] + 1) % 258
    with torch.no_grad():
        a = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        b = model(input_ids=other, position_ids=pos, use_cache=False).logits[0]
        leaky = model(input_ids=other, use_cache=False).logits[0]  # no restarts: one document
    assert (a[6:16] - b[6:16]).abs().max() > 1e-3
    torch.testing.assert_close(b[:6], a[:6], rtol=0, atol=1e-6)
    torch.testing.assert_close(b[16:], a[16:], rtol=0, atol=1e-6)
    assert (leaky[16:] - b[16:]).abs().max() > 1e-3  # the check would see a leak


def test_the_packing_check_on_the_loaded_model_passes():
    model = build(MICRO_LLAMA, "sdpa_packed")
    ok, diff = sft.packing_isolates(model, MICRO_LLAMA["vocab_size"], CPU)
    assert ok and diff < 1e-5


def test_no_dense_mask_is_built_for_packed_rows():
    """transformers asks the registered mask function: none for packed rows (sdpa builds L x L)."""
    from transformers.masking_utils import create_causal_mask

    model = build(MICRO_LLAMA, "sdpa_packed")
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    embeds = torch.zeros(1, 12, MICRO_LLAMA["hidden_size"])

    def mask(impl: str, padding: torch.Tensor | None = None):
        model.config._attn_implementation = impl
        return create_causal_mask(model.config, embeds, padding, cache=None, position_ids=pos)

    assert mask("sdpa_packed") is None
    dense = mask("sdpa")
    assert dense is not None and tuple(dense.shape) == (1, 1, 12, 12) and not dense[0, 0, 5, :5].any()
    padded = torch.ones(1, 12, dtype=torch.long)
    padded[0, :2] = 0
    assert mask("sdpa_packed", padded) is not None  # a padding mask: stock sdpa's mask


def test_a_padding_mask_and_generation_run_as_stock_sdpa():
    """Left-padded rows with an attention mask, and cached decoding: the same logits as sdpa."""
    ids = torch.randint(1, 258, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = {}
    for impl in ("sdpa", "sdpa_packed"):
        model = build(MICRO_LLAMA, impl).eval()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
            gen = model.generate(ids[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
        out[impl] = (logits, gen)
    torch.testing.assert_close(out["sdpa_packed"][0][0], out["sdpa"][0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["sdpa_packed"][0][1, 3:], out["sdpa"][0][1, 3:], rtol=1e-5, atol=1e-6)
    assert torch.equal(out["sdpa_packed"][1], out["sdpa"][1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_SKIP_REASON)
def test_flash_attention_is_picked_and_isolates_where_it_is_installed():
    """Where flash_attn is installed on an Ampere or later GPU, auto loads flash_attention_2, and
    its varlen call keeps packed documents apart; where it is not, auto loads sdpa_packed there."""
    gpu = torch.device("cuda", 0)
    kernel, why = modelmod.attention_kernel("auto", gpu, torch.bfloat16)
    if modelmod.flash_attention_available(gpu, torch.bfloat16):
        assert kernel == "sdpa_packed", why
    else:
        assert kernel == "flash_attention_2", why
    model, _ = modelmod.load_base("tiny-llama", torch.bfloat16, 0, gpu, attention=kernel)
    assert model.config._attn_implementation == kernel
    assert sft.packing_isolates(model, 258, gpu)[0]


def test_document_lengths_follow_the_position_ids_even_when_changed_in_place():
    """The lengths are read once for all layers of a forward; position ids changed in place are read again."""
    from dtrain.lora import attention

    pos = torch.cat([torch.arange(3), torch.arange(5)])[None]
    assert attention._lengths_of(pos) == [[3, 5]]
    pos[0, 3:] += 3  # one document of 8 now
    assert attention._lengths_of(pos) == [[8]]
    assert attention.document_lengths(torch.tensor([[0, 1, 0, 0, 1, 2, 7]])) == [[2, 1, 3, 1]]


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_other_families_keep_documents_apart_and_match_sdpa(family):
    """Qwen2 (q/k/v biases, grouped heads) and Mistral with a sliding window (stock sdpa's mask then:
    SDPA per document has no window): the packing check passes and the logits are sdpa's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dtrain.lora import attention

    attention.register()
    kw = {**GQA_LLAMA, **({"sliding_window": 16} if family == "mistral" else {})}
    rows = packed_rows(kw["vocab_size"])
    logits = {}
    for impl in ("sdpa", "sdpa_packed"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw), attn_implementation=impl).eval()
        assert sft.packing_isolates(model, kw["vocab_size"], CPU)[0]
        with torch.no_grad():
            logits[impl] = model(input_ids=rows[:, 0], position_ids=rows[:, 2].clamp(min=0), use_cache=False).logits
    real = rows[:, 2] >= 0
    torch.testing.assert_close(logits["sdpa_packed"][real], logits["sdpa"][real], rtol=1e-5, atol=1e-5)
