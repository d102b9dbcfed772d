"""A run's model weights and config, as the evaluation and the export need them: the final model, or
the weights of one complete checkpoint."""

from __future__ import annotations

import io
from typing import Any, TypeVar

import torch

from dtrain.common import config as cfgmod
from dtrain.common.errors import UserError
from dtrain.common.rundir import checkpoints, step_dir
from dtrain.common.storage import Store
from dtrain.evaluate.records import check_step

C = TypeVar("C")


def workload_config(saved: dict[str, Any], cls: type[C]) -> C:
    """The run's resolved config as its workload's dataclass (placement keys dropped: this is not a launch)."""
    flat = {k: v for k, v in (saved.get("config") or {}).items() if k not in cfgmod.PLACEMENT_KEYS}
    try:
        return cfgmod.build(cls, flat)
    except ValueError as e:
        raise UserError(f"the run's config.json does not make a {cls.__name__}: {e}") from None


def checkpoint_weights(run: Store, step: int) -> dict[str, Any]:
    """The `model` entry of checkpoint `step` (loaded as data only: a checkpoint cannot run code)."""
    check_step(run, step)
    data = checkpoints(run).read_bytes(f"{step_dir(step)}/state.pt")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["model"]


def read_final(run: Store, path: str, what: str) -> bytes:
    try:
        return run.read_bytes(path)
    except FileNotFoundError:
        raise UserError(
            f"run {run.url} has no {path} (the {what} a completed run writes): evaluate one of its checkpoints "
            "with --checkpoint STEP, or let the run finish"
        ) from None


def pick_device(name: str) -> torch.device:
    """--device: auto is the first GPU if there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: this machine has no CUDA GPU; use --device cpu or auto")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r}: expected auto, cpu, cuda or cuda:N") from None
