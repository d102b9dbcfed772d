"""The choices of the settings shared by every workload, apart from the settings themselves: the CLI builds
its options from them, and importing this costs nothing next to the dataclasses in dtrain.common.config."""

from __future__ import annotations

import enum


class Precision(str, enum.Enum):
    AUTO = "auto"
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"


class Backend(str, enum.Enum):
    AUTO = "auto"
    NCCL = "nccl"
    GLOO = "gloo"


class Tracker(str, enum.Enum):
    """An experiment tracker a built-in logs to (dtrain.common.trackers)."""

    MLFLOW = "mlflow"
    WANDB = "wandb"
