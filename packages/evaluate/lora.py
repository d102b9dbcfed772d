"""LoRA evaluation: held-out loss and perplexity of a run's adapter on the run's own held-out blocks
(the same data, split, seed and block length), and a few sampled continuations of prompts.

The loss is computed by the workload's own evaluation function (dtrain.lora.train.evaluate) on one
process, over the same blocks the run evaluated on: each block's mean token loss is summed, so the
grouping into batches and ranks does not change the figure, and it equals the run's logged one."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtrain.common.errors import UserError
from dtrain.common.precision import PrecisionPolicy, resolve_precision
from dtrain.common.storage import Store
from dtrain.evaluate.loading import checkpoint_weights, read_final, workload_config
from dtrain.lora.config import LoraConfig
from dtrain.lora.model import ByteTokenizer

DEFAULT_SAMPLES = 3
PROMPT_TOKENS = 32  # prompts taken from held-out blocks when no prompt is given
DEFAULT_NEW_TOKENS = 48
TEMPERATURE, TOP_K = 0.8, 50


@dataclasses.dataclass(frozen=True)
class _OneProcess:
    """The slice of a training Context that the workload's evaluate() reads: one process, no group."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    backend: None = None


@dataclasses.dataclass(frozen=True)
class _EvalContext:
    d: _OneProcess
    precision: PrecisionPolicy


def load_model(
    run: Store, saved: dict[str, Any], step: int | None, device: torch.device
) -> tuple[Any, Any, LoraConfig]:
    """The base model (rebuilt as the run built it) with the run's adapter: final (step None) or
    checkpoint `step`'s. Returns the model (eval mode, on `device`), the tokenizer and the config."""
    from peft import set_peft_model_state_dict

    from dtrain.lora.fused import fuse_model
    from dtrain.lora.model import apply_configured_lora, load_base
    from dtrain.lora.train import base_dtype

    cfg = workload_config(saved, LoraConfig)
    precision = resolve_precision(cfg.run.precision, device)
    if step is None:
        from safetensors.torch import load

        weights = load(read_final(run, "final/adapter/adapter_model.safetensors", "adapter"))
    else:
        weights = checkpoint_weights(run, step)
    model, tokenizer = load_base(cfg.model, base_dtype(precision.mode, device), seed=cfg.run.seed)
    model, _targets = apply_configured_lora(model, cfg)
    result = set_peft_model_state_dict(model, weights)
    unused = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unused:  # peft loads what matches and says nothing: an adapter that fits nothing would evaluate the base
        raise UserError(f"the run's adapter does not fit the model it names ({cfg.model}): {', '.join(unused[:3])}")
    model.to(device).eval()
    fuse_model(model)  # the arithmetic the run evaluated with (exact regroupings of the stock path)
    return model, tokenizer, cfg


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return tokenizer.tok.decode(list(ids), skip_special_tokens=True)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text) if isinstance(tokenizer, ByteTokenizer) else tokenizer.encode_many([text])[0]


@torch.no_grad()
def sample(
    model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int, seed: int, device: torch.device
) -> list[dict[str, str]]:
    """One sampled continuation per prompt (temperature TEMPERATURE, top-k TOP_K), seeded per prompt."""
    out = []
    for i, prompt in enumerate(prompts):
        ids = encode(tokenizer, prompt)
        if not ids:
            continue
        x = torch.tensor([ids], device=device)
        torch.manual_seed(seed + i)
        y = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=TOP_K,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        new = y[0, len(ids) :].tolist()
        out.append({"prompt": prompt, "continuation": decode(tokenizer, new), "tokens": len(new)})
    return out


def evaluate(
    run: Store,
    saved: dict[str, Any],
    step: int | None,
    *,
    device: torch.device,
    data: str = "",
    prompts: Sequence[str] = (),
    max_new_tokens: int = DEFAULT_NEW_TOKENS,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    from dtrain.lora.data import load_blocks
    from dtrain.lora.train import evaluate as workload_evaluate

    model, tokenizer, cfg = load_model(run, saved, step, device)
    precision = resolve_precision(cfg.run.precision, device)
    source = data or cfg.data
    blocks = load_blocks(source, cfg.text_field, tokenizer, cfg.seq_len, cfg.eval_fraction, cfg.run.seed).eval
    world = int(saved.get("world_size") or 1)
    micro = max(1, cfg.batch_size // (world * cfg.grad_accum))
    if cfg.eval_batches:  # the run's cap, counted in its own batches and ranks
        blocks = blocks[: cfg.eval_batches * micro * world]
    log(f"evaluating {blocks.shape[0]} held-out blocks of {cfg.seq_len} tokens from {source} ({device})")
    figures = workload_evaluate(_EvalContext(_OneProcess(device), precision), model, blocks, micro, 0)
    if not prompts:  # the starts of a few held-out blocks, so there is always something to read
        prompts = [decode(tokenizer, b[:PROMPT_TOKENS].tolist()) for b in blocks[:DEFAULT_SAMPLES]]
    log(f"sampling {len(prompts)} continuation(s) of {max_new_tokens} tokens")
    samples = sample(model, tokenizer, prompts, max_new_tokens=max_new_tokens, seed=cfg.run.seed, device=device)
    return {
        "model": cfg.model,
        "data": source,
        "blocks": int(blocks.shape[0]),
        "tokens": int(blocks.numel()),
        "precision": precision.mode.value,
        "loss": figures["eval_loss"],
        "perplexity": figures["eval_perplexity"],
        "samples": samples,
    }
