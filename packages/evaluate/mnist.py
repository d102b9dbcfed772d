"""MNIST evaluation: accuracy, loss, per-class accuracy and the confusion matrix of a run's model on
its evaluation split, computed the way the run evaluated (same split, normalisation, batch size and
precision), so the accuracy equals the one the run logged for the same weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dtrain.common.precision import resolve_precision
from dtrain.common.storage import Store
from dtrain.evaluate.loading import checkpoint_weights, read_final, workload_config
from dtrain.mnist.config import MnistConfig
from dtrain.mnist.data import MEAN_STD, Split, load_split
from dtrain.mnist.model import MnistNet
from dtrain.mnist.train import Normalize

CLASSES = 10


def load_model(run: Store, saved: dict[str, Any], step: int | None) -> tuple[MnistNet, MnistConfig]:
    """The run's network with its final weights (step None) or checkpoint `step`'s, in eval mode on the CPU."""
    cfg = workload_config(saved, MnistConfig)
    width = (saved.get("model_config") or {}).get("width", cfg.width)
    if step is None:
        from safetensors.torch import load

        weights = load(read_final(run, "final/model.safetensors", "exported model"))
    else:
        weights = checkpoint_weights(run, step)
    net = MnistNet(width)
    net.load_state_dict(weights)
    return net.eval(), cfg


def eval_data(cfg: MnistConfig, data_dir: str, split: str, device: torch.device, log: Callable[[str], None]) -> Split:
    return load_split(cfg.dataset, split or cfg.eval_split, data_dir or cfg.data_dir, cfg.download, device, log)


@torch.no_grad()
def logits_of(net: torch.nn.Module, cfg: MnistConfig, data: Split, batch: int, precision: Any) -> torch.Tensor:
    """Float32 logits for every image of `data`, batch by batch, normalised as in training."""
    norm = Normalize(*MEAN_STD[cfg.dataset])
    out = []
    for i in range(0, data.labels.shape[0], batch):
        with precision.autocast():
            out.append(net(norm(data.images[i : i + batch])).float())
    return torch.cat(out)


def confusion(labels: torch.Tensor, predictions: torch.Tensor) -> torch.Tensor:
    """confusion[true, predicted] counts."""
    flat = labels.long() * CLASSES + predictions.long()
    return torch.bincount(flat.cpu(), minlength=CLASSES * CLASSES).reshape(CLASSES, CLASSES)


def evaluate(
    run: Store,
    saved: dict[str, Any],
    step: int | None,
    *,
    device: torch.device,
    data_dir: str = "",
    split: str = "",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    net, cfg = load_model(run, saved, step)
    net = net.to(device, memory_format=torch.channels_last)
    precision = resolve_precision(cfg.run.precision, device)
    data = eval_data(cfg, data_dir, split, device, log)
    n = int(data.labels.shape[0])
    log(f"evaluating on {n} images of {cfg.dataset.value} {split or cfg.eval_split} ({device}, {precision.mode.value})")
    logits = logits_of(net, cfg, data, cfg.eval_batch_size, precision)
    labels = data.labels
    matrix = confusion(labels, logits.argmax(1))
    counts = matrix.sum(1)
    correct = matrix.diagonal()
    return {
        "dataset": cfg.dataset.value,
        "split": split or cfg.eval_split,
        "images": n,
        "precision": precision.mode.value,
        "accuracy": correct.sum().item() / n,
        "loss": F.cross_entropy(logits, labels, reduction="sum").item() / n,
        # A class absent from the split has no accuracy (null), not 0.
        "per_class_accuracy": [c / k if k else None for c, k in zip(correct.tolist(), counts.tolist(), strict=True)],
        "class_counts": counts.tolist(),
        "confusion_matrix": matrix.tolist(),  # rows: true class, columns: predicted class
    }


def evaluate_args(
    run: Store, saved: dict[str, Any], step: int | None, *, device: torch.device, args: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    """`python -m dtrain.evaluate eval`'s call (the registry's evaluator interface): its --data-dir and --split."""
    return evaluate(run, saved, step, device=device, data_dir=args.data_dir, split=args.split, log=log)
