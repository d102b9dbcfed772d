"""The memory options' choices: which attention kernel loads where (--attention), QLoRA's embeddings,
norms and head left in the compute dtype, and the optimizer --optimizer builds."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.common.errors import UserError  # noqa: E402
from dtrain.lora import model as modelmod  # noqa: E402
from dtrain.lora import quant  # noqa: E402
from dtrain.lora.config import LoraConfig, Optimizer  # noqa: E402
from dtrain.lora.train import make_optimizer  # noqa: E402

CPU = torch.device("cpu")


def test_auto_attention_is_sdpa_packed_without_flash_attention_and_says_why():
    kernel, why = modelmod.attention_kernel("auto", CPU, torch.bfloat16)
    assert kernel == "sdpa_packed" and why == "auto: flash-attention needs a CUDA GPU"
    assert modelmod.attention_kernel("sdpa", CPU, torch.float32) == ("sdpa", "as flagged")


def test_flash_attention_asked_for_where_it_cannot_run_is_one_line():
    with pytest.raises(UserError) as e:
        modelmod.attention_kernel("flash_attention_2", CPU, torch.bfloat16)
    assert str(e.value) == (
        "--attention flash_attention_2: flash-attention needs a CUDA GPU; use --attention sdpa_packed (or auto)"
    )


def test_auto_attention_picks_flash_where_it_runs(monkeypatch):
    monkeypatch.setattr(modelmod, "flash_attention_available", lambda device, dtype: "")
    assert modelmod.attention_kernel("auto", torch.device("cuda", 0), torch.bfloat16)[0] == "flash_attention_2"


def test_flash_needs_the_package_a_new_gpu_and_half_precision(monkeypatch):
    import importlib.util

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "flash_attn package is not installed" in modelmod.flash_attention_available(gpu, torch.bfloat16)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    assert "older than sm 8.0" in modelmod.flash_attention_available(gpu, torch.float16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert "fp32" in modelmod.flash_attention_available(gpu, torch.float32)
    assert modelmod.flash_attention_available(gpu, torch.bfloat16) == ""


def test_qlora_keeps_embeddings_norms_and_head_in_the_compute_dtype(monkeypatch):
    pytest.importorskip("bitsandbytes", reason="needs the qlora extra: pip install -e .[qlora]")
    shape = dict(vocab_size=258, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    monkeypatch.setitem(modelmod.PRESETS, "nf4-one", modelmod.Preset("llama", shape, modelmod.LLAMA_TARGETS))
    compute = quant.compute_dtype(CPU)
    model, _ = modelmod.load_base("nf4-one", compute, seed=0, quantization=quant.nf4_config(compute))
    model = quant.prepare(model)
    plain = {n: p.dtype for n, p in model.named_parameters() if type(p).__name__ != "Params4bit"}
    assert plain and set(plain.values()) == {torch.bfloat16}, plain  # peft's preparation made these fp32
    assert not any(p.requires_grad for p in model.parameters())


def test_the_optimizer_option_builds_bitsandbytes_8bit_adamw_and_refuses_sharding():
    pytest.importorskip("bitsandbytes", reason="needs the qlora extra: pip install -e .[qlora]")
    p = torch.nn.Parameter(torch.randn(64, 128))
    cfg = LoraConfig(model="m", data="d", optimizer=Optimizer.ADAMW_8BIT)
    opt = make_optimizer(cfg, [p], CPU, sharded=False)
    p.grad = torch.randn_like(p)
    opt.step()
    assert type(opt).__name__ == "AdamW8bit" and opt.state[p]["state1"].dtype == torch.uint8
    with pytest.raises(UserError, match="--optimizer adamw-8bit does not take FSDP2"):
        make_optimizer(cfg, [p], CPU, sharded=True)
    assert isinstance(make_optimizer(LoraConfig(model="m", data="d"), [p], CPU, sharded=False), torch.optim.AdamW)
