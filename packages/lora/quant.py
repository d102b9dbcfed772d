"""QLoRA: the frozen base model's linear layers in 4-bit NF4 (bitsandbytes), the rest in the compute
dtype, the LoRA weights in fp32 (or bf16 with --adapter-dtype bf16).

NF4 with double quantization (the QLoRA paper's recipe: Dettmers et al., 2023) stores a weight in
about 4.13 bits: 4 for the value, 8 per 64-value block for its absmax scale, and those scales
quantized again to 8 bits per 256 blocks. Each layer dequantizes its weight to the compute dtype for
its product; the compute dtype is bf16 where the GPU has native bf16 (sm 8.0 and later: A100, L4,
H100) and fp16 before that (T4 sm 7.5, V100 sm 7.0), where bf16 would be emulated.

Only on CUDA GPUs: dtrain refuses `--quant 4bit` elsewhere in one line before anything is loaded
(`require_cuda`). bitsandbytes 0.50 has CPU kernels, over a second a step for a 64-wide model, and on
CPUs with AVX-512 bf16 its Linear4bit repacks the weights for inference at the first forward without
gradients (an evaluation) and from then on runs a kernel with no autograd formula: the gradient
through the frozen layers is lost (torch warns "an autograd kernel was not registered"); `prepare`
turns that repacking off. The tests run the QLoRA model path on those kernels
(tests/lora/test_memory_qlora.py), and whole runs, DDP and sharded, with DTRAIN_INTERNAL_QLORA_ON_CPU=1
(tests/lora/test_qlora_fsdp.py): a test switch only, read by `require_cuda` and nowhere else.

Sharded (FSDP2, dtrain.lora.sharding): the packed 4-bit weights stay in bitsandbytes' uint8 storage
and are sharded as they are (torch 2.13's fully_shard keeps a frozen parameter's dtype and
requires_grad, so integer storage needs no float disguise, bnb_4bit_quant_storage, which FSDP1 needed);
each Linear4bit keeps its quantization constants (the QuantState: absmax, the nested constants and the
code book, 0.127 bit a weight) whole on every rank, and bitsandbytes re-attaches them to the gathered
weight at each forward.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dtrain.common.errors import UserError

# The first compute capability with native bf16 (Ampere).
BF16_CAPABILITY = (8, 0)
# Tests only: let a QLoRA run go on the CPU's bitsandbytes kernels (slow, and not a product path).
CPU_TEST_ENV = "DTRAIN_INTERNAL_QLORA_ON_CPU"


def require_cuda(device: torch.device) -> None:
    """Refuse QLoRA where there is no CUDA GPU, saying what to do instead (unless CPU_TEST_ENV is 1)."""
    if device.type != "cuda" and os.environ.get(CPU_TEST_ENV) != "1":
        raise UserError(
            "--quant 4bit needs a CUDA GPU (bitsandbytes NF4 kernels); on this machine use --quant none, "
            "or run it on a GPU cluster (dtrain up with a T4, L4 or larger; dtrain plan says which fits)"
        )


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on sm 8.0+, fp16 on older GPUs; on the CPU (tests only) bf16, which its kernels take."""
    if device.type != "cuda":
        return torch.bfloat16
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= BF16_CAPABILITY else torch.float16


def nf4_config(compute: torch.dtype) -> Any:
    """transformers' BitsAndBytesConfig for NF4 with double quantization; one line if bitsandbytes is missing."""
    try:
        import bitsandbytes  # noqa: F401 - transformers imports it lazily and fails later, less clearly
    except ImportError:
        raise UserError(
            "--quant 4bit needs bitsandbytes: pip install 'dtrain[qlora]' (or pip install bitsandbytes); "
            "the GPU image has it"
        ) from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )


def prepare(model: torch.nn.Module) -> torch.nn.Module:
    """A k-bit model made ready for LoRA: every base weight frozen, and nothing cast. Embeddings,
    norms and the output layer stay in the compute dtype they were loaded in, so the residual stream
    runs in it (2 bytes a value), as in the other layers of every LoRA run; the norms still compute in
    fp32 inside (Llama's RMSNorm upcasts), and the loss takes fp32 logits (dtrain.lora.loss).

    peft's prepare_model_for_kbit_training would cast them to fp32 (Llama-3.1-8B's embedding and head:
    4.2 GB instead of 2.1, and every activation of the residual stream twice as large). The peers do
    not keep that: TRL's SFTTrainer does not call it, and casts the adapter to bf16 (trl
    trainer/sft_trainer.py, commit f2cd577, "When using QLoRA, the PEFT adapter weights are converted
    to bf16"); axolotl calls it, then casts the embeddings and output layer back to the compute dtype
    (src/axolotl/loaders/model.py, _configure_embedding_dtypes, "convert them back to fp16/bf16");
    torchtune's QLoRA recipe builds the whole model in bf16 (recipes/configs/llama3_1/
    8B_qlora_single_device.yaml: dtype bf16). Activation checkpointing is left to
    dtrain.lora.model.enable_activation_checkpointing, as for every run."""
    for m in linear4bit(model):  # no inference repacking on the CPU (module docstring); no effect on GPUs
        m.support_avx512bf16_for_cpu = False
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def linear4bit(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Linear4bit"]


def constant_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The 4-bit layers' quantization constants (absmax, nested constants, code books)."""
    out = []
    for m in linear4bit(model):
        state = getattr(m, "quant_state", None) or getattr(m.weight, "quant_state", None)
        for s in (state, getattr(state, "state2", None)):
            for t in (getattr(s, "absmax", None), getattr(s, "code", None), getattr(s, "offset", None)):
                if isinstance(t, torch.Tensor):
                    out.append(t)
    return out


def constant_bytes(model: torch.nn.Module) -> int:
    """Bytes of the 4-bit layers' quantization constants."""
    return sum(t.numel() * t.element_size() for t in constant_tensors(model))


def place_quant_states(model: torch.nn.Module, device: torch.device) -> None:
    """Move each 4-bit layer's quantization constants to `device`: FSDP2 moves parameters, and these
    live beside them (on the module and its weight, one object), not as parameters or buffers."""
    for m in linear4bit(model):
        state = getattr(m, "quant_state", None) or getattr(m.weight, "quant_state", None)
        if state is not None:
            state.to(device)  # in place


def is_quantized(model: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())
