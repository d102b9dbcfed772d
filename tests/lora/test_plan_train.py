"""`dtrain train lora` takes its memory defaults from the plan (dtrain.lora.plan) on a known card and
refuses, in one line, a run that cannot fit, before anything is loaded. The card is named explicitly
here (as torch names this process's GPU on a CUDA machine), with its usable memory where the test sets
the bar; on the CPU the defaults are today's (test_memory_checkpointing.py)."""

from __future__ import annotations

import json
import types

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.common.errors import UserError  # noqa: E402
from dtrain.lora import plan as lp  # noqa: E402
from dtrain.lora.config import LoraConfig  # noqa: E402
from dtrain.lora.train import memory_strategy  # noqa: E402

# Llama-3.1-8B's config.json fields (what the plan reads)
LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
    "architectures": ["LlamaForCausalLM"],
}  # fmt: skip


def config_only(tmp_path, fields):
    """A model directory with its config.json and no weights: anything that tried to load the model
    would fail, so a refusal from here was made before loading."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(fields))
    return d


def one_gpu(backend=None, world_size=1):
    # the CPU device: the card is what the test names, the plan is arithmetic
    return types.SimpleNamespace(backend=backend, device=torch.device("cpu"), world_size=world_size)


def test_a_run_too_big_for_the_card_is_refused_in_one_line_before_loading(tmp_path):
    model = config_only(tmp_path, LLAMA_8B)
    cfg = LoraConfig(model=str(model), data="x.jsonl", seq_len=4096, batch_size=8)
    with pytest.raises(UserError) as e:
        memory_strategy(cfg, one_gpu(), accelerator="NVIDIA L4")
    msg = str(e.value)
    assert "\n" not in msg and "does not fit 1 x NVIDIA L4 24GB" in msg and "dtrain plan" in msg


def test_the_plan_turns_checkpointing_on_when_only_that_fits(tmp_path):
    fields = {**LLAMA_8B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}  # fmt: skip
    model = config_only(tmp_path, fields)
    cfg = LoraConfig(model=str(model), data="x.jsonl", seq_len=2048, batch_size=4)
    shape = lp.read_shape(str(model))
    kw = dict(accelerator="nvidia-l4", seq_len=2048, batch=4, lora_rank=8, quant="none", strategy="ddp")
    off = lp.plan(shape, checkpointing="off", **kw).memory.total
    on = lp.plan(shape, checkpointing="on", **kw).memory.total
    assert on < off
    between = (on + off) / 2 / lp.GIB
    m = memory_strategy(cfg, one_gpu(), accelerator="nvidia-l4", usable_gib=between)
    assert m.checkpointing and not m.sharded and not m.quantized
    assert f"of {between:.1f} GiB per GPU on NVIDIA L4 24GB" in m.describe()
    # With room for the whole step, auto leaves it off; flagged off where it is needed, the run is refused.
    roomy = memory_strategy(cfg, one_gpu(), accelerator="nvidia-l4", usable_gib=2 * off / lp.GIB)
    assert not roomy.checkpointing
    flagged_off = LoraConfig(
        model=str(model), data="x.jsonl", seq_len=2048, batch_size=4, activation_checkpointing="off"
    )
    with pytest.raises(UserError, match="checkpointing off"):
        memory_strategy(flagged_off, one_gpu(), accelerator="nvidia-l4", usable_gib=between)


def test_cpu_and_unknown_cards_keep_todays_defaults_and_say_so(tmp_path):
    model = config_only(tmp_path, LLAMA_8B)  # far too big for anything: no plan, no refusal
    cfg = LoraConfig(model=str(model), data="x.jsonl")
    cpu = memory_strategy(cfg, one_gpu())
    assert (cpu.checkpointing, cpu.sharded) == (False, False) and "no memory plan on the CPU" in cpu.describe()
    odd = memory_strategy(cfg, one_gpu(), accelerator="Radeon Instinct MI300X")
    assert not odd.checkpointing and "not in dtrain's card table" in odd.describe()
    # A model the plan cannot read (GPT-2, not a Llama-style decoder) falls back the same way.
    gpt2 = memory_strategy(LoraConfig(model="tiny-gpt2", data="x.jsonl"), one_gpu(), accelerator="nvidia-l4")
    assert not gpt2.checkpointing and "no memory plan: tiny-gpt2" in gpt2.describe()
