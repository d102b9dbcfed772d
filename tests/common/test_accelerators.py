"""dtrain.common.accelerators: the one table of card memory and dense peak FLOP/s, read by the memory
plan and the MFU figure of benchmarks/lora_throughput.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dtrain.common import accelerators as acc


@pytest.mark.parametrize(
    ("name", "precision", "peak"),
    [
        ("Tesla V100-SXM2-16GB", "fp16", 125e12),  # nvidia-smi's names: '-' and case ignored
        ("Tesla V100-PCIE-16GB", "fp16", 112e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta
        ("Tesla V100-SXM2-16GB", "fp32", 15.7e12),  # no TF32 either: the CUDA cores
        ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
        ("NVIDIA A100-SXM4-40GB", "fp32", 156e12),  # dtrain runs fp32 products in TF32
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA L4", "fp32", 60e12),
        ("Tesla T4", "fp16", 65e12),
        ("NVIDIA L40S", "bf16", None),  # not an L4
    ],
)
def test_peak_by_the_name_the_driver_reports(name, precision, peak):
    assert acc.peak_flops(name, precision) == peak


def test_cards_of_the_gcp_accelerators():
    t4, l4, v100 = acc.card("nvidia-tesla-t4"), acc.card("nvidia-l4"), acc.card("nvidia-tesla-v100")
    assert (t4.compute_precision, v100.compute_precision, l4.compute_precision) == ("fp16", "fp16", "bf16")
    # a T4 shows torch 14.56 GiB of its 15 GiB; the CUDA context comes off that
    assert t4.capacity_gib < 15 and t4.usable_gib == pytest.approx(t4.capacity_gib - acc.CUDA_CONTEXT_GIB)
    assert acc.card("nvidia-a100-80gb").usable_gib > 2 * acc.card("nvidia-tesla-a100").usable_gib - 2
    with pytest.raises(KeyError):
        acc.card("nvidia-tesla-k80")


def test_importing_the_table_does_not_import_torch():
    code = "import sys, dtrain.common.accelerators, dtrain.lora.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
