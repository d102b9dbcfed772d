"""Precision policy: what `auto` picks, which forced modes are refused, and that autocast applies."""

from __future__ import annotations

import pytest
import torch
from gpu_check import GPU_SKIP_REASON

from dtrain.common.config import Precision
from dtrain.common.errors import UserError
from dtrain.common.precision import PrecisionPolicy, resolve_precision

CPU = torch.device("cpu")


def gpu(test):
    """A GPU-only test: marked `gpu` and skipped with the one GPU reason where torch sees no CUDA device (the
    strict run accepts that skip only with both)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_SKIP_REASON)(test))


def test_auto_on_cpu_is_fp32_without_scaling():
    p = resolve_precision(Precision.AUTO, CPU)
    assert p.mode == Precision.FP32 and p.dtype == torch.float32
    assert not p.make_scaler().is_enabled()
    with p.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


def test_bf16_can_be_forced_on_cpu_and_autocast_uses_it():
    p = resolve_precision(Precision.BF16, CPU)
    assert p.mode == Precision.BF16 and "forced" in p.describe()
    with p.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert not p.make_scaler().is_enabled()  # bf16 has fp32's range: no loss scaling


def test_fp16_on_cpu_is_refused_with_what_to_do():
    with pytest.raises(UserError, match="fp16 needs a CUDA GPU: use fp32 or bf16"):
        resolve_precision(Precision.FP16, CPU)


@gpu
def test_auto_on_gpu_is_bf16_where_supported_else_fp16_with_a_scaler():
    dev = torch.device("cuda", 0)
    p = resolve_precision(Precision.AUTO, dev)
    if torch.cuda.is_bf16_supported(including_emulation=False):
        assert p.mode == Precision.BF16 and not p.make_scaler().is_enabled()
    else:
        assert p.mode == Precision.FP16 and p.make_scaler().is_enabled()
    with p.autocast():
        assert (torch.ones(2, 2, device=dev) @ torch.ones(2, 2, device=dev)).dtype == p.dtype


def test_on_cuda_fp32_matmuls_run_in_tf32_and_the_cpu_stays_ieee():
    """Set on a torch without CUDA, the flag is still the one CUDA's matmuls read; a GPU shows the
    speed (benchmarks/gpu_smoke.py)."""
    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    try:
        cpu = PrecisionPolicy(Precision.FP32, CPU, "auto: CPU")
        cpu.configure()
        assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision) == before
        assert "TF32" not in cpu.describe()
        cuda = PrecisionPolicy(Precision.FP32, torch.device("cuda", 0), "forced by --precision")
        cuda.configure()
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == before[1]  # CPU products untouched
        assert cuda.describe() == "fp32 (forced by --precision; fp32 matmuls in TF32)"
    finally:
        torch.backends.cuda.matmul.fp32_precision = before[0]
