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


# -- memory options (dtrain.lora.train's build_model/make_optimizer, dtrain.lora.plan) --


class AdapterDtype(str, enum.Enum):
    """The LoRA weights' dtype: fp32 (peft's default, their own master copy) or bf16 (TRL's choice
    for QLoRA; half the adapter, gradient and AdamW bytes, docs/decisions.md has its loss curve)."""

    FP32 = "fp32"
    BF16 = "bf16"


class Optimizer(str, enum.Enum):
    """AdamW with fp32 moments (torch), or bitsandbytes' 8-bit moments, paged or not."""

    ADAMW = "adamw"
    ADAMW_8BIT = "adamw-8bit"
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"


class Attention(str, enum.Enum):
    """The attention kernel for packed rows: flash_attention_2 (flash-attention's varlen call), or
    sdpa_packed (SDPA on each document, dtrain.lora.attention), both skipping the masked blocks; sdpa
    is transformers' stock SDPA over a dense block-diagonal mask. auto picks flash-attention 2 on a
    CUDA GPU with bf16 where the flash_attn package is installed, else sdpa_packed
    (docs/fine-tuning.md, "Packed rows"; docs/decisions.md, "Packed attention")."""

    AUTO = "auto"
    SDPA = "sdpa"
    SDPA_PACKED = "sdpa_packed"
    FLASH = "flash_attention_2"
