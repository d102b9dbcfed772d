"""Choices of LoRA settings that `dtrain plan` offers too, apart from the settings: the CLI builds its
options from them without importing the workload's config dataclasses (dtrain.lora.config)."""

from __future__ import annotations

import enum


class Switch(str, enum.Enum):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Sharding(str, enum.Enum):
    AUTO = "auto"
    DDP = "ddp"
    FSDP = "fsdp"
