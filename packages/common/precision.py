"""Mixed precision: bf16 autocast where the GPU has it, fp16 + GradScaler where it does not
(a T4 has no bf16), fp32 on CPU. A flag can force a mode."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from dtrain.common.config import Precision
from dtrain.common.errors import UserError


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    mode: Precision  # never AUTO
    device: torch.device
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(self.mode, torch.float32)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        if self.mode == Precision.FP32:
            yield
        else:
            with torch.autocast(device_type=self.device.type, dtype=self.dtype):
                yield

    def make_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only for fp16 (bf16 has fp32's exponent range and needs none).
        A disabled scaler passes straight through, so the loop has one code path."""
        return torch.amp.GradScaler(self.device.type, enabled=self.mode == Precision.FP16)

    def describe(self) -> str:
        return f"{self.mode.value} ({self.reason})"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"CPU ({n} thread{'s' if n != 1 else ''})"


def resolve_precision(requested: Precision, device: torch.device) -> PrecisionPolicy:
    requested = Precision(requested)
    on_gpu = device.type == "cuda"
    has_bf16 = on_gpu and torch.cuda.is_bf16_supported(including_emulation=False)
    if requested == Precision.AUTO:
        if has_bf16:
            return PrecisionPolicy(Precision.BF16, device, "auto: the GPU supports bf16")
        if on_gpu:
            return PrecisionPolicy(Precision.FP16, device, "auto: no bf16 on this GPU, fp16 with loss scaling")
        return PrecisionPolicy(Precision.FP32, device, "auto: CPU")
    if requested == Precision.FP16 and not on_gpu:
        raise UserError("--precision fp16 needs a CUDA GPU: use fp32 or bf16 on CPU, or auto")
    if requested == Precision.BF16 and on_gpu and not has_bf16:
        raise UserError(f"--precision bf16: {torch.cuda.get_device_name(device)} has no bf16 support; use fp16 or auto")
    return PrecisionPolicy(requested, device, "forced by --precision")
