"""MNIST / Fashion-MNIST training. Run it with torchrun (or plain python for one process):

    torchrun --nproc-per-node 2 -m dtrain.mnist.train --dataset fashion-mnist --epochs 8

The whole dataset lives as tensors on the training device: batches are index gathers, with no
DataLoader workers and no per-sample Python transforms. Each rank takes its slice of every global
batch from a permutation drawn from (seed, epoch), so data order is deterministic and a resumed
run replays exactly what an unbroken one would have seen.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dtrain.common.errors import Preempted, UserError
from dtrain.common.precision import check_training
from dtrain.common.sampling import epoch_order, rank_batch
from dtrain.common.workload import Context, run_workload
from dtrain.mnist.config import MnistConfig
from dtrain.mnist.data import MEAN_STD, Split, load_split
from dtrain.mnist.model import MnistNet

WARMUP_FRACTION = 0.05


def lr_lambda(total: int):
    warmup = max(1, int(WARMUP_FRACTION * total))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return f


def shift_batch(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Random shifts of up to 2 pixels, for a whole uint8 batch at once (B x 28 x 28)."""
    g = torch.Generator(device=x.device).manual_seed(seed)
    b, h, w = x.shape
    padded = F.pad(x, (2, 2, 2, 2))
    dy = torch.randint(0, 5, (b,), generator=g, device=x.device)
    dx = torch.randint(0, 5, (b,), generator=g, device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, :]
    return padded[torch.arange(b, device=x.device)[:, None, None], rows, cols]


class Normalize:
    def __init__(self, mean: float, std: float) -> None:
        self.mean, self.std = mean, std

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = (x.float() / 255 - self.mean) / self.std
        return x.unsqueeze(1).contiguous(memory_format=torch.channels_last)


def train_step(
    ctx: Context,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    scaler: torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    smoothing: float,
) -> torch.Tensor:
    with ctx.precision.autocast():
        loss = F.cross_entropy(model(x), y, label_smoothing=smoothing)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    sched.step()
    return loss.detach()


def make_optimizer(net: torch.nn.Module, cfg: MnistConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `net`. On a GPU, the fused kernel takes GradScaler's scale and overflow flag as
    tensors; the default one has GradScaler read the flag with .item(), a host-GPU sync at every fp16
    step (benchmarks/gpu_smoke.py checks that none is left)."""
    return torch.optim.AdamW(
        net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda" or None
    )


@torch.no_grad()
def evaluate(ctx: Context, net: torch.nn.Module, data: Split, norm: Normalize, batch: int) -> dict[str, float]:
    """Accuracy and loss of `net` (the unwrapped model, not DDP) on `data`, each rank taking a
    contiguous shard, summed across ranks.

    Not through DDP: its forward broadcasts the BatchNorm statistics, and a rank whose shard is empty
    (fewer images than ranks) would skip that collective and hang its peers. Every rank takes rank
    0's statistics here instead, as DDP would have, so the figures are those of the saved model."""
    d = ctx.d
    d.broadcast_buffers(net)
    net.eval()
    n = data.labels.shape[0]
    lo, hi = n * d.rank // d.world_size, n * (d.rank + 1) // d.world_size
    totals = torch.zeros(2, dtype=torch.float64, device=d.device)  # correct, loss sum
    for i in range(lo, hi, batch):
        x, y = norm(data.images[i : min(i + batch, hi)]), data.labels[i : min(i + batch, hi)]
        with ctx.precision.autocast():
            logits = net(x)
        totals[0] += (logits.argmax(1) == y).sum()
        totals[1] += F.cross_entropy(logits.float(), y, reduction="sum")
    if d.backend is not None:
        torch.distributed.all_reduce(totals)
    net.train()
    return {"eval_accuracy": totals[0].item() / n, "eval_loss": totals[1].item() / n}


def train(ctx: Context) -> dict[str, Any]:
    cfg: MnistConfig = ctx.cfg
    d, report = ctx.d, ctx.report
    if cfg.batch_size % d.world_size:
        raise UserError(f"batch_size {cfg.batch_size} must be divisible by the {d.world_size} processes")
    train_data = load_split(cfg.dataset, cfg.train_split, cfg.data_dir, cfg.download, d.device, report.info)
    eval_data = load_split(cfg.dataset, cfg.eval_split, cfg.data_dir, cfg.download, d.device, report.info)
    report.info(
        f"data: {cfg.dataset.value} {cfg.train_split} ({len(train_data.labels)}) / {cfg.eval_split} "
        f"({len(eval_data.labels)}) from {train_data.source}, held on {d.device}"
    )
    norm = Normalize(*MEAN_STD[cfg.dataset])
    steps_per_epoch = len(train_data.labels) // cfg.batch_size
    if steps_per_epoch == 0:
        raise UserError(
            f"{cfg.train_split} has {len(train_data.labels)} images, fewer than one batch "
            f"({cfg.batch_size}): lower --batch-size"
        )
    total = cfg.epochs * steps_per_epoch

    if d.device.type == "cuda":
        # Every training batch has the same shape: cuDNN's autotuned convolution choice is made once.
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(cfg.run.seed)  # identical initial weights on every rank
    net = MnistNet(cfg.width).to(d.device, memory_format=torch.channels_last)
    model = DDP(net, device_ids=[d.device.index] if d.device.type == "cuda" else None) if d.backend else net
    opt = make_optimizer(net, cfg, d.device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total))
    scaler = ctx.precision.make_scaler()

    step, best = 0, 0.0
    state = ctx.ckpt.load()
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        step, best = state["step"], state.get("best_accuracy", 0.0)
        report.rewind(step)
        ctx.restore_scaler(scaler, state, step)
        pos = state["data"]
        if (pos["epoch"], pos["step_in_epoch"]) != divmod(step, steps_per_epoch):
            raise UserError(
                f"checkpoint data position (epoch {pos['epoch']}, step {pos['step_in_epoch']}) "
                f"does not fit {steps_per_epoch} steps per epoch: keep --batch-size and the splits "
                "of the run you resume"
            )
    else:
        torch.manual_seed(cfg.run.seed * 1_000_003 + d.rank + 1)  # per-rank dropout streams

    def snapshot() -> dict[str, Any]:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        return {
            "model": net.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "scaler": scaler.state_dict(),
            "precision": ctx.precision.mode.value,
            "best_accuracy": best,
            "data": {"epoch": epoch, "step_in_epoch": in_epoch},
        }

    report.start_progress(total, step, "train")
    window_loss, window_start, window_steps = torch.zeros((), device=d.device), time.perf_counter(), 0
    metrics: dict[str, float] = {}
    model.train()
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if in_epoch == 0 or step == (state or {}).get("step"):
            perm = epoch_order(len(train_data.labels), cfg.run.seed, epoch).to(d.device)
        idx = rank_batch(perm, in_epoch, cfg.batch_size, d.rank, d.world_size)
        x = train_data.images[idx]
        if cfg.augment:
            x = shift_batch(x, seed=(cfg.run.seed * 1_000_003 + step) * 64 + d.rank)
        loss = train_step(ctx, model, opt, sched, scaler, norm(x), train_data.labels[idx], cfg.label_smoothing)
        step += 1
        window_loss += loss
        window_steps += 1

        if step % cfg.run.log_every == 0 or step == total:
            mean_loss = d.all_mean(window_loss / window_steps).item()
            elapsed = time.perf_counter() - window_start
            report.log(
                step,
                loss=mean_loss,
                lr=sched.get_last_lr()[0],
                epoch=step / steps_per_epoch,
                samples_per_s=window_steps * cfg.batch_size / elapsed,
            )
            report.advance(step, f"loss {mean_loss:.4f}")
            check_training(mean_loss, scaler, ctx.precision.mode, step)  # the row above stays, for the record
            metrics["loss"] = mean_loss
            window_loss.zero_()
            window_start, window_steps = time.perf_counter(), 0

        epoch_end = step % steps_per_epoch == 0
        if epoch_end:
            paused_at = d.synchronize()  # evaluation is not training throughput
            metrics.update(evaluate(ctx, net, eval_data, norm, cfg.eval_batch_size))
            best = max(best, metrics["eval_accuracy"])
            report.log(step, epoch=step // steps_per_epoch, **{k: metrics[k] for k in ("eval_accuracy", "eval_loss")})
            report.info(
                f"epoch {step // steps_per_epoch}/{cfg.epochs}: eval accuracy "
                f"{metrics['eval_accuracy']:.4f}, loss {metrics['eval_loss']:.4f}"
            )
            window_start += time.perf_counter() - paused_at
        stop = ctx.stop_requested(step)
        ctx.ckpt.save(step, snapshot, epoch_end=epoch_end, last=stop or step == total)
        if stop:
            raise Preempted()

    if "eval_accuracy" not in metrics:  # resumed at its last step (a finished run): nothing ran to evaluate
        metrics.update(evaluate(ctx, net, eval_data, norm, cfg.eval_batch_size))
        best = max(best, metrics["eval_accuracy"])
    final = {
        "dataset": cfg.dataset.value,
        "accuracy": metrics.get("eval_accuracy"),
        "best_accuracy": best,
        "final_loss": metrics.get("loss"),
        "epochs": cfg.epochs,
        "steps": step,
        "world_size": d.world_size,
        "precision": ctx.precision.mode.value,
        "device": str(d.device),
        "model_config": cfg.model_config(),
    }
    if d.is_main:
        export(ctx, net, final)
    report.info(f"done: eval accuracy {final['accuracy']:.4f} (best {best:.4f}), model in {ctx.run.join('final')}")
    return final


def export(ctx: Context, net: torch.nn.Module, meta: dict[str, Any]) -> None:
    from safetensors.torch import save

    tensors = {k: v.detach().contiguous().cpu() for k, v in net.state_dict().items()}
    ctx.run.write_bytes("final/model.safetensors", save(tensors, metadata={"format": "pt"}))
    ctx.run.write_bytes("final/model.json", json.dumps(meta, indent=2, default=str).encode())


def main(argv: Sequence[str] | None = None) -> None:
    run_workload("mnist", MnistConfig, train, argv)


if __name__ == "__main__":
    main()
