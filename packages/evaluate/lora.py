"""LoRA evaluation: held-out loss and perplexity of a run's adapter, and a few sampled continuations.

Without --data, on the run's own held-out set, built as the run built it (its --eval-data or the
seeded share of its --data, the same block length, format, field mapping and masking), so the figure
equals the run's logged one. With --data FILE, in the run's data format read from its config.json:
plain text as before (the held-out share of that text); instruction and chat data whole, every record
an example, the loss over its trained tokens only (completions or assistant turns, or every token for
a --train-on-all run). Prompts are rendered as the run's data renders them (the chat template for
chat runs); without prompts, those of a few held-out examples are continued (dtrain.lora.samples).

The loss is computed by the workload's own evaluation function (dtrain.lora.train.evaluate) on one
process: the sum of each block's mean token loss (plain text) or of every trained token's loss (SFT),
so the grouping into batches and ranks does not change the figure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dtrain.common.errors import UserError
from dtrain.common.precision import PrecisionPolicy, resolve_precision
from dtrain.common.storage import Store
from dtrain.evaluate.loading import checkpoint_weights, read_final, workload_config
from dtrain.lora import samples
from dtrain.lora.config import LoraConfig
from dtrain.lora.model import ByteTokenizer

DEFAULT_SAMPLES = 3  # held-out examples whose prompts are continued when no prompt is given
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
    cfg: LoraConfig | None = None  # what make_blocks reads
    report: Any = None


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
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str] | Sequence[tuple[str, list[int]]],
    *,
    max_new_tokens: int,
    seed: int,
    device: torch.device,
) -> list[dict[str, Any]]:
    """One sampled continuation per prompt (temperature TEMPERATURE, top-k TOP_K), seeded per prompt.
    A prompt is text (encoded as plain text) or (text shown, token ids rendered as the run's data)."""
    out = []
    for i, prompt in enumerate(prompts):
        shown, ids = prompt if isinstance(prompt, tuple) else (prompt, encode(tokenizer, prompt))
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
            eos_token_id=samples.stop_ids(model, tokenizer),
        )
        new = y[0, len(ids) :].tolist()
        out.append({"prompt": shown, "continuation": decode(tokenizer, new), "tokens": len(new)})
    return out


@dataclasses.dataclass
class _Report:
    """The slice of a Reporter that dtrain.lora.train.make_blocks writes to: its lines go to `log`."""

    log: Callable[[str], None]

    def info(self, message: str) -> None:
        self.log(message)


def held_out(cfg: LoraConfig, data: str, model: Any, tokenizer: Any, device: torch.device, log: Callable[[str], None]):
    """(rows to evaluate, data fields, where they came from). Without `data`: the run's own held-out
    set, built as the run built it (its --eval-data, or the seeded share of its --data), in its format.
    With `data`: plain text is read as the run's --data was and its held-out share taken (as before);
    instruction and chat data, in the run's field mapping and masking (config.json), is held out whole:
    every record of the file is an example, one to a row, its loss on the trained tokens only."""
    from dtrain.lora import sft
    from dtrain.lora.config import DataFormat
    from dtrain.lora.data import load_blocks, read_rows
    from dtrain.lora.train import make_blocks, read_data

    if not data:
        ctx = _EvalContext(_OneProcess(device), None, cfg=cfg, report=_Report(log))  # type: ignore[arg-type]
        source = read_data(cfg)
        return make_blocks(ctx, source, model, tokenizer).eval, source.fields, cfg.eval_data or cfg.data
    rows = read_rows(data, cfg.text_field)
    fields = sft.resolve_fields(rows, cfg) if rows else sft.Fields(DataFormat.TEXT)
    cfg.settle_seq_len(fields.format)  # a run's own config has it settled; this settles a 0 the same way
    if fields.format == DataFormat.TEXT:
        blocks = load_blocks(data, cfg.text_field, tokenizer, cfg.seq_len, cfg.eval_fraction, cfg.run.seed).eval
        return blocks, fields, data
    enc = sft.encode(tokenizer, rows, fields, cfg.train_on_all, cfg.seq_len)
    if not enc.examples:
        raise UserError(
            f"--data {data}: no example has a token to evaluate after the run's masking (all {len(enc.dropped)} have "
            f"an empty completion or assistant turn, or lose it to the run's --seq-len {cfg.seq_len}); first: "
            f"{enc.dropped[0]}"
        )
    if notice := sft.dropped_notice(enc, cfg.seq_len):
        log(notice)
    return sft.pack_rows(enc.examples, cfg.seq_len, tokenizer.pad_token_id, packing=False), fields, data


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
    from dtrain.lora import sft
    from dtrain.lora.train import evaluate as workload_evaluate

    model, tokenizer, cfg = load_model(run, saved, step, device)
    precision = resolve_precision(cfg.run.precision, device)
    rows, fields, source = held_out(cfg, data, model, tokenizer, device, log)
    world = int(saved.get("world_size") or 1)
    micro = max(1, cfg.batch_size // (world * cfg.grad_accum))
    if cfg.eval_batches:  # the run's cap, counted in its own batches and ranks
        rows = rows[: cfg.eval_batches * micro * world]
    sft_rows = rows.dim() == 3
    if sft_rows:
        trained, real = sft.step_tokens(rows)
        log(
            f"evaluating {fields.format.value} data from {source}: {rows.shape[0]} rows, loss on {trained:,} "
            f"{'' if cfg.train_on_all else 'completion '}tokens of {real:,} ({device})"
        )
    else:
        log(f"evaluating {rows.shape[0]} held-out blocks of {cfg.seq_len} tokens from {source} ({device})")
    figures = workload_evaluate(_EvalContext(_OneProcess(device), precision), model, rows, micro, 0)
    if prompts:  # rendered as the run's data renders a prompt (the chat template for chat runs)
        given = [(p, samples.render_prompt(tokenizer, fields, p)) for p in prompts]
    else:  # the prompts of a few held-out examples (the starts of blocks for text), so there is always something
        given = [(decode(tokenizer, ids), ids) for ids in samples.eval_prompts(rows, DEFAULT_SAMPLES)]
    log(f"sampling {len(given)} continuation(s) of {max_new_tokens} tokens")
    out = sample(model, tokenizer, given, max_new_tokens=max_new_tokens, seed=cfg.run.seed, device=device)
    return {
        "model": cfg.model,
        "data": source,
        "format": fields.format.value,
        "blocks": int(rows.shape[0]),
        "tokens": sft.step_tokens(rows)[1] if sft_rows else int(rows.numel()),
        "trained_tokens": sft.step_tokens(rows)[0] if sft_rows else int(rows.numel()),
        "precision": precision.mode.value,
        "loss": figures["eval_loss"],
        "perplexity": figures["eval_perplexity"],
        "samples": out,
    }


def evaluate_args(
    run: Store, saved: dict[str, Any], step: int | None, *, device: torch.device, args: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    """`python -m dtrain.evaluate eval`'s call (the registry's evaluator interface): its --data, the prompts
    (--prompt, --prompts) and --max-new-tokens."""
    from dtrain.evaluate import records

    prompts = [*args.prompt, *records.read_prompts(args.prompts)]
    return evaluate(run, saved, step, device=device, data=args.data, prompts=prompts,
                    max_new_tokens=args.max_new_tokens or DEFAULT_NEW_TOKENS, log=log)  # fmt: skip
