"""The memory plan (dtrain.lora.plan, `dtrain plan`): shapes read from config.json without weights,
its figures against measured peak memory of real small models on the CPU, the strategy it picks,
and its one-line refusals."""

from __future__ import annotations

import json

import benchmark_scripts
import pytest

from dtrain.common.errors import UserError
from dtrain.lora import plan as lp

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

GIB = 2**30
# The published shapes of two models people fine-tune (config.json of meta-llama/Llama-3.1-8B and
# -70B), written here so no download is needed.
LLAMA_8B = dict(
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
LLAMA_70B = dict(LLAMA_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
# The plan's allocated bytes against the measured peak. Every tensor autograd keeps is in the
# formula; what is left out is small (inverse-RMS values, the optimizer's step counters, fused
# AdamW's temporaries) and the plan counts the LoRA gradients at a peak that precedes most of them,
# so it errs high, by 1-5% on these shapes (benchmarks/memory_plan.py). 10% is the issue's target.
TOLERANCE = 0.10


def config_dir(tmp_path, **fields):
    d = tmp_path / fields.get("model_type", "model")
    d.mkdir()
    (d / "config.json").write_text(json.dumps(fields))
    return str(d)


@pytest.mark.parametrize(
    ("family", "kwargs"),
    [
        ("llama", dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=300)),
        ("qwen2", dict(hidden_size=48, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                       num_key_value_heads=2, vocab_size=200, tie_word_embeddings=True)),
        ("mistral", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=256)),
    ],
)  # fmt: skip
def test_shape_read_from_a_saved_config_counts_the_real_parameters(tmp_path, family, kwargs):
    """config.json alone (as save_pretrained writes it, no weights) gives the parameter count of the
    model built from it, and the LoRA count peft makes on the seven projections."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **kwargs)
    config.save_pretrained(tmp_path / "m")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["config.json"]
    shape = lp.read_shape(str(tmp_path / "m"))
    model = AutoModelForCausalLM.from_config(config)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=list(lp.LLAMA_TARGETS)))
    assert shape.lora_params(4) == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)


# Smaller than the benchmark's shapes, so five measured steps take seconds.
SMALL = {
    "llama": dict(hidden_size=128, intermediate_size=320, num_hidden_layers=2, vocab_size=1024),
    "qwen2": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, vocab_size=1024),
    "mistral": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=1024),
}


def test_plan_within_tolerance_of_measured_peak():
    """Real small architectures (Llama fp32 with and without checkpointing and at two lengths, Qwen2
    bf16 with checkpointing, Mistral bf16), one forward + backward + AdamW step each, peak bytes
    measured by benchmarks/memory_plan.py's storage tracker: the plan is within TOLERANCE of the peak
    and of what the step adds to the weights and optimizer state (activations, autocast copies,
    gradients); and what checkpointing saves and a longer sequence costs are the plan's too."""
    bench = benchmark_scripts.load_script("memory_plan")

    def case(family, precision, checkpointing, seq_len, batch):
        return bench.Case(
            family=family,
            precision=precision,
            checkpointing=checkpointing,
            seq_len=seq_len,
            batch=batch,
            shape=SMALL[family],
        )

    runs = {
        "off": bench.measure(case("llama", "fp32", False, 256, 1)),
        "on": bench.measure(case("llama", "fp32", True, 256, 1)),
        "longer": bench.measure(case("llama", "fp32", False, 512, 1)),
        "qwen2": bench.measure(case("qwen2", "bf16", True, 256, 1)),
        "mistral": bench.measure(case("mistral", "bf16", False, 128, 2)),
    }
    for name, r in runs.items():
        assert r["trainable"] == r["planned_trainable"], name
        assert abs(r["error"]) < TOLERANCE, (name, r["error"])
        assert abs(r["step_error"]) < TOLERANCE, (name, r["step_error"])
    off, on, longer = runs["off"], runs["on"], runs["longer"]
    saved = (off["planned_bytes"] - on["planned_bytes"]) / (off["measured_bytes"] - on["measured_bytes"])
    grown = (longer["planned_bytes"] - off["planned_bytes"]) / (longer["measured_bytes"] - off["measured_bytes"])
    assert off["measured_bytes"] > on["measured_bytes"] and abs(saved - 1) < TOLERANCE
    assert longer["measured_bytes"] > off["measured_bytes"] and abs(grown - 1) < TOLERANCE


def shape(fields: dict, name: str) -> lp.ModelShape:
    from transformers import AutoConfig

    f = dict(fields)
    return lp.shape_from_config(AutoConfig.for_model(f.pop("model_type"), **f), name)


def test_llama_8b_on_a_t4_needs_qlora_and_checkpointing():
    s = shape(LLAMA_8B, "llama-3.1-8b")
    p = lp.plan(s, accelerator="nvidia-tesla-t4", seq_len=2048, batch=1, lora_rank=16)
    assert p.fits and p.quant == "4bit" and p.checkpointing and p.strategy == "ddp"
    assert p.precision == "fp16"  # a T4 has no bf16
    # bf16 weights alone are ~15 GiB: more than a T4 holds
    assert lp.plan(s, accelerator="nvidia-tesla-t4", seq_len=2048, batch=1, quant="none").fits is False
    # NF4 with double quantization: 4.127 bits a projection weight; embeddings, norms and head in the
    # compute dtype (dtrain.lora.quant.prepare casts nothing to fp32)
    proj = s.layers * s.layer_proj_params()
    assert p.memory.weights == pytest.approx(proj * 4.127 / 8 + s.other_params() * 2)
    assert 2.0e9 < s.other_params() * 2 < 2.2e9
    # the chunked loss holds one 512-token chunk of fp32 logits, not every token's: at 8,192 tokens the
    # loss adds less than a tenth of what 12 bytes a word a token would
    kw = dict(batch=1, lora_rank=16, precision="bf16", checkpointing=False)
    a8, a16, a24 = (lp.activation_bytes(s, seq_len=n, **kw) for n in (8192, 16384, 24576))
    assert a24 - a16 == pytest.approx(a16 - a8, rel=1e-6)  # linear in the tokens
    # a token costs its layers' activations, not 12 bytes a word of logits besides
    per_token = (a16 - a8) / 8192
    assert per_token < s.layers * 0.2e6 and 12 * s.vocab > per_token / s.layers * 5
    # at 512 tokens the peak is the layers' activations plus one chunk's logits and their gradient
    a1, a2 = (lp.activation_bytes(s, seq_len=n, **kw) for n in (512, 1024))
    assert 0 < a1 - (a2 - a1) <= lp.CHUNK_TOKENS * s.vocab * 8


def test_llama_8b_on_an_a100_80gb_runs_plain_ddp():
    s = shape(LLAMA_8B, "llama-3.1-8b")
    p = lp.plan(s, accelerator="nvidia-a100-80gb", seq_len=2048, batch=1, lora_rank=16)
    assert p.fits and p.method == "DDP" and not p.checkpointing and p.precision == "bf16"
    assert 14 * GIB < p.memory.weights < 16 * GIB


def test_llama_70b_picks_qlora_then_sharding_when_4bit_is_ruled_out():
    s = shape(LLAMA_70B, "llama-3.1-70b")
    p = lp.plan(s, accelerator="nvidia-h100-80gb", gpus=8, seq_len=2048, batch=1)
    assert p.fits and p.quant == "4bit" and p.strategy == "ddp"
    sharded = lp.plan(s, accelerator="nvidia-h100-80gb", gpus=8, seq_len=2048, batch=1, quant="none")
    assert sharded.fits and sharded.strategy == "fsdp" and sharded.method == "sharded (FSDP2)"
    assert sharded.memory.weights < s.params() * 2 / 4  # an eighth of the bf16 weights and two layers
    c = lp.smallest_cluster(s, seq_len=2048, batch=1, lora_rank=16, precision="auto", quant="none")
    assert c is not None and c.plan.fits and c.plan.strategy == "fsdp"
    assert c.per_node * c.nodes > 1


def test_refusals_are_one_line(tmp_path):
    s = shape(LLAMA_8B, "llama-3.1-8b")
    p = lp.plan(s, accelerator="nvidia-l4", seq_len=4096, batch=8, quant="none", checkpointing="off")
    assert not p.fits
    with pytest.raises(UserError) as e:
        lp.refuse_if_unfit(p)
    assert "\n" not in str(e.value) and "NVIDIA L4" in str(e.value) and "GiB" in str(e.value)
    lp.refuse_if_unfit(lp.plan(s, accelerator="nvidia-a100-80gb", seq_len=512, batch=1))  # fits: no error
    with pytest.raises(UserError, match="no bf16"):
        lp.plan(s, accelerator="nvidia-tesla-t4", seq_len=512, batch=1, precision="bf16")
    with pytest.raises(UserError, match="nvidia-tesla-v100 is refused: .*no sm_70 kernels"):
        lp.plan(s, accelerator="nvidia-tesla-v100", seq_len=512, batch=1)
    with pytest.raises(UserError, match="unknown accelerator"):
        lp.plan(s, accelerator="nvidia-tesla-k80", seq_len=512, batch=1)
    with pytest.raises(UserError, match="Llama-style"):
        lp.read_shape(config_dir(tmp_path, model_type="gpt2", n_embd=64, n_layer=2, n_head=2, vocab_size=100))


def test_cli_plan_of_a_local_config(tmp_path, capsys):
    from dtrain.cli.main import run

    d = config_dir(tmp_path, **LLAMA_8B)
    # 2,048 tokens: at 1,024 the lean 16-bit step fits without checkpointing (21.57 of 21.6 GiB)
    rc = run(["plan", "--model", d, "--accelerator", "nvidia-l4", "--seq-len", "2048", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    # bf16 weights (15 GiB) fit an L4 once the activations are checkpointed
    assert out["plan"]["method"] == "DDP" and out["plan"]["checkpointing"] is True
    assert out["plan"]["memory"]["total"] < out["plan"]["usable"] < 22 * GIB
    assert out["cluster"]["accelerator"] and out["cluster"]["nodes"] >= 1


def test_cli_model_that_fits_no_cluster_is_one_line_naming_the_largest_card(tmp_path, capsys):
    from dtrain.cli.main import run

    d = config_dir(tmp_path, **LLAMA_8B)
    rc = run(["plan", "--model", d, "--seq-len", "262144", "--batch", "2"])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, lines
    assert "fits no cluster" in lines[0] and "H100 80GB" in lines[0] and "lower --seq-len" in lines[0]


def test_the_plan_chunks_the_loss_as_the_loss_does():
    from dtrain.lora import loss

    assert lp.CHUNK_TOKENS == loss.CHUNK_TOKENS


def test_issue_28_memory_goals_for_llama_8b():
    """Llama-3.1-8B, r8, 2 x 2048 packed, checkpointing on, on one H100 (room to spare): what the plan
    says each peer's configuration holds (docs/memory-plan.md, "Against the peers")."""
    s = shape(LLAMA_8B, "llama-3.1-8b")
    kw = dict(accelerator="nvidia-h100-80gb", seq_len=2048, batch=2, lora_rank=8, checkpointing="on",
              strategy="ddp", packed=True)  # fmt: skip
    qlora = lp.plan(s, quant="4bit", adapter_dtype="bf16", **kw)
    lora = lp.plan(s, quant="none", adapter_dtype="bf16", **kw)
    # The goals compare the allocated figure, what torch.cuda.max_memory_allocated reports (torchtune's
    # recipes log it); QLoRA meets its goal with the allocator/workspace estimate too. dtrain.lora.lean's
    # savings (16-bit norm inputs, SwiGLU without silu(gate), shared LoRA inputs) make the difference.
    assert qlora.memory.allocated <= 8.0 * GIB and qlora.memory.total <= 8.0 * GIB
    assert lora.memory.allocated <= 17.0 * GIB
    flash = lp.plan(s, quant="none", adapter_dtype="bf16", attention="flash", **kw)
    assert flash.memory.allocated <= lora.memory.allocated <= 17.0 * GIB
    # the longest QLoRA context on an L4, r32, batch 1: at least 16,384 tokens
    assert lp.plan(s, accelerator="nvidia-l4", seq_len=16384, batch=1, lora_rank=32, quant="4bit").fits
