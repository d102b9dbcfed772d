"""The MNIST workload's one typed config. No torch here: the CLI reads it to know the keys."""

from __future__ import annotations

import dataclasses
import enum
import re

from dtrain.common.config import RunConfig, opt


class Dataset(str, enum.Enum):
    MNIST = "mnist"
    FASHION_MNIST = "fashion-mnist"


SPLIT_RE = re.compile(r"^(train|test)(?:\[(-?\d*):(-?\d*)\])?$")


def parse_split(spec: str) -> tuple[str, slice]:
    """'train', 'test[:8000]', 'test[8000:]' -> (file split, slice of its images)."""
    m = SPLIT_RE.match(spec.strip())
    if not m:
        raise ValueError(f"{spec!r} is not a split; use train or test, optionally sliced like test[:8000]")
    lo, hi = m.group(2), m.group(3)
    return m.group(1), slice(int(lo) if lo else None, int(hi) if hi else None)


@dataclasses.dataclass(kw_only=True)
class MnistConfig:
    """Train a CNN on MNIST or Fashion-MNIST (IDX files), with DDP and resumable checkpoints."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    dataset: Dataset = opt(Dataset.MNIST, "which IDX dataset to train on")
    data_dir: str = opt(
        "", "directory holding the four IDX files (gzip or raw); when given, the only place looked (downloads go there)"
    )
    download: bool = opt(True, "download from the public mirrors (checksums verified) if no local copy is found")
    train_split: str = opt("train", "training images: train or test, optionally sliced, e.g. test[:8000]")
    eval_split: str = opt("test", "evaluation images, same syntax, e.g. test[8000:]")
    epochs: int = opt(8, "passes over the training split")
    batch_size: int = opt(256, "global batch size, split evenly across ranks")
    lr: float = opt(3e-3, "peak learning rate (AdamW; 5% linear warmup, then cosine to zero)")
    weight_decay: float = opt(5e-4, "AdamW weight decay")
    label_smoothing: float = opt(0.0, "cross-entropy label smoothing")
    augment: bool = opt(False, "random shifts of up to 2 pixels, done on whole batches on the device")
    width: int = opt(16, "channels of the first conv block (later blocks scale from it); part of the model config")
    eval_batch_size: int = opt(2000, "batch size for evaluation")

    def __post_init__(self) -> None:
        self.dataset = Dataset(self.dataset)
        for name in ("train_split", "eval_split"):
            try:
                parse_split(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        for name in ("epochs", "batch_size", "width", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing: must be in [0, 1), got {self.label_smoothing}")

    def model_config(self) -> dict:
        """What fixes the model's shapes: a checkpoint with different values cannot be loaded."""
        return {"arch": "mnist-cnn-v1", "width": self.width}
