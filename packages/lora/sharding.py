"""Sharded data parallel for LoRA with FSDP2 (`torch.distributed.fsdp.fully_shard`).

DDP keeps a whole base model on every GPU; FSDP2 keeps 1/N of it per GPU and all-gathers one decoder
layer's weights just before that layer runs (forward, and again for the backward), freeing them
after. Each decoder layer is its own unit, then the root (embeddings, final norm, output layer), as
torchtitan and torchtune do. Parameters are DTensors sharded on dim 0; the frozen base weights and
the LoRA weights share a layer's unit (FSDP2 keeps requires_grad per parameter, and in torch 2.13
needs one dtype only among the trainable ones: the LoRA weights, all fp32), so only the LoRA
gradients are reduce-scattered.

A 4-bit base (QLoRA, dtrain.lora.quant) shards the same way: the packed NF4 weights are frozen uint8
parameters, split on dim 0 like any other; only their quantization constants stay whole on every rank
(quant.place_quant_states). Such a model is loaded into host memory and fully_shard moves one layer at
a time to the GPU, keeping 1/N of it: a base whose 4-bit weights exceed one GPU never sits whole on one.

Checkpoints hold the same thing as a DDP run's: the LoRA weights in peft's key format and the
optimizer's state keyed by parameter index, gathered whole to rank 0 (torch.distributed.checkpoint's
full state dicts, offloaded to the CPU). The trainable state is small even for 8B models (r=8 on
Llama-3.1-8B's seven projections: 21M LoRA weights, 250 MB with AdamW's moments), so whole state dicts
cost nothing worth sharding, and a sharded run resumes as DDP and the other way round.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain.common.dist import Dist
from dtrain.common.errors import UserError


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks: the classes transformers keeps whole when splitting a model across devices."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(
            f"--sharding fsdp: no decoder layers found in {type(base).__name__} (transformers' _no_split_modules "
            "is empty): use --sharding ddp"
        )
    return layers


def shard(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """FSDP2 over every rank: each decoder layer, then the root. In place; returns the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # The chunked loss (dtrain.lora.loss) takes the model's output as the final hidden states, a slice
    # (a view) that it reads and never changes in place: FSDP2's warning about in-place ops on a
    # returned view does not apply, and would be noise in every step's log.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh(d.device.type, (d.world_size,))
    layers = decoder_layers(model)
    # Innermost first (reversed pre-order), should a listed class sit inside another: a unit must not
    # take in parameters a unit inside it manages.
    for layer in reversed(layers):
        # The last layer's weights are needed again at once by the backward: keep them gathered.
        fully_shard(layer, mesh=mesh, reshard_after_forward=layer is not layers[-1])
    fully_shard(model, mesh=mesh)
    from dtrain.lora import quant

    quant.place_quant_states(model, d.device)  # nothing for a model without 4-bit layers
    return model


def held_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the whole model's), 4-bit layers' quantization
    constants counted in both (every rank holds them whole): what sharding saved, for the run's log."""
    from dtrain.lora import quant

    local = whole = quant.constant_bytes(model)
    for p in model.parameters():
        mine = p.to_local() if hasattr(p, "to_local") else p
        local += mine.numel() * mine.element_size()
        whole += p.numel() * p.element_size()
    return local, whole


@contextlib.contextmanager
def grad_sync(wrapped: torch.nn.Module, last: bool) -> Iterator[None]:
    """Reduce gradients only on the last micro-batch of an optimizer step (DDP's no_sync, FSDP2's
    set_requires_gradient_sync: the others accumulate locally)."""
    if isinstance(wrapped, DDP) and not last:
        with wrapped.no_sync():
            yield
    elif is_sharded(wrapped):
        wrapped.set_requires_gradient_sync(last)
        yield
    else:
        yield


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. clip_grad_norm_'s norm over sharded gradients); others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trainable_names(model: torch.nn.Module) -> list[str]:
    """Trainable parameter names in model.parameters() order: the optimizer's index order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True, **kw)


def full_adapter(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights, whole, on rank 0's CPU, under their module names (empty on other ranks).
    A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options())


def peft_state(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module-named LoRA weights in peft's key format (the adapter name dropped), as
    get_peft_model_state_dict gives for an unsharded model."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=full)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(LoRA weights in peft's format, optimizer state keyed by index), whole, on rank 0 (empty
    elsewhere): what a DDP run's checkpoint holds. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    weights = full_adapter(model)
    optim = get_optimizer_state_dict(model, opt, options=_options())
    if not weights:
        return {}, {}
    index = {n: i for i, n in enumerate(trainable_names(model))}
    by_index = {
        "state": {index[n]: s for n, s in optim["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]],
    }
    return peft_state(model, weights), by_index


def restore(model: torch.nn.Module, opt: torch.optim.Optimizer, weights: dict[str, Any], optim: dict[str, Any]) -> None:
    """Load a checkpoint's (peft-format weights, index-keyed optimizer state) into a sharded model;
    every rank passes the whole state (Checkpointer.load gives it to each)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    names = trainable_names(model)
    adapter = getattr(model, "active_adapter", "default")
    by_peft_key = {n.replace(f".{adapter}", ""): n for n in names}
    if set(by_peft_key) != set(weights):
        missing = sorted(set(by_peft_key) ^ set(weights))[:3]
        raise UserError(f"the checkpoint's LoRA weights do not match this model's (e.g. {', '.join(missing)})")
    set_model_state_dict(model, {by_peft_key[k]: v for k, v in weights.items()}, options=_options(strict=False))
    by_name = {
        "state": {names[i]: s for i, s in optim["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]],
    }
    set_optimizer_state_dict(model, opt, by_name, options=_options())


def join_forwards(
    model: torch.nn.Module,
    n: int,
    world_size: int,
    micro: int,
    mine: int,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> None:
    """Sharded evaluation of `n` blocks split across ranks, `mine` of them here: every forward
    all-gathers weights with every rank, so a rank with fewer batches than another runs one-token
    forwards until it has made as many as the busiest rank. Nothing to do without FSDP."""
    if not is_sharded(model) or micro < 1:
        return
    busiest = max(-(-(n * (r + 1) // world_size - n * r // world_size) // micro) for r in range(world_size))
    x = torch.zeros((1, 1), dtype=torch.long, device=device)
    for _ in range(busiest - -(-mine // micro)):
        with autocast():
            model(input_ids=x, use_cache=False)


def grad_scaler(scaler: torch.amp.GradScaler, sharded: bool) -> torch.amp.GradScaler:
    """fp16 loss scaling for a sharded model: each rank sees only its shard of the gradients, so an
    overflow found on one rank must skip the step on all (ShardedGradScaler all-reduces the flag);
    a plain GradScaler would let the ranks' weights drift apart. Anything else: `scaler` itself."""
    if not sharded or not scaler.is_enabled():
        return scaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(scaler._device)
