"""lora_throughput.py's MFU inputs, pinned on known shapes: the FLOPs per token of two presets
counted by hand from their published shapes, and the peak for a GPU name and precision."""

from __future__ import annotations

import benchmark_scripts
import pytest

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")


def load_script():
    return benchmark_scripts.load_script("lora_throughput")


def test_flops_per_token_of_tiny_llama_at_256():
    m = load_script()
    layers, d, ff, vocab, seq = 4, 256, 688, 258, 256
    per_layer = 4 * d * d + 3 * d * ff  # q, k, v, o; gate, up, down
    n = layers * per_layer + d * vocab  # and the output projection onto the vocabulary
    flops, figures = m.flops_per_token("tiny-llama", seq)
    assert figures["matmul_weights"] == n == 3_228_160
    assert flops == 4 * n + 12 * layers * seq * d == 16_058_368


def test_flops_per_token_of_the_qwen_shape_at_1024():
    """14 query heads of 64 and 2 key/value heads: k and v are 896 x 128; the output projection is the
    tied 151,936 x 896 embedding, a product all the same."""
    m = load_script()
    layers, d, kv, ff, vocab, seq = 24, 896, 2 * 64, 4864, 151_936, 1024
    n = layers * (2 * d * d + 2 * d * kv + 3 * d * ff) + d * vocab
    flops, figures = m.flops_per_token("qwen2.5-0.5b-shape", seq)
    assert figures["matmul_weights"] == n == 493_961_216
    assert figures["attention_width"] == 14 * 64
    assert flops == 4 * n + 12 * layers * seq * 14 * 64 == 2_240_086_016


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "fp32", 378e12),  # TF32, as dtrain runs fp32 on CUDA
        ("NVIDIA H200", "fp16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("Tesla T4", "fp16", 65e12),
        ("Tesla T4", "fp32", 8.1e12),  # no TF32: the CUDA cores
        ("Tesla T4", "bf16", None),  # no bf16 at all
        ("NVIDIA L40S", "bf16", None),  # not the L4: no entry, so no MFU without --peak-flops
    ],
)
def test_peak_by_gpu_name_and_precision(name, precision, peak):
    assert load_script().peak_flops(name, precision) == peak


def test_default_precision_is_what_auto_picks():
    m = load_script()
    assert m.default_precision(None) == "fp32"
    assert m.default_precision(("Tesla T4", 7.5)) == "fp16"
    assert m.default_precision(("NVIDIA L4", 8.9)) == "bf16"
