"""Base models and tokenizers for LoRA: a Hugging Face id or a local directory, or a built-in preset
made from a transformers config with random weights (offline; the tests and benchmarks use them).

Presets pair with a byte-level tokenizer: every UTF-8 byte is a token, plus end-of-text and padding,
so they need no vocabulary file. `qwen2.5-0.5b-shape` has Qwen2.5-0.5B's published shapes (24
layers, hidden 896, 14 query / 2 key-value heads, MLP 4864, vocabulary 151,936, tied embeddings)
for throughput benchmarks; its weights are random.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any

import torch

from dtrain.common import env as envmod
from dtrain.common.dist import Dist
from dtrain.common.errors import UserError
from dtrain.lora.attention import PACKED_SDPA
from dtrain.lora.attention import register as register_packed_sdpa

# How long every rank waits for the first rank of each node to download a hub model: hours, not the
# collective timeout's minutes (a 7B model is about 15 GB; a slow link takes most of an hour for it).
MODEL_DOWNLOAD_TIMEOUT_S = 4 * 3600.0


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255; 256 ends a document, 257 pads."""

    vocab_size = 258
    eos_token_id = 256
    pad_token_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def save_pretrained(self, directory: str) -> None:  # nothing to save: the mapping is fixed
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "byte_tokenizer.txt").write_text("UTF-8 bytes 0-255; 256 = end of text; 257 = pad\n")


class HFTokenizer:
    """A transformers tokenizer, used in batches and without adding special tokens mid-document."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
        if self.eos_token_id is None:
            raise UserError(f"tokenizer {tok.name_or_path!r} has no end-of-text token to separate documents")
        self.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_token_id
        self.vocab_size = len(tok)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def save_pretrained(self, directory: str) -> None:
        self.tok.save_pretrained(directory)


@dataclasses.dataclass(frozen=True)
class Preset:
    family: str
    kwargs: dict[str, Any]
    targets: tuple[str, ...]


LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PRESETS = {
    # The CPU benchmark model: 4 layers, 256 wide, Llama-shaped, byte-level tokenizer.
    "tiny-llama": Preset(
        "llama",
        dict(
            vocab_size=ByteTokenizer.vocab_size,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        ),
        LLAMA_TARGETS,
    ),
    "tiny-gpt2": Preset(
        "gpt2",
        dict(vocab_size=ByteTokenizer.vocab_size, n_embd=256, n_layer=4, n_head=4, n_positions=4096),
        ("c_attn", "c_proj", "c_fc"),
    ),
    "qwen2.5-0.5b-shape": Preset(
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
        ),
        LLAMA_TARGETS,
    ),
}
# Default LoRA targets by model_type: attention and MLP projections.
DEFAULT_TARGETS = {
    "llama": LLAMA_TARGETS,
    "mistral": LLAMA_TARGETS,
    "qwen2": LLAMA_TARGETS,
    "qwen3": LLAMA_TARGETS,
    "gemma": LLAMA_TARGETS,
    "gemma2": LLAMA_TARGETS,
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "gpt_neox": ("query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"),
    "opt": ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
}


def hub_reachable() -> bool:
    """Whether the Hugging Face hub's host resolves (HF_ENDPOINT honoured); no request is sent."""
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False


def hf_token() -> str | None:
    """HF_TOKEN for gated or private models; passed to the hub client, never printed."""
    return os.environ.get("HF_TOKEN") or None


def hub_refusal(e: BaseException, what: str) -> str | None:
    """The one line for a Hub answer about access, not about the name: a gated repo (401/403 GatedRepo)
    or a rate limit (429), found anywhere in `e`'s chain (datasets and transformers wrap the hub
    client's errors, or restate them in their own words); None for anything else."""
    seen = 0
    while e is not None and seen < 16:
        status = getattr(getattr(e, "response", None), "status_code", None)
        text = str(e)
        if status == 429:
            return (
                f"{what}: the Hugging Face hub is rate-limiting these requests (429 Too Many Requests); wait a "
                "few minutes and retry, or set HF_TOKEN (signed-in requests have a higher limit)"
            )
        if type(e).__name__ == "GatedRepoError" or "is a gated dataset" in text or "access a gated repo" in text:
            held = " (HF_TOKEN is set, but its account has not been granted access yet)" if hf_token() else ""
            return (
                f"{what} is gated on the Hugging Face hub: accept its terms on its page with your account, then "
                f"set HF_TOKEN to a token of that account{held}"
            )
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def load_base(
    name: str,
    dtype: torch.dtype,
    seed: int,
    device: torch.device | None = None,
    d: Dist | None = None,
    quantization: Any = None,
    attention: str = "sdpa",
) -> tuple[torch.nn.Module, Any]:
    """The base causal LM (frozen later by peft) and its tokenizer, the model on `device` (where it was
    made, if None).

    A hub model is read from its files straight onto `device`, never whole in host memory first. With
    `d`, each node's first rank downloads it while the node's other ranks wait (`Dist.node_first`, with
    MODEL_DOWNLOAD_TIMEOUT_S), then they read the node's cache: one download per node, and a slow node
    does not trip the other nodes' collective timeout. A preset is built on the CPU from the seed, then
    moved: the CPU's generator gives the same weights on every machine, which every rank relies on, as
    DDP does not broadcast frozen weights (`dtrain.lora.train.wrap_ddp`); a GPU's would not, since its
    random kernels' launch shapes depend on the GPU model.

    `quantization` (a transformers BitsAndBytesConfig, dtrain.lora.quant) quantizes the linear layers
    as they are read; a preset is then written to a temporary directory first and read back from
    it, so it goes through the same quantizing loader as a hub model. `attention` is transformers'
    attn_implementation (attention_kernel chooses it), or dtrain's PACKED_SDPA (dtrain.lora.attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if attention == PACKED_SDPA:
        register_packed_sdpa()

    if name in PRESETS:
        p = PRESETS[name]
        config = AutoConfig.for_model(p.family, **p.kwargs)
        with torch.random.fork_rng(devices=[]):  # the CPU generator only: naming no GPU keeps torch off them
            torch.manual_seed(seed)  # the same base weights on every rank and every resume
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention, dtype=dtype)
        if quantization is not None:
            return _quantized_preset(model, dtype, device, quantization, attention), ByteTokenizer()
        return (model if device is None else model.to(device)), ByteTokenizer()
    source = "directory" if Path(name).is_dir() else "model id"
    # Without a route to the hub, don't let its client retry for most of a minute: use the cache only.
    local = source == "directory" or envmod.offline() or not hub_reachable()

    def load(cache_only: bool) -> tuple[torch.nn.Module, Any]:
        kw: dict[str, Any] = {"token": hf_token(), "local_files_only": cache_only}
        # transformers places the weights on the device as it reads them (through accelerate, a peft
        # dependency); without a device map it would build the whole model in host memory first.
        placement = {"device_map": {"": device}} if device is not None and device.type == "cuda" else {}
        if quantization is not None:  # bitsandbytes quantizes while placing: a device map always
            placement = {"device_map": {"": device or torch.device("cpu")}, "quantization_config": quantization}
        try:
            tok = AutoTokenizer.from_pretrained(name, **kw)
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype, attn_implementation=attention, **placement, **kw
            )
        except (OSError, ValueError) as e:
            refusal = hub_refusal(e, f"model {name!r}") if source == "model id" and not cache_only else None
            if refusal:
                raise UserError(refusal) from None
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if cache_only and source == "model id":
                first = "not in the local Hugging Face cache, and the hub is out of reach (offline)"
            raise UserError(
                f"cannot load {source} {name!r}: {first[:240].rstrip('.')}. Use a local model directory, a preset "
                f"({', '.join(PRESETS)}), or a hub id on a machine with internet (HF_TOKEN for gated models)"
            ) from None
        if device is not None and not placement:
            model = model.to(device)
        return model, HFTokenizer(tok)

    if local or d is None:
        return load(cache_only=local)
    return d.node_first("model download", lambda: load(cache_only=d.local_rank != 0), MODEL_DOWNLOAD_TIMEOUT_S)


def _quantized_preset(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device | None, quantization: Any, attention: str
) -> torch.nn.Module:
    """A preset's seeded weights read back through transformers' quantizing loader."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="dtrain-preset-") as tmp:
        # Written by hand, not save_pretrained: under a process group transformers 5 writes only on rank
        # 0, and every rank reads its own copy here. save_model drops tied duplicates, as the loader expects.
        from safetensors.torch import save_model

        model.config.save_pretrained(tmp)
        save_model(model, f"{tmp}/model.safetensors")
        loaded = AutoModelForCausalLM.from_pretrained(
            tmp,
            dtype=dtype,
            attn_implementation=attention,
            device_map={"": device or torch.device("cpu")},
            quantization_config=quantization,
        )
    # Not the temporary directory, which the adapter's config would otherwise name as its base.
    loaded.config._name_or_path = model.config._name_or_path
    loaded.name_or_path = model.name_or_path
    return loaded


def flash_attention_available(device: torch.device, dtype: torch.dtype) -> str:
    """Why flash-attention 2 cannot run here ("" when it can): it needs the flash_attn package, a
    CUDA GPU with bf16 (sm 8.0+: A100, L4, H100; a T4 has none), and half-precision weights."""
    import importlib.util

    if device.type != "cuda":
        return "flash-attention needs a CUDA GPU"
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash_attn package is not installed (pip install flash-attn)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"{torch.cuda.get_device_name(device)} is older than sm 8.0 (flash-attention 2 needs Ampere or later)"
    if dtype not in (torch.bfloat16, torch.float16):
        return "flash-attention needs bf16 or fp16 weights (this run's are fp32: --precision bf16)"
    return ""


def attention_kernel(choice: str, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """(the attn_implementation to load, why) for --attention `choice` on `device` with weights of
    `dtype`. flash_attention_2 runs packed rows as one padding-free varlen row, attending within each
    document only; sdpa_packed runs SDPA on each document (dtrain.lora.attention); sdpa runs them with
    a dense per-document mask. auto: flash-attention 2 where it can run, else sdpa_packed
    (docs/decisions.md, "Packed attention")."""
    if choice == "flash_attention_2":
        if why_not := flash_attention_available(device, dtype):
            raise UserError(f"--attention flash_attention_2: {why_not}; use --attention sdpa_packed (or auto)")
        return choice, "as flagged"
    if choice in ("sdpa", PACKED_SDPA):
        return choice, "as flagged"
    why_not = flash_attention_available(device, dtype)
    return (PACKED_SDPA, f"auto: {why_not}") if why_not else ("flash_attention_2", "auto: flash_attn installed")


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer in the backward instead of keeping its activations: transformers'
    own per-layer checkpointing, non-reentrant (torch.utils.checkpoint's recommended mode: it works
    with frozen inputs, so the embedding output needs no requires_grad hook, and composes with FSDP2).
    Only the layer inputs stay between forward and backward. Active in training mode only."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise UserError(
            f"{type(base).__name__} does not support activation checkpointing: use --activation-checkpointing off"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers 5's name; the other is its deprecated alias
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    base.config.use_cache = False


def default_targets(model: torch.nn.Module, name: str) -> list[str]:
    if name in PRESETS:
        return list(PRESETS[name].targets)
    model_type = getattr(model.config, "model_type", "")
    if model_type in DEFAULT_TARGETS:
        return list(DEFAULT_TARGETS[model_type])
    linear = sorted(linear_names(model) - {"lm_head"})
    if not linear:
        raise UserError(f"no linear layers to adapt in {name!r} ({model_type}); pass --target-modules")
    return linear


def linear_names(model: torch.nn.Module) -> set[str]:
    """Last name parts of the model's linear layers (what --target-modules matches)."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's projections

    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D))}


def apply_configured_lora(model: torch.nn.Module, cfg: Any) -> tuple[torch.nn.Module, list[str]]:
    """apply_lora with a run's LoRA settings (a dtrain.lora.config.LoraConfig): training and evaluation
    build the same adapter from the same config."""
    return apply_lora(
        model,
        cfg.model,
        r=cfg.lora_r,
        alpha=cfg.lora_alpha,
        dropout=cfg.lora_dropout,
        targets=cfg.target_modules,
        seed=cfg.run.seed,
    )


def apply_lora(
    model: torch.nn.Module, name: str, *, r: int, alpha: float, dropout: float, targets: list[str], seed: int
) -> tuple[torch.nn.Module, list[str]]:
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets = targets or default_targets(model, name)
    present = linear_names(model)
    unknown = [t for t in targets if t not in present]
    if unknown:
        raise UserError(
            f"--target-modules {', '.join(unknown)} match no layer of {name!r}; its linear layers are: "
            f"{', '.join(sorted(present))}"
        )
    cfg = PeftLoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        fan_in_fan_out=getattr(model.config, "model_type", "") == "gpt2",
    )
    with torch.random.fork_rng(devices=[]):  # peft makes LoRA's matrices on the CPU, then moves them
        torch.manual_seed(seed + 1)  # peft draws LoRA's A matrices from the global generator
        return get_peft_model(model, cfg), targets
