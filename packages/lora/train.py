"""LoRA fine-tuning of a causal LM with transformers + peft. Run it with torchrun (or plain python):

    torchrun --nproc-per-node 2 -m dtrain.lora.train --model tiny-llama --data corpus.txt --max-steps 20

Only the LoRA weights train, so only they are in the optimizer, in DDP's all-reduce and in the
checkpoints. Blocks are packed (no padding), so tokens/s counts real tokens. Each global batch is
drawn from a permutation of (seed, epoch) and each rank takes its slice, so a resumed run replays
exactly what an unbroken one would have seen.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain.common.config import Precision
from dtrain.common.errors import Preempted, UserError
from dtrain.common.precision import check_training
from dtrain.common.sampling import epoch_order, rank_batch
from dtrain.common.workload import Context, run_workload
from dtrain.lora.config import LoraConfig
from dtrain.lora.data import Blocks, load_blocks, read_documents
from dtrain.lora.fused import fuse_model
from dtrain.lora.model import apply_configured_lora, load_base

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
    """Mean next-token cross-entropy over the block (every position is a real token)."""
    return model(input_ids=x, labels=x, use_cache=False).loss


@torch.no_grad()
def evaluate(ctx: Context, model: torch.nn.Module, blocks: torch.Tensor, micro: int, cap: int) -> dict[str, float]:
    """Held-out loss and perplexity, each rank taking a contiguous shard, summed across ranks."""
    d = ctx.d
    model.eval()
    n = blocks.shape[0] if not cap else min(blocks.shape[0], cap * micro * d.world_size)
    lo, hi = n * d.rank // d.world_size, n * (d.rank + 1) // d.world_size
    # One copy of this rank's blocks to the device and one tensor for the sums, not one of each per
    # batch: from the host's pageable memory each is a copy the CPU waits for.
    mine = blocks[lo:hi].to(d.device)
    totals = torch.tensor([0.0, hi - lo], dtype=torch.float64, device=d.device)  # loss * blocks, blocks
    for i in range(0, hi - lo, micro):
        x = mine[i : i + micro]
        with ctx.precision.autocast():
            loss = lm_loss(model, x)
        totals[0] += loss.double() * x.shape[0]
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over `micro_batches`, all-reducing LoRA gradients once, on the last."""
    loss_sum = torch.zeros((), device=ctx.d.device)
    for k, x in enumerate(micro_batches):
        last = k == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not isinstance(ddp, DDP) else ddp.no_sync()
        with sync:
            with ctx.precision.autocast():
                loss = lm_loss(ddp, x) / len(micro_batches)
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    scaler.unscale_(opt)
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss_sum, norm


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


def train(ctx: Context) -> dict[str, Any]:
    cfg: LoraConfig = ctx.cfg
    d, report = ctx.d, ctx.report
    if cfg.batch_size % (d.world_size * cfg.grad_accum):
        raise UserError(
            f"batch_size {cfg.batch_size} must be divisible by processes x grad_accum "
            f"({d.world_size} x {cfg.grad_accum})"
        )
    micro = cfg.batch_size // (d.world_size * cfg.grad_accum)

    texts = read_documents(cfg.data, cfg.text_field)
    model, tokenizer = load_base(cfg.model, base_dtype(ctx.precision.mode, d.device), cfg.run.seed, d.device, d)
    model, targets = apply_configured_lora(model, cfg)
    model.to(d.device)  # peft puts LoRA weights beside their base layer; this catches any it does not
    fused = fuse_model(model)  # exact regroupings of the stock arithmetic; the stock path where they do not apply
    vocab = getattr(model.config, "vocab_size", None)
    blocks: Blocks = load_blocks(
        cfg.data, cfg.text_field, tokenizer, cfg.seq_len, cfg.eval_fraction, cfg.run.seed, texts=texts
    )
    if vocab is not None and int(blocks.train.max()) >= vocab:
        raise UserError(
            f"the tokenizer produced id {int(blocks.train.max())} but {cfg.model!r} has {vocab} embeddings: "
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
    ddp = wrap_ddp(model, d) if d.backend else model
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel updates every LoRA tensor in one pass; torch's CPU default is a per-tensor loop of ~12 ops.
    fused_adam = d.device.type in ("cpu", "cuda")
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused_adam or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, warmup))
    scaler = ctx.precision.make_scaler()

    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    step = 0
    metrics: dict[str, float] = {}
    state = ctx.ckpt.load()
    if state is not None:
        set_peft_model_state_dict(model, state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step = state["step"]
        report.rewind(step)
        ctx.restore_scaler(scaler, state, step)
    else:
        torch.manual_seed(cfg.run.seed * 1_000_003 + d.rank + 1)  # per-rank dropout streams

    def snapshot() -> dict[str, Any]:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        return {
            "model": get_peft_model_state_dict(model),
            "optimizer": opt.state_dict(),
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
    window_steps, window_start = 0, time.perf_counter()
    perm_epoch = -1
    model.train()
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if epoch != perm_epoch:
            perm, perm_epoch = epoch_order(blocks.train.shape[0], cfg.run.seed, epoch), epoch
        mine = rank_batch(perm, in_epoch, cfg.batch_size, d.rank, d.world_size)
        batch = blocks.train[mine].to(d.device, non_blocking=True)
        loss, norm = train_step(ctx, model, ddp, opt, sched, scaler, list(batch.split(micro)), cfg.max_grad_norm)
        step += 1
        window += loss
        window_steps += 1

        if step % cfg.run.log_every == 0 or step == total:
            mean_loss = d.all_mean(window / window_steps).item()
            elapsed = time.perf_counter() - window_start
            tokens = window_steps * cfg.batch_size * cfg.seq_len
            report.log(
                step,
                loss=mean_loss,
                lr=sched.get_last_lr()[0],
                grad_norm=norm.item(),
                epoch=step / steps_per_epoch,
                tokens_per_s=tokens / elapsed,
                samples_per_s=tokens / elapsed / cfg.seq_len,
            )
            report.advance(step, f"loss {mean_loss:.4f}")
            check_training(mean_loss, scaler, ctx.precision.mode, step)  # the row above stays, for the record
            metrics["loss"] = mean_loss
            window.zero_()
            window_steps, window_start = 0, time.perf_counter()

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
        ctx.ckpt.save(step, snapshot, epoch_end=in_epoch + 1 == steps_per_epoch, last=stop or step == total)
        if stop:
            raise Preempted()

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
    if d.is_main:
        export(ctx, model, tokenizer, cfg.merge)
    report.info(f"done: eval perplexity {final['eval_perplexity']:.3f}; adapter in {ctx.run.join('final/adapter')}")
    return final


def export(ctx: Context, model: Any, tokenizer: Any, merge: bool) -> None:
    """final/adapter in PEFT's own format (adapter_config.json + adapter_model.safetensors), loadable
    with peft.PeftModel.from_pretrained(base, path); with merge, final/merged as a plain model."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a shard-writing bar in a log file is noise
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(f"{tmp}/adapter")
        if merge:
            merged = model.merge_and_unload()
            merged.save_pretrained(f"{tmp}/merged")
            tokenizer.save_pretrained(f"{tmp}/merged")
        for f in sorted(Path(tmp).rglob("*")):
            if f.is_file():
                ctx.run.write_bytes(f"final/{f.relative_to(tmp).as_posix()}", f.read_bytes())


def main(argv: Sequence[str] | None = None) -> None:
    # transformers 5 warns about its own renamed attributes when peft touches them.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    run_workload("lora", LoraConfig, train, argv)


if __name__ == "__main__":
    main()
