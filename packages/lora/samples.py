"""Greedy completions of a few prompts by the trained adapter, so a user reads what it learned.

At the end of `dtrain train lora` rank 0 completes the prompts of --sample-prompts (one a line), or,
without that file, the prompts of the first --samples held-out examples: for instruction and chat
data the tokens before an example's first trained token (its prompt, rendered as in training, the
chat template's generation prompt included); for plain text the first PROMPT_TOKENS tokens of a
held-out block. A prompt from the file is rendered as the run's data was: through the chat template
as one user turn (chat data, and instruction data when the tokenizer has a template), in Alpaca's
layout for Alpaca-style instruction data, as it is for plain text. The completions go to the run as
samples.jsonl, written whole (a resumed or re-finished run replaces it, never appends). `dtrain eval`
takes its default prompts the same way (dtrain.evaluate.lora).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from dtrain.lora import sft
from dtrain.lora.config import DataFormat
from dtrain.lora.model import ByteTokenizer

PROMPT_TOKENS = 32  # a plain-text prompt taken from a held-out block
SAMPLES_FILE = "samples.jsonl"


def eval_prompts(rows: torch.Tensor, n: int) -> list[list[int]]:
    """Prompt token ids of the first `n` held-out examples, in data order: blocks (plain text, N x L)
    give their first PROMPT_TOKENS tokens; SFT rows (N x 3 x L, packed or not) each example's tokens
    before its first trained one."""
    out: list[list[int]] = []
    for row in rows:
        if len(out) >= n:
            break
        if row.dim() == 1:
            out.append(row[:PROMPT_TOKENS].tolist())
            continue
        ids, labels, pos = row[0], row[1], row[2]
        starts = (pos == 0).nonzero().flatten().tolist()  # positions restart at each example
        ends = [*starts[1:], int((pos >= 0).sum())]
        for lo, hi in zip(starts, ends, strict=True):
            trained = (labels[lo:hi] != sft.IGNORE).nonzero()
            if len(trained) and int(trained[0]) > 0:
                out.append(ids[lo : lo + int(trained[0])].tolist())
    return out[:n]


def render_prompt(tokenizer: Any, fields: sft.Fields, text: str) -> list[int]:
    """`text` as the run's data renders a prompt, ending where the model's answer would start."""
    if fields.format == DataFormat.TEXT:
        return tokenizer.encode(text) if isinstance(tokenizer, ByteTokenizer) else tokenizer.encode_many([text])[0]
    tok = sft.chat_template_of(tokenizer)
    if tok is not None:
        messages = [{"role": "user", "content": text}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif fields.prompt == "instruction":
        rendered = sft.ALPACA.format(prompt=text)
    else:
        rendered = text
    ids, _ = sft._tokenize(tokenizer, [(rendered, False)])
    bos = sft.bos_expected(tokenizer)
    return [bos, *ids] if bos is not None and (not ids or ids[0] != bos) else ids


def decode(tokenizer: Any, ids: list[int]) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return tokenizer.tok.decode(ids, skip_special_tokens=True)


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """End of text, and the end-of-turn ids the model's generation config names (chat models')."""
    ids = {tokenizer.eos_token_id}
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(gen if isinstance(gen, list) else [gen])
    tok = sft.chat_template_of(tokenizer)
    if tok is not None:  # a template's end-of-turn token, where the vocabulary has one
        for name in ("<|end|>", "<|eot_id|>", "<|im_end|>", "<end_of_turn>"):
            i = tok.convert_tokens_to_ids(name)
            if isinstance(i, int) and i != tok.unk_token_id:
                ids.add(i)
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def complete(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, device: Any) -> list[list[int]]:
    """Greedy continuations (deterministic: no sampling), one prompt at a time (no padding)."""
    was_training = model.training
    model.eval()
    stops = stop_ids(model, tokenizer)
    out = []
    try:
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stops,
            )
            out.append(y[0, len(ids) :].tolist())
    finally:
        model.train(was_training)
    return out


def records(
    model: Any, tokenizer: Any, fields: sft.Fields, texts: list[str], eval_rows: torch.Tensor, *, n: int,
    max_new_tokens: int, device: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """One record per prompt: the prompt as given (or decoded from the eval set), the token ids the model
    saw decoded with their special tokens (the rendered prompt), and the completion."""
    if texts:
        given = [(t, render_prompt(tokenizer, fields, t)) for t in texts]
    else:
        given = [(None, ids) for ids in eval_prompts(eval_rows, n)]
    new = complete(model, tokenizer, [ids for _, ids in given], max_new_tokens, device)
    out = []
    for (text, ids), gen in zip(given, new, strict=True):
        shown = decode(tokenizer, ids) if isinstance(tokenizer, ByteTokenizer) else tokenizer.tok.decode(ids)
        out.append(
            {
                "prompt": text if text is not None else decode(tokenizer, ids),
                "rendered": shown,
                "completion": decode(tokenizer, gen),
                "tokens": len(gen),
                "source": "--sample-prompts" if text is not None else "eval set",
            }
        )
    return out


def to_jsonl(recs: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs).encode()


def read_prompt_file(spec: str) -> list[str]:
    """--sample-prompts: the non-empty lines of a local file or a gs:// object; read before the model
    loads, so a wrong path stops the run at once."""
    if not spec:
        return []
    from pathlib import Path

    from dtrain.common.errors import UserError
    from dtrain.common.storage import is_remote, open_store

    try:
        if is_remote(spec):
            bucket_dir, _, name = spec.rpartition("/")
            data = open_store(bucket_dir).read_bytes(name)
        else:
            data = Path(spec).expanduser().read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise UserError(f"--sample-prompts {spec}: no such file") from None
    prompts = [line for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]
    if not prompts:
        raise UserError(f"--sample-prompts {spec}: the file has no prompts (one a line)")
    return prompts


def write(ctx: Any, model: Any, tokenizer: Any, fields: sft.Fields, texts: list[str], eval_rows: torch.Tensor) -> None:
    """Rank 0, after training: the completions into the run's samples.jsonl (replacing any earlier one)."""
    cfg = ctx.cfg
    if not texts and not cfg.samples:
        return
    recs = records(
        model, tokenizer, fields, texts, eval_rows, n=cfg.samples, max_new_tokens=cfg.sample_tokens, device=ctx.d.device
    )
    ctx.run.write_bytes(SAMPLES_FILE, to_jsonl(recs))
    if recs:
        first = recs[0]
        ctx.report.info(
            f"samples: {len(recs)} greedy completion(s) in {ctx.run.join(SAMPLES_FILE)}; first: "
            f"{first['prompt'][-60:]!r} -> {first['completion'][:80]!r}"
        )
