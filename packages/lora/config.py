"""The LoRA workload's one typed config. No torch here: the CLI reads it to know the keys."""

from __future__ import annotations

import dataclasses

from dtrain.common.config import RunConfig, opt


def required(help: str) -> str:  # noqa: A002 - mirrors opt()
    return dataclasses.field(metadata={"help": help})  # type: ignore[return-value]


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """LoRA fine-tuning of a causal LM (transformers + peft); the adapter lands in final/adapter."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: str = required(
        "Hugging Face model id, a local model directory, or a preset: tiny-llama, tiny-gpt2, qwen2.5-0.5b-shape"
    )
    data: str = required("text/JSONL file, directory of them, gs:// URL, or a Hugging Face dataset name (online)")
    text_field: str = opt("text", "the field holding the text in JSONL records")
    seq_len: int = opt(256, "tokens per packed block")
    batch_size: int = opt(8, "blocks per optimizer step across all ranks (global), before accumulation")
    grad_accum: int = opt(1, "micro-batches accumulated per optimizer step")
    max_steps: int = opt(0, "optimizer steps (0: --epochs passes over the data)")
    epochs: int = opt(1, "passes over the training blocks when --max-steps is 0")
    lr: float = opt(2e-4, "peak learning rate (AdamW; linear warmup, then cosine to 10%)")
    warmup_steps: int = opt(0, "linear warmup steps (0: 3% of the run)")
    weight_decay: float = opt(0.0, "AdamW weight decay on the LoRA weights")
    max_grad_norm: float = opt(1.0, "clip the gradient norm to this (0: no clipping)")
    lora_r: int = opt(8, "LoRA rank")
    lora_alpha: float = opt(16.0, "LoRA scaling numerator (scale = alpha / r)")
    lora_dropout: float = opt(0.0, "dropout on the LoRA input")
    target_modules: list[str] = opt(
        [], "module names to adapt (default: the architecture's attention and MLP projections)"
    )
    eval_fraction: float = opt(0.05, "share of the packed blocks held out for evaluation")
    eval_every: int = opt(0, "evaluate perplexity every N optimizer steps (0: only at the end)")
    eval_batches: int = opt(0, "cap on evaluation batches (0: the whole held-out split)")
    merge: bool = opt(False, "also write the base model with the adapter merged in, under final/merged")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must not be empty")
        if not self.data:
            raise ValueError("data: must not be empty")
        for name in ("seq_len", "batch_size", "grad_accum", "epochs", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "warmup_steps", "eval_every", "eval_batches"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction: must be in (0, 0.5), got {self.eval_fraction}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}")

    def model_config(self) -> dict:
        """What fixes the trained weights' shapes and meaning: a checkpoint with other values is refused."""
        return {
            "model": self.model,
            "lora_r": self.lora_r,
            "lora_alpha": self.lora_alpha,
            "target_modules": sorted(self.target_modules),
        }
