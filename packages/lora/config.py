"""The LoRA workload's one typed config. No torch here: the CLI reads it to know the keys."""

from __future__ import annotations

import dataclasses
import enum

from dtrain.common.config import RunConfig, opt
from dtrain.lora.choices import AdapterDtype, Attention, Optimizer, Sharding, Switch


def required(help: str) -> str:  # noqa: A002 - mirrors opt()
    return dataclasses.field(metadata={"help": help})  # type: ignore[return-value]


DEFAULT_MESSAGES = "messages"
# --seq-len's defaults: chat examples run to a few thousand tokens (TRL's SFTConfig cuts at 1,024,
# axolotl's and Unsloth's examples at 2,048); plain text is cut into blocks, where 256 keeps a small
# corpus at two blocks or more. docs/decisions.md, "chat".
SFT_SEQ_LEN, TEXT_SEQ_LEN = 2048, 256


class Quant(str, enum.Enum):
    NONE = "none"
    NF4 = "4bit"


class DataFormat(str, enum.Enum):
    """What --data holds; auto picks chat for a messages field, instruction for prompt and completion
    fields (see --prompt-field), else text."""

    AUTO = "auto"
    TEXT = "text"
    INSTRUCTION = "instruction"
    CHAT = "chat"


@dataclasses.dataclass(kw_only=True)
class LoraConfig:
    """LoRA fine-tuning of a causal LM (transformers + peft); the adapter lands in final/adapter."""

    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: str = required(
        "Hugging Face model id, a local model directory, or a preset: tiny-llama, tiny-gpt2, qwen2.5-0.5b-shape"
    )
    data: str = required(
        "text, JSONL, JSON array, Parquet or CSV file, a directory of them, gs:// URL, or a Hugging Face "
        "dataset name (online); docs/fine-tuning.md"
    )
    data_subset: str = opt(
        "", "a Hugging Face dataset's subset (config), e.g. gsm8k's main; --eval-data as a split name reads it too"
    )
    data_split: str = opt(
        "", "a Hugging Face dataset's split to train on, e.g. ultrachat_200k's train_sft (default: train)"
    )
    format: DataFormat = opt(DataFormat.AUTO, "auto, text (continued pretraining), instruction or chat")
    text_field: str = opt("text", "the field holding the text in records (format text)")
    prompt_field: str = opt("", "instruction data: the prompt's field (default: instruction, prompt or question)")
    input_field: str = opt("", "instruction data: optional field appended to the prompt (default: input, context)")
    completion_field: str = opt(
        "", "instruction data: the completion's field (default: output, completion, response or answer)"
    )
    messages_field: str = opt(
        DEFAULT_MESSAGES,
        "chat data: the field holding the list of {role, content} messages (default: messages, else ShareGPT's "
        "conversations of {from, value})",
    )
    train_on_all: bool = opt(
        False, "instruction/chat data: loss on every token, not only the completion/assistant turns"
    )
    packing: bool = opt(True, "instruction/chat data: pack examples into rows, each attending only to itself")
    eval_data: str = opt(
        "",
        "held-out data (a file, directory or dataset like --data, or a split name of --data's dataset); "
        "default: --eval-fraction of --data",
    )
    show_example: bool = opt(False, "print the first example as trained (trained tokens marked) and exit")
    seq_len: int = opt(0, f"tokens per row (0: {SFT_SEQ_LEN} for instruction/chat data, {TEXT_SEQ_LEN} for plain text)")
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
    sample_prompts: str = opt(
        "", "a file of prompts (one a line) to complete greedily after training, into the run's samples.jsonl"
    )
    samples: int = opt(
        0, "without --sample-prompts: complete the prompts of this many held-out examples after training (0: none)"
    )
    sample_tokens: int = opt(48, "most new tokens per sample completion")
    activation_checkpointing: Switch = opt(
        Switch.AUTO,
        "recompute each decoder layer's activations in the backward (auto: on when the memory plan needs it)",
    )
    quant: Quant = opt(Quant.NONE, "base weights: none, or 4bit (QLoRA: NF4 with double quantization, CUDA GPUs only)")
    sharding: Sharding = opt(
        Sharding.AUTO,
        "ddp (a full base model per GPU), fsdp (FSDP2: shard it, 4-bit too), auto (fsdp when the plan says it must)",
    )
    # -- memory options --
    adapter_dtype: AdapterDtype = opt(AdapterDtype.FP32, "LoRA weights, gradients and AdamW moments: fp32 or bf16")
    optimizer: Optimizer = opt(
        Optimizer.ADAMW, "adamw (fp32 moments), adamw-8bit or paged-adamw-8bit (bitsandbytes, 8-bit moments)"
    )
    attention: Attention = opt(
        Attention.AUTO,
        "packed rows: auto (flash_attention_2 where flash_attn is installed on a bf16 GPU, else sdpa_packed), "
        "flash_attention_2 (varlen), sdpa_packed (SDPA per document), or sdpa (a dense block-diagonal mask)",
    )
    # -- end of memory options --

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model: must not be empty")
        if not self.data:
            raise ValueError("data: must not be empty")
        for name in ("batch_size", "grad_accum", "epochs", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.sample_tokens < 1:
            raise ValueError(f"sample_tokens: must be >= 1, got {self.sample_tokens}")
        for name in ("seq_len", "max_steps", "warmup_steps", "eval_every", "eval_batches", "samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")
        if not 0.0 < self.eval_fraction < 0.5:
            raise ValueError(f"eval_fraction: must be in (0, 0.5), got {self.eval_fraction}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}")
        self.format = DataFormat(self.format)
        self.activation_checkpointing = Switch(self.activation_checkpointing)
        self.quant, self.sharding = Quant(self.quant), Sharding(self.sharding)
        self.adapter_dtype, self.optimizer = AdapterDtype(self.adapter_dtype), Optimizer(self.optimizer)
        self.attention = Attention(self.attention)

    def settle_seq_len(self, fmt: DataFormat) -> None:
        """--seq-len 0 becomes the default for the data's format, once the format is known (read_data)."""
        if not self.seq_len:
            self.seq_len = TEXT_SEQ_LEN if fmt == DataFormat.TEXT else SFT_SEQ_LEN

    def model_config(self) -> dict:
        """What fixes the trained weights' shapes and meaning: a checkpoint with other values is refused."""
        return {
            "model": self.model,
            "lora_r": self.lora_r,
            "lora_alpha": self.lora_alpha,
            "target_modules": sorted(self.target_modules),
        }
