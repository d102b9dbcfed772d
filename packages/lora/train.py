"""LoRA fine-tuning of a causal LM with transformers + peft. Run it with torchrun (or plain python):

    torchrun --nproc-per-node 2 -m dtrain.lora.train --model tiny-llama --data corpus.txt --max-steps 20

Only the LoRA weights train, so only they are in the optimizer, in DDP's all-reduce and in the
checkpoints. Blocks are packed (no padding), so tokens/s counts real tokens. Each global batch is
drawn from a permutation of (seed, epoch) and each rank takes its slice, so a resumed run replays
exactly what an unbroken one would have seen.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain.common.config import Precision
from dtrain.common.errors import ExitCode, Preempted, UserError
from dtrain.common.precision import check_training
from dtrain.common.sampling import epoch_order, rank_batch
from dtrain.common.workload import Context, run_workload
from dtrain.lora import quant as quantmod
from dtrain.lora import samples, sft, sharding
from dtrain.lora.config import AdapterDtype, Attention, DataFormat, LoraConfig, Optimizer, Quant, Sharding, Switch
from dtrain.lora.data import Blocks, Row, load_blocks, read_documents, read_rows
from dtrain.lora.fused import fuse_model
from dtrain.lora.lean import lean_model
from dtrain.lora.loss import causal_lm_loss
from dtrain.lora.model import apply_configured_lora, attention_kernel, enable_activation_checkpointing, load_base

MIN_LR_FRACTION = 0.1
DEFAULT_WARMUP_FRACTION = 0.03


def lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the block (every position is a real token), chunked
    (dtrain.lora.loss): no fp32 logits for the whole block."""
    total, count = causal_lm_loss(model, x, x)
    return total / count


def loss_terms(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int | torch.Tensor]:
    """(loss sum, weight) of a micro-batch: plain-text blocks weigh one each (their mean loss times
    their count); instruction/chat rows (B x 3 x L, dtrain.lora.sft) by their trained tokens."""
    if x.dim() == 3:
        return sft.forward_rows(model, x)
    return lm_loss(model, x).double() * x.shape[0], x.shape[0]


@torch.no_grad()
def evaluate(ctx: Context, model: torch.nn.Module, blocks: torch.Tensor, micro: int, cap: int) -> dict[str, float]:
    """Held-out loss and perplexity, each rank taking a contiguous shard, summed across ranks: the mean
    over blocks (plain text), or over trained tokens (instruction/chat rows)."""
    d = ctx.d
    model.eval()
    n = blocks.shape[0] if not cap else min(blocks.shape[0], cap * micro * d.world_size)
    lo, hi = n * d.rank // d.world_size, n * (d.rank + 1) // d.world_size
    # One copy of this rank's blocks to the device and one tensor for the sums, not one of each per
    # batch: from the host's pageable memory each is a copy the CPU waits for.
    mine = blocks[lo:hi].to(d.device)
    totals = torch.zeros(2, dtype=torch.float64, device=d.device)  # loss * weight, weight
    for i in range(0, hi - lo, micro):
        x = mine[i : i + micro]
        with ctx.precision.autocast():
            loss, weight = loss_terms(model, x)
        totals[0] += loss.double()
        totals[1] += weight
    sharding.join_forwards(model, n, d.world_size, micro, hi - lo, d.device, ctx.precision.autocast)  # FSDP
    if d.backend is not None:
        torch.distributed.all_reduce(totals)
    model.train()
    loss = (totals[0] / totals[1]).item()
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


def train_step(
    ctx: Context,
    model: torch.nn.Module,
    ddp: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    scaler: torch.amp.GradScaler,
    micro_batches: list[torch.Tensor],
    max_norm: float,
    trained_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `micro_batches`, all-reducing LoRA gradients once, on the last.

    Instruction/chat rows hold different numbers of trained tokens, so their loss is the sum over
    this rank's tokens divided by `trained_tokens`, the whole global batch's (known to every rank from
    the data, no collective): after the gradient average over ranks that is the mean over every trained
    token of the step, whatever the split into ranks and micro-batches."""
    loss_sum = torch.zeros((), device=ctx.d.device)
    for k, x in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        with sharding.grad_sync(ddp, last):
            with ctx.precision.autocast():
                if x.dim() == 3:
                    loss = sft.forward_rows(ddp, x)[0] * ctx.d.world_size / max(trained_tokens, 1)
                else:
                    loss = lm_loss(ddp, x) / len(micro_batches)
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    scaler.unscale_(opt)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = sharding.local(torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf")))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss_sum, norm


def make_optimizer(
    cfg: LoraConfig, params: list[torch.nn.Parameter], device: torch.device, sharded: bool
) -> torch.optim.Optimizer:
    """AdamW over the LoRA weights: torch's fused kernel (every tensor in one pass; torch's CPU
    default is a per-tensor loop of ~12 ops), or bitsandbytes' 8-bit moments (--optimizer
    adamw-8bit: 2 bytes a weight instead of 8 for tensors of 4,096 values or more, bitsandbytes'
    min_8bit_size; smaller ones keep fp32 moments). Paged moments move to host memory under pressure
    on a GPU; bitsandbytes 0.50 runs them unpaged on the CPU."""
    kw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == Optimizer.ADAMW:
        return torch.optim.AdamW(params, **kw, fused=device.type in ("cpu", "cuda") or None)
    if sharded:
        raise UserError(f"--optimizer {cfg.optimizer.value} does not take FSDP2's sharded weights: use --sharding ddp")
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError(
            f"--optimizer {cfg.optimizer.value} needs bitsandbytes: pip install 'dtrain[qlora]' (or pip install "
            "bitsandbytes), or use --optimizer adamw"
        ) from None
    cls = bnb.optim.PagedAdamW8bit if cfg.optimizer == Optimizer.PAGED_ADAMW_8BIT else bnb.optim.AdamW8bit
    # bitsandbytes says so at the first step on the CPU: the docstring says it once
    warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    return cls(params, **kw)


def wrap_ddp(model: torch.nn.Module, d: Any) -> DDP:
    """DDP over the LoRA weights only. Its constructor broadcasts rank 0's parameters and buffers to
    every rank; the frozen base weights are left out of that, as every rank reads them from the same
    files or builds them from the same seed on the CPU (load_base), and a 7B model's would be 14 GB
    through the network at start-up. The only buffers are rotary frequencies, constants computed alike
    on every rank: broadcasting them at every forward (DDP's default) would be a collective a step for
    nothing."""
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    DDP._set_params_and_buffers_to_ignore_for_model(model, frozen + [n for n, _ in model.named_buffers()])
    # forward_sync_buffers is torch 2.13's name for the per-forward broadcast; the ignore list above keeps
    # the buffers out of the constructor's broadcast, which that flag alone does not.
    return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None, forward_sync_buffers=False)


def base_dtype(precision: Precision, device: torch.device) -> torch.dtype:
    """Frozen base weights in the compute dtype on GPU (half the memory and bandwidth); LoRA weights
    stay fp32 (peft's default), so the optimizer updates full-precision values."""
    if device.type != "cuda":
        return torch.float32
    return {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(precision, torch.float32)


@dataclasses.dataclass(frozen=True)
class Memory:
    """How the base model is held: 4-bit or not, activation checkpointing, sharded or replicated."""

    quantized: bool
    checkpointing: bool
    sharded: bool
    reason: str  # why, for the run's log

    def describe(self) -> str:
        parts = ["QLoRA (NF4 base)" if self.quantized else "full-precision base"]
        parts.append(f"activation checkpointing {'on' if self.checkpointing else 'off'}")
        parts.append("FSDP2 sharded" if self.sharded else "replicated (DDP)")
        return ", ".join(parts) + f" ({self.reason})"


def plan_needs(
    cfg: LoraConfig, d: Any, accelerator: str | None = None, usable_gib: float | None = None
) -> tuple[bool, bool, str]:
    """(activation checkpointing needed, sharding needed, what decided) for the `auto` settings, from
    the memory plan (dtrain.lora.plan) of this run on this card: `accelerator` is the card's name
    (default: torch's name of this process's CUDA GPU), `usable_gib` what its allocator can hand out
    (default: the card's figure). A run the plan says cannot fit is refused here, in one line, before
    anything is loaded. Without a plan (the CPU, a card the table does not know, a model the plan cannot
    read) checkpointing goes on for QLoRA runs (the large models a 4-bit base is for) and nothing is
    sharded, as the log line says."""
    from dtrain.common import accelerators
    from dtrain.lora import plan as lp

    fallback = cfg.quant == Quant.NF4, False
    if accelerator is None:
        if d.device.type != "cuda":
            return *fallback, "no memory plan on the CPU"
        accelerator = torch.cuda.get_device_name(d.device)
    if accelerators.by_name(accelerator) is None and not _gcp_card(accelerator):
        return *fallback, f"no memory plan: {accelerator!r} is not in dtrain's card table"
    try:
        shape = lp.read_shape(cfg.model)
    except UserError as e:
        return *fallback, f"no memory plan: {e}"
    world = getattr(d, "world_size", 1)
    p = lp.plan(
        shape,
        accelerator=accelerator,
        gpus=world,
        seq_len=cfg.seq_len,
        batch=max(1, cfg.batch_size // (world * cfg.grad_accum)),
        lora_rank=cfg.lora_r,
        precision=cfg.run.precision.value,
        quant=cfg.quant.value,
        strategy=cfg.sharding.value,
        checkpointing=cfg.activation_checkpointing.value,
        targets=tuple(cfg.target_modules) or lp.LLAMA_TARGETS,
        usable_gib=usable_gib,
        adapter_dtype=cfg.adapter_dtype.value,
        optimizer=cfg.optimizer.value,
        # plain text is never packed with a mask; auto-detected data may be chat: counted as packed
        packed=cfg.packing and cfg.format != DataFormat.TEXT,
        attention="sdpa" if _dense_mask_runs(cfg, d) else "flash",
    )
    lp.refuse_if_unfit(p)
    return (
        p.checkpointing,
        p.strategy == "fsdp",
        (f"plan: {p.memory.total / lp.GIB:.1f} of {p.usable / lp.GIB:.1f} GiB per GPU on {p.card_label}"),
    )


def _dense_mask_runs(cfg: LoraConfig, d: Any) -> bool:
    """Whether build_model will load stock sdpa, whose packed rows carry a dense L x L mask; the plan
    counts none for flash-attention 2 and sdpa_packed (the kernel attention_kernel picks), which
    skip the masked blocks (docs/decisions.md, "Packed attention")."""
    if cfg.attention != Attention.AUTO or d.device.type != "cuda":  # auto: sdpa_packed off a GPU
        return cfg.attention == Attention.SDPA
    auto = cfg.quant == Quant.NF4 or cfg.run.precision == Precision.AUTO  # auto: the GPU's compute dtype
    dtype = quantmod.compute_dtype(d.device) if auto else base_dtype(cfg.run.precision, d.device)
    return attention_kernel(cfg.attention.value, d.device, dtype)[0] == "sdpa"


def _gcp_card(accelerator: str) -> bool:
    from dtrain.common import accelerators

    try:
        accelerators.card(accelerator)
    except KeyError:
        return False
    return True


def memory_strategy(cfg: LoraConfig, d: Any, accelerator: str | None = None, usable_gib: float | None = None) -> Memory:
    """The flags, with `auto` resolved by the plan; refuses in one line what cannot run here or cannot
    fit (`accelerator`, `usable_gib`: plan_needs')."""
    if cfg.quant == Quant.NF4:
        quantmod.require_cuda(d.device)
    need_ac, need_shard, decided = plan_needs(cfg, d, accelerator, usable_gib)
    ac = cfg.activation_checkpointing == Switch.ON or (cfg.activation_checkpointing == Switch.AUTO and need_ac)
    shard = cfg.sharding == Sharding.FSDP or (cfg.sharding == Sharding.AUTO and need_shard)
    if shard and d.backend is None:
        shard = False  # one process: nothing to shard across, the same run as DDP's
    auto = [n for n, v in (("checkpointing", cfg.activation_checkpointing), ("sharding", cfg.sharding)) if v == "auto"]
    return Memory(
        cfg.quant == Quant.NF4, ac, shard, (f"auto: {', '.join(auto)}" if auto else "as flagged") + f"; {decided}"
    )


def whole_4bit_fits(cfg: LoraConfig, d: Any) -> bool:
    """Whether this GPU has room for the whole 4-bit base (the plan's figure, with 10% to spare) while it is
    quantized, before sharding keeps 1/N of it. If not, or not known, a sharded QLoRA run reads it into host
    memory and quantizes it there (bitsandbytes' CPU kernels: ~11M weights/s on 2 cores, minutes for a
    70B model on a GPU machine's cores, and the 4-bit model once per rank in host memory); fully_shard then
    moves 1/N of each layer to the GPU (sharding.shard)."""
    if d.device.type != "cuda":
        return True  # the CPU (tests): host memory is the device's
    from dtrain.lora import plan as lp

    try:
        shape = lp.read_shape(cfg.model)
    except UserError:
        return False
    need = lp.memory(shape, seq_len=1, batch=1, lora_rank=cfg.lora_r, precision="bf16", quant="4bit").weights
    return need * 1.1 < torch.cuda.mem_get_info(d.device)[0]


def build_model(ctx: Context, memory: Memory) -> tuple[torch.nn.Module, Any, list[str], dict[str, int]]:
    """The base model (4-bit where asked), its LoRA adapter, the CPU fusions, and activation
    checkpointing: (peft model on the device, tokenizer, LoRA targets, fusion counts)."""
    cfg, d = ctx.cfg, ctx.d
    dtype = quantmod.compute_dtype(d.device) if memory.quantized else base_dtype(ctx.precision.mode, d.device)
    attention, why = attention_kernel(cfg.attention.value, d.device, dtype)
    if memory.quantized:
        where = None if memory.sharded and not whole_4bit_fits(cfg, d) else d.device
        model, tokenizer = load_base(
            cfg.model, dtype, cfg.run.seed, where, d, quantization=quantmod.nf4_config(dtype), attention=attention
        )
        model = quantmod.prepare(model)
    else:
        model, tokenizer = load_base(cfg.model, dtype, cfg.run.seed, d.device, d, attention=attention)
    ctx.report.info(f"attention: {attention} ({why})")
    model, targets = apply_configured_lora(model, cfg)
    if cfg.adapter_dtype == AdapterDtype.BF16:
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if not memory.quantized:  # 4-bit weights were placed as they were read, and peft put LoRA's beside them
        model.to(d.device)  # peft puts LoRA weights beside their base layer; this catches any it does not
    fused = fuse_model(model)  # exact regroupings of the stock arithmetic; the stock path where they do not apply
    lean_model(model)  # 16-bit steps: remake cheap pointwise results in the backward rather than keep them
    if memory.checkpointing:
        enable_activation_checkpointing(model)
    ctx.report.info(f"memory: {memory.describe()}")
    return model, tokenizer, targets, fused


def wrap(model: torch.nn.Module, d: Any, memory: Memory) -> torch.nn.Module:
    """What the training step calls: FSDP2 shards in place, DDP wraps, one process takes the model."""
    if memory.sharded:
        return sharding.shard(model, d)
    return wrap_ddp(model, d) if d.backend else model


def merged_copy(ctx: Context, model: Any, memory: Memory, adapter: dict | None) -> torch.nn.Module:
    """The adapter merged into a fresh copy of the base, read unquantized on the CPU: a 4-bit base
    would be merged at 4-bit precision and saved as a quantized checkpoint, a sharded one has 1/N of
    its weights here. A QLoRA run's merge is in bf16 (the issue's "merged bf16 model"); a sharded
    run's in its training dtype."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    cfg = ctx.cfg
    weights = sharding.peft_state(model, adapter) if adapter is not None else get_peft_model_state_dict(model)
    dtype = torch.bfloat16 if memory.quantized else base_dtype(ctx.precision.mode, ctx.d.device)
    base, _ = load_base(cfg.model, dtype, cfg.run.seed)
    fresh, _ = apply_configured_lora(base, cfg)
    set_peft_model_state_dict(fresh, {k: v.to(dtype) for k, v in weights.items()})
    return fresh.merge_and_unload()


@dataclasses.dataclass
class DataSource:
    """What --data (and --eval-data) hold, read before the model loads."""

    fields: sft.Fields
    rows: list[Row]
    eval_rows: list[Row] | None
    texts: list[str] | None = None  # plain text
    eval_texts: list[str] | None = None


def read_data(cfg: LoraConfig) -> DataSource:
    rows = read_rows(cfg.data, cfg.text_field, cfg.data_split, cfg.data_subset)
    eval_rows = sft.eval_rows_for(cfg, cfg.text_field)
    fields = sft.resolve_fields(rows, cfg) if rows else sft.Fields(DataFormat.TEXT)
    cfg.settle_seq_len(fields.format)
    source = DataSource(fields, rows, eval_rows)
    if fields.format == DataFormat.TEXT:
        source.texts = read_documents(cfg.data, cfg.text_field, rows)
        if eval_rows is not None:
            source.eval_texts = read_documents(cfg.eval_data, cfg.text_field, eval_rows)
    elif eval_rows is not None and eval_rows:
        sft.resolve_fields(eval_rows, cfg)  # the same fields, in every held-out record
    return source


def make_blocks(ctx: Context, source: DataSource, model: torch.nn.Module, tokenizer: Any) -> Blocks:
    """Plain text as today's blocks; instruction/chat data as SFT rows, packed where this model's
    attention keeps packed documents apart. The first example is shown with its trained tokens marked."""
    cfg, report = ctx.cfg, ctx.report
    if source.texts is not None:
        return load_blocks(
            cfg.data, cfg.text_field, tokenizer, cfg.seq_len, cfg.eval_fraction, cfg.run.seed,
            texts=source.texts, eval_texts=source.eval_texts,
        )  # fmt: skip
    data = sft.read_sft(cfg, source.rows, source.eval_rows, tokenizer, source.fields)
    report.info(escape(sft.describe_example(tokenizer, data.train.examples[0])))
    for enc in (data.train, data.eval):
        if enc is not None and (notice := sft.dropped_notice(enc, cfg.seq_len)):
            report.info(escape(notice))
    packing = cfg.packing
    if packing:
        vocab = getattr(model.config, "vocab_size", None) or tokenizer.vocab_size
        isolated, diff = sft.packing_isolates(model, vocab, ctx.d.device)
        if not isolated:
            impl = getattr(model.config, "_attn_implementation", "?")
            report.info(
                f"packing off: this model's attention ({impl}) lets packed examples see each other "
                f"(logits moved by {diff:.3g}); each example gets its own padded row"
            )
            packing = False
    blocks = sft.build_blocks(cfg, data, tokenizer.pad_token_id, packing)
    trained, real = sft.step_tokens(blocks.train)
    report.info(
        f"{source.fields.format.value} data: loss on {'every token' if cfg.train_on_all else 'completions only'}, "
        f"{trained:,} of {real:,} training tokens trained; {'packed' if packing else 'one example a row'} "
        f"({real / blocks.train[:, 0].numel():.0%} of row slots hold tokens)"
    )
    return blocks


def train(ctx: Context) -> dict[str, Any]:
    cfg: LoraConfig = ctx.cfg
    d, report = ctx.d, ctx.report
    if cfg.batch_size % (d.world_size * cfg.grad_accum):
        raise UserError(
            f"batch_size {cfg.batch_size} must be divisible by processes x grad_accum "
            f"({d.world_size} x {cfg.grad_accum})"
        )
    micro = cfg.batch_size // (d.world_size * cfg.grad_accum)
    source = read_data(cfg)  # before the model loads, so bad data fails fast (and --seq-len settles)
    memory = memory_strategy(cfg, d)  # before anything is loaded: a run that cannot work stops here
    prompts = samples.read_prompt_file(cfg.sample_prompts)
    model, tokenizer, targets, fused = build_model(ctx, memory)
    if source.fields.format != DataFormat.TEXT:
        sft.refuse_untrained_template_tokens(model, tokenizer, cfg.model)
    # Wrapped before the data is packed: packing's check runs the model on the device, where a sharded
    # 4-bit model only is once sharded.
    ddp = wrap(model, d, memory)
    if memory.sharded:
        mine, whole = sharding.held_bytes(model)
        report.info(f"sharded: {mine / 2**20:.2f} MiB of the model's {whole / 2**20:.2f} MiB on each rank")
    vocab = getattr(model.config, "vocab_size", None)
    blocks: Blocks = make_blocks(ctx, source, model, tokenizer)
    ids = blocks.train[:, 0] if blocks.train.dim() == 3 else blocks.train
    if vocab is not None and int(ids.max()) >= vocab:
        raise UserError(
            f"the tokenizer produced id {int(ids.max())} but {cfg.model!r} has {vocab} embeddings: "
            "the model directory's tokenizer does not belong to its model"
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in model.parameters())
    report.info(
        f"model {cfg.model}: {total_params / 1e6:.1f}M parameters, LoRA r={cfg.lora_r} on "
        f"{', '.join(targets)}: {trainable / 1e6:.3f}M trainable; fused: "
        + ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in fused.items())
    )
    report.info(
        f"data {cfg.data}: {blocks.documents} documents, {blocks.tokens:,} tokens -> "
        f"{blocks.train.shape[0]} train / {blocks.eval.shape[0]} eval blocks of {cfg.seq_len}"
    )

    steps_per_epoch = blocks.train.shape[0] // cfg.batch_size
    if steps_per_epoch == 0:
        raise UserError(
            f"{blocks.train.shape[0]} training blocks are fewer than one batch ({cfg.batch_size}): "
            "lower --batch-size or --seq-len, or add data"
        )
    total = cfg.max_steps or cfg.epochs * steps_per_epoch
    warmup = cfg.warmup_steps or max(1, int(DEFAULT_WARMUP_FRACTION * total))
    opt = make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], d.device, memory.sharded)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup))
    scaler = sharding.grad_scaler(ctx.precision.make_scaler(), memory.sharded)

    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    step = 0
    metrics: dict[str, float] = {}
    state = ctx.ckpt.load()
    if state is not None:
        if memory.sharded:
            sharding.restore(model, opt, state["model"], state["optimizer"])
        else:
            set_peft_model_state_dict(model, state["model"])
            opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
        report.rewind(step)
        ctx.restore_scaler(scaler, state, step)
    else:
        torch.manual_seed(cfg.run.seed * 1_000_003 + d.rank + 1)  # per-rank dropout streams

    def snapshot() -> dict[str, Any]:
        # Sharded, every rank runs this (the gather is a collective) and rank 0 keeps the result; the
        # saved form is the same either way, so a sharded run resumes unsharded and the other way round.
        epoch, in_epoch = divmod(step, steps_per_epoch)
        weights, optim = sharding.snapshot(model, opt) if memory.sharded else (get_peft_model_state_dict(model), None)
        return {
            "model": weights,
            "optimizer": optim if memory.sharded else opt.state_dict(),
            "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(),
            "precision": ctx.precision.mode.value,
            "data": {"epoch": epoch, "step_in_epoch": in_epoch},
        }

    # Evaluation runs on the unwrapped model: through DDP a forward may start collectives (buffer
    # broadcasts), and a rank with no evaluation blocks would skip them and meet its peers at the
    # next all-reduce instead, a mismatch that hangs until the timeout.
    if step == 0:  # the starting point, so a run shows how far it moved
        metrics.update(evaluate(ctx, model, blocks.eval, micro, cfg.eval_batches))
        report.log(0, **{k: metrics[k] for k in ("eval_loss", "eval_perplexity")})
        report.info(f"step 0: eval loss {metrics['eval_loss']:.4f}, perplexity {metrics['eval_perplexity']:.3f}")
    report.start_progress(total, step, "train")
    window = torch.zeros((), device=d.device)
    window_steps, window_tokens, window_start = 0, 0, time.perf_counter()
    perm_epoch = -1
    model.train()
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if epoch != perm_epoch:
            perm, perm_epoch = epoch_order(blocks.train.shape[0], cfg.run.seed, epoch), epoch
        mine = rank_batch(perm, in_epoch, cfg.batch_size, d.rank, d.world_size)
        batch = blocks.train[mine].to(d.device, non_blocking=True)
        trained = 0
        if blocks.train.dim() == 3:  # SFT rows: the step's trained and real tokens, over the global batch
            trained, real = sft.step_tokens(blocks.train[perm[in_epoch * cfg.batch_size :][: cfg.batch_size]])
            window_tokens += real
        loss, norm = train_step(
            ctx, model, ddp, opt, sched, scaler, list(batch.split(micro)), cfg.max_grad_norm, trained
        )
        step += 1
        window += loss
        window_steps += 1

        if step % cfg.run.log_every == 0 or step == total:
            mean_loss = d.all_mean(window / window_steps).item()
            elapsed = time.perf_counter() - window_start
            tokens = window_tokens or window_steps * cfg.batch_size * cfg.seq_len  # SFT: real tokens only
            report.log(
                step,
                loss=mean_loss,
                lr=sched.get_last_lr()[0],
                grad_norm=norm.item(),
                epoch=step / steps_per_epoch,
                tokens_per_s=tokens / elapsed,
                samples_per_s=window_steps * cfg.batch_size / elapsed,
            )
            report.advance(step, f"loss {mean_loss:.4f}")
            check_training(mean_loss, scaler, ctx.precision.mode, step)  # the row above stays, for the record
            metrics["loss"] = mean_loss
            window.zero_()
            window_steps, window_tokens, window_start = 0, 0, time.perf_counter()

        if (cfg.eval_every and step % cfg.eval_every == 0) or step == total:
            paused_at = d.synchronize()  # evaluation is not training throughput
            metrics.update(evaluate(ctx, model, blocks.eval, micro, cfg.eval_batches))
            report.log(step, **{k: metrics[k] for k in ("eval_loss", "eval_perplexity")})
            report.info(
                f"step {step}/{total}: eval loss {metrics['eval_loss']:.4f}, "
                f"perplexity {metrics['eval_perplexity']:.3f}"
            )
            window_start += time.perf_counter() - paused_at
        stop = ctx.stop_requested(step)
        last = stop or step == total
        epoch_end = in_epoch + 1 == steps_per_epoch
        ctx.ckpt.save(step, snapshot, epoch_end=epoch_end, last=last, collective=memory.sharded)
        if stop:
            raise Preempted()

    if "eval_loss" not in metrics:  # resumed at its last step (a finished run): nothing ran to evaluate
        metrics.update(evaluate(ctx, model, blocks.eval, micro, cfg.eval_batches))
    final = {
        "model": cfg.model,
        "eval_loss": metrics.get("eval_loss"),
        "eval_perplexity": metrics.get("eval_perplexity"),
        "final_loss": metrics.get("loss"),
        "steps": step,
        "world_size": d.world_size,
        "precision": ctx.precision.mode.value,
        "target_modules": targets,
    }
    adapter = sharding.full_adapter(model) if memory.sharded else None  # a collective: every rank gathers
    if d.is_main:
        export(ctx, model, tokenizer, cfg.merge, memory, adapter)
        if memory.sharded:  # generation would need every rank's shards: dtrain eval --prompts does it whole
            report.info("samples: not written for a sharded run; `dtrain eval RUN --prompts FILE` samples the adapter")
        else:
            samples.write(ctx, model, tokenizer, source.fields, prompts, blocks.eval)
    report.info(f"done: eval perplexity {final['eval_perplexity']:.3f}; adapter in {ctx.run.join('final/adapter')}")
    return final


def export(
    ctx: Context, model: Any, tokenizer: Any, merge: bool, memory: Memory | None = None, adapter: dict | None = None
) -> None:
    """final/adapter in PEFT's own format (adapter_config.json + adapter_model.safetensors), loadable
    with peft.PeftModel.from_pretrained(base, path); with merge, final/merged as a plain model.
    `adapter`: a sharded run's LoRA weights gathered whole (sharding.full_adapter), saved in their
    place; a sharded or 4-bit model is merged into a fresh unquantized copy of the base (merged_copy)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a shard-writing bar in a log file is noise
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(f"{tmp}/adapter", **({"state_dict": adapter} if adapter is not None else {}))
        if merge:
            rebuild = memory is not None and (memory.sharded or memory.quantized)
            merged = merged_copy(ctx, model, memory, adapter) if rebuild else model.merge_and_unload()
            merged.save_pretrained(f"{tmp}/merged")
            tokenizer.save_pretrained(f"{tmp}/merged")
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                ctx.run.write_bytes(f"final/{f.relative_to(tmp).as_posix()}", f.read_bytes())


def main(argv: Sequence[str] | None = None) -> None:
    # transformers 5 warns about its own renamed attributes when peft touches them.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    # bitsandbytes (imported by peft where installed) says at import, on CPUs with AVX-512 bf16, that an
    # optional CPU kernel from the hub is missing: nothing a LoRA run uses, and noise in every run's log.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    args = list(sys.argv[1:] if argv is None else argv)
    if "--show-example" in args:  # before any run directory exists: nothing to clean up after a look
        sys.exit(int(show_example_main(args)))
    run_workload("lora", LoraConfig, train, argv)


def show_example_main(argv: list[str]) -> ExitCode:
    from dtrain.common.metrics import print_error
    from dtrain.common.workload import resolve_config

    try:
        cfg, _ = resolve_config("lora", LoraConfig, argv)
        text = sft.show_example(cfg)
    except UserError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print_error(str(e))
        return e.exit_code
    if int(os.environ.get("RANK", 0)) == 0:
        print(text, flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    main()
