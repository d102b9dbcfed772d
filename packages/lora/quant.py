"""QLoRA: the frozen base model's linear layers in 4-bit NF4 (bitsandbytes), the LoRA weights in fp32.

NF4 with double quantization (the QLoRA paper's recipe: Dettmers et al., 2023) stores a weight in
about 4.13 bits: 4 for the value, 8 per 64-value block for its absmax scale, and those scales
quantized again to 8 bits per 256 blocks. Each layer dequantizes its weight to the compute dtype for
its product; the compute dtype is bf16 where the GPU has native bf16 (sm 8.0 and later: A100, L4,
H100) and fp16 before that (T4 sm 7.5, V100 sm 7.0), where bf16 would be emulated.

Only on CUDA GPUs: dtrain refuses `--quant 4bit` elsewhere in one line before anything is loaded
(`require_cuda`). bitsandbytes 0.50 has CPU kernels, over a second a step for a 64-wide model, and on
CPUs with AVX-512 bf16 its Linear4bit repacks the weights for inference at the first forward without
gradients (an evaluation) and from then on runs a kernel with no autograd formula: the gradient
through the frozen layers is lost (torch warns "an autograd kernel was not registered"). The tests run
the QLoRA model path on those kernels with training before any evaluation (tests/lora/test_memory_qlora.py).
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.common.errors import UserError

# The first compute capability with native bf16 (Ampere).
BF16_CAPABILITY = (8, 0)


def require_cuda(device: torch.device) -> None:
    """Refuse QLoRA where there is no CUDA GPU, saying what to do instead."""
    if device.type != "cuda":
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
    """peft's preparation of a k-bit model for training: every base weight frozen, and the remaining
    non-quantized half-precision ones (embeddings, norms, the output layer) cast to fp32 for stable
    norms and logits. That cast costs memory (Llama-3.1-8B's two 128,256 x 4,096 matrices: 4.2 GB in
    fp32 against 2.1 in bf16) and is what peft, TRL and axolotl do by default. Activation
    checkpointing is left to dtrain.lora.model.enable_activation_checkpointing, as for every run."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def is_quantized(model: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())
