"""The memory plan against the measured peak of dtrain's own step (its chunked loss, packed rows, bf16
adapters, 8-bit AdamW, QLoRA, DDP and FSDP2), on the CPU with benchmarks/memory_plan.py's storage
tracker: within TOLERANCE for representative configurations of the tiny-llama shape (fast), and for
the 4-bit and 134M-parameter ones (slow)."""

from __future__ import annotations

import benchmark_scripts
import pytest

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

TOLERANCE = 0.10  # the issue's: the plan within +-10% of the measured peak


@pytest.fixture(scope="module")
def bench():
    return benchmark_scripts.load_script("memory_plan")


def tiny(bench, **kw):
    base = dict(family="llama", shape=bench.SHAPES["tiny"], label="tiny", seq_len=128, batch=2)
    return bench.Case(**{**base, **kw})


def check(bench, case) -> dict:
    r = bench.measure(case)
    assert r["trainable"] == r["planned_trainable"], case.name
    assert abs(r["error"]) < TOLERANCE, (case.name, r["error"], r["planned_bytes"], r["measured_bytes"])
    return r


def test_plan_holds_for_lora_rows_packed_checkpointed_and_bf16_adapters(bench):
    rows = check(bench, tiny(bench, precision="fp32", checkpointing=False))
    packed = check(bench, tiny(bench, precision="fp32", checkpointing=False, packed=True))
    check(bench, tiny(bench, precision="bf16", checkpointing=True, packed=True))
    half = check(bench, tiny(bench, precision="bf16", checkpointing=False, packed=True, adapter_dtype="bf16"))
    # the dense per-document mask is a real cost, and the plan's: packed rows measure more than plain ones
    assert packed["measured_bytes"] > rows["measured_bytes"] and packed["planned_bytes"] > rows["planned_bytes"]
    assert half["planned"]["casts"] == 0  # no autocast copies of bf16 adapters


def test_plan_holds_for_8bit_adamw(bench):
    pytest.importorskip("bitsandbytes", reason="needs the qlora extra: pip install -e .[qlora]")
    r = check(bench, tiny(bench, precision="bf16", checkpointing=True, packed=True, rank=16, optimizer="adamw-8bit"))
    full = tiny(bench, precision="bf16", checkpointing=True, packed=True, rank=16)
    assert r["planned"]["optimizer"] < bench.planned_memory(full, _config(bench)).optimizer


def _config(bench):
    from transformers import AutoConfig

    return AutoConfig.for_model("llama", **bench.SHAPES["tiny"])


@pytest.mark.slow  # bitsandbytes' CPU kernels
def test_plan_holds_for_qlora(bench):
    pytest.importorskip("bitsandbytes", reason="needs the qlora extra: pip install -e .[qlora]")
    check(bench, tiny(bench, precision="bf16", checkpointing=True, packed=True, quant="4bit"))
    check(bench, tiny(bench, precision="bf16", checkpointing=False, packed=True, quant="4bit"))


# DDP and FSDP2 on two gloo ranks are measured by `python benchmarks/memory_plan.py` (its table in
# docs/memory-plan.md): its spawned ranks re-import the script by name, which a module loaded from
# its path by the tests cannot be.


@pytest.mark.slow  # a 134M-parameter Llama, one measured step each
def test_plan_holds_for_a_134m_llama(bench):
    base = dict(family="llama", shape=bench.SHAPES["134m"], label="134m", seq_len=128, batch=2)
    check(bench, bench.Case(**base, precision="bf16", checkpointing=True, packed=True))
    check(bench, bench.Case(**base, precision="fp32", checkpointing=False))
