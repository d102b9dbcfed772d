"""Deterministic data order shared by the workloads.

Each epoch's order is a permutation drawn from (seed, epoch) alone, and each rank takes a
contiguous slice of every global batch. So the global batch at a step is the same whatever the
number of processes, and a resumed run replays exactly what an unbroken one would have seen.
"""

from __future__ import annotations

import torch


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of `n` examples in `epoch` (on the CPU)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


def rank_batch(order: torch.Tensor, step_in_epoch: int, global_batch: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's indices of the global batch at `step_in_epoch`."""
    per_rank = global_batch // world_size
    return order[step_in_epoch * global_batch + rank * per_rank :][:per_rank]
