"""Mixed precision: bf16 autocast where the GPU has it, fp16 + GradScaler where it does not
(a T4 has no bf16), fp32 on CPU. A flag can force a mode."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import torch

from dtrain.common.config import Precision
from dtrain.common.errors import ExitCode, UserError

# Below this loss scale the fp16 gradients overflow even unscaled (a scale under 1 shrinks them), so
# GradScaler is skipping step after step: it halves the scale at each skip, from 2**16, so a run whose
# every step overflows falls below 1 after 17 steps while its weights stay where they were.
MIN_LOSS_SCALE = 1.0


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

    def configure(self) -> None:
        """Process-wide math settings that go with this policy. On CUDA, fp32 matrix products run in
        TF32 (fp32's range, a 10-bit mantissa, products summed in fp32) on the tensor cores of Ampere
        and later GPUs; torch leaves that off by default. A T4 has no TF32: no effect there. Only
        the CUDA setting: CPU products stay IEEE fp32 (docs/decisions.md, "TF32")."""
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.fp32_precision = "tf32"

    def describe(self) -> str:
        tf32 = "; fp32 matmuls in TF32" if self.device.type == "cuda" else ""
        return f"{self.mode.value} ({self.reason}{tf32})"


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


def restore_scaler(scaler: torch.amp.GradScaler, state: dict[str, Any], mode: Precision) -> str | None:
    """Load a checkpoint's loss-scaler state into `scaler` where it applies. Returns None when the
    checkpoint was trained in `mode`, else one line saying what changed.

    A checkpoint trained in bf16 or fp32 holds an empty scaler state, and GradScaler refuses to load
    one; resuming it in fp16 (a T4 after an L4, say) starts loss scaling from its initial scale,
    which is what a fresh fp16 run does. Checkpoints from before the precision was saved with them
    tell fp16 (a scaler state) from the rest (none)."""
    saved_scaler = state.get("scaler") or {}
    was = state.get("precision") or (Precision.FP16.value if saved_scaler else None)
    if scaler.is_enabled() and saved_scaler:
        scaler.load_state_dict(saved_scaler)
    if was == mode.value:
        return None
    line = f"precision changed since the checkpoint: {was or 'bf16 or fp32'} -> {mode.value}"
    if scaler.is_enabled():
        return f"{line}; fp16 loss scaling starts from its initial scale ({scaler.get_scale():g})"
    if saved_scaler:
        return f"{line}; the checkpoint's fp16 loss scale is not needed and is dropped"
    return line


def check_training(loss: float, scaler: torch.amp.GradScaler, mode: Precision, step: int) -> None:
    """Fail the run, in one line, when the logged loss is not finite or fp16 loss scaling has
    collapsed: either way the weights no longer train. Call it where the loss is already on the
    host (a log step), so it adds no GPU sync."""
    if mode == Precision.FP16:
        fix = "rerun with --precision fp32, or --precision bf16 on a GPU that has it (not a T4)"
    elif mode == Precision.BF16:
        fix = "rerun with --precision fp32, or a lower --lr"
    else:
        fix = "the loss diverged: rerun with a lower --lr"
    if not math.isfinite(loss):
        raise UserError(f"the training loss is {loss} at step {step} ({mode.value}): {fix}", exit_code=ExitCode.FAILURE)
    if scaler.is_enabled():
        scale = scaler.get_scale()
        if scale < MIN_LOSS_SCALE:
            raise UserError(
                f"fp16 loss scale fell to {scale:g} at step {step}: the gradients overflow fp16 and the optimizer "
                f"has been skipping steps; {fix}",
                exit_code=ExitCode.FAILURE,
            )
