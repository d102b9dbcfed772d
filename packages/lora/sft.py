"""Supervised fine-tuning data: instruction records and chat conversations as token ids with labels
(-100 where no loss is taken), packed into rows whose documents do not see each other.

Formats (docs/fine-tuning.md):
- chat: a list of {role, content} messages, rendered by the tokenizer's own chat template;
- instruction: a prompt (plus an optional input) and a completion. With a chat template they become
  a user turn and an assistant turn; without one, Alpaca's layout (instruction/input/output records)
  or the prompt followed by the completion (prompt/completion records), then end-of-text.

Which tokens train. By default only the completion, or the assistant turns, each with the end of
turn the template writes after it (the model has to learn to stop). The assistant spans are found by
rendering the conversation incrementally: the prefix before turn i with the generation prompt, then
the prefix through turn i; the characters between the two renders are turn i's. The whole text is
tokenised once, and a token trains when its first character lies in such a span (fast tokenizers'
offset mapping), so tokens merge across span edges exactly as they would at inference. transformers'
`return_assistant_tokens_mask` would be simpler, but only templates with `{% generation %}` markers
support it, and the stock Llama-3, Qwen2.5 and Mistral templates have none (it returns all zeros).

Rows. Packing (the default) lays examples end to end into rows of seq_len tokens by best-fit
decreasing (the longest first, each into the row it fills best; TRL's packing does the same), so rows
are nearly full; position ids restart at 0 for each example.
transformers (5.x) turns restarting position ids into a per-document causal mask for the sdpa,
eager and flex kernels (masking_utils.find_packed_sequence_indices, used when no attention mask is
passed and there is no cache), and into flash-attention's varlen call for flash_attention_2/3 when
the batch is one row (modeling_flash_attention_utils._is_packed_sequence); `forward_rows` flattens
the micro-batch into one row for those. dtrain's sdpa_packed (dtrain.lora.attention) builds no mask
and runs SDPA on each document of each row. `packing_isolates` checks this on the loaded model before
training, and packing is turned off with a notice where it fails. With packing off, each example is
a row of its own, right-padded; a micro-batch is cut to its longest row.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import re
from typing import Any

import torch

from dtrain.common.errors import UserError
from dtrain.lora.config import DEFAULT_MESSAGES, DataFormat
from dtrain.lora.data import Row, read_rows
from dtrain.lora.loss import IGNORE, causal_lm_loss
from dtrain.lora.model import ByteTokenizer

PROMPT_FIELDS = ("instruction", "prompt", "question")
INPUT_FIELDS = ("input", "context")
COMPLETION_FIELDS = ("output", "completion", "response", "answer")
ALPACA_WITH_INPUT = "### Instruction:\n{prompt}\n\n### Input:\n{input}\n\n### Response:\n"
ALPACA = "### Instruction:\n{prompt}\n\n### Response:\n"
MARK_OPEN, MARK_CLOSE = "\u27e6", "\u27e7"  # ⟦ trained ⟧ in --show-example
DROPPED_NAMED = 5  # how many dropped examples the notice names
SHAREGPT_FIELD = "conversations"  # ShareGPT's records: {"conversations": [{"from": "human", "value": ...}]}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}  # fmt: skip
EMPTY_THINK = re.compile(r"\s*<think>\s*</think>\s*")
# forward_rows keeps a micro-batch's columns up to a multiple of this: the matrix shapes a run meets are
# then at most seq_len / LENGTH_BUCKET, not one per distinct length. oneDNN (the fused CPU linear,
# dtrain.lora.fused) keeps what it builds for each shape it sees, so lengths that vary step by step
# grew a worker without bound (docs/decisions.md, "A fair race against TRL").
LENGTH_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class Fields:
    """Resolved data layout: the format and, for instruction data, the field names."""

    format: DataFormat
    prompt: str = ""
    input: str = ""
    completion: str = ""
    messages: str = ""


@dataclasses.dataclass
class Example:
    ids: list[int]
    labels: list[int]
    where: str


@dataclasses.dataclass
class Encoded:
    examples: list[Example]
    dropped: list[str]  # where each example with no trained token came from
    truncated: int  # examples cut to seq_len
    total: int = 0  # examples made, before any was dropped
    longest: int = 0  # tokens in the longest example before cutting


def resolve_fields(rows: list[Row], cfg: Any) -> Fields:
    """The format of `rows` (cfg.format, or detected from the first record's fields) and its field names.
    Every record must have them; a missing one is refused naming the fields the record has."""
    where, first = rows[0]
    fmt = cfg.format
    messages = cfg.messages_field
    if messages not in first and messages == DEFAULT_MESSAGES and SHAREGPT_FIELD in first:
        messages = SHAREGPT_FIELD  # ShareGPT's layout, unless the user named a field
    if fmt == DataFormat.AUTO:
        if messages in first:
            fmt = DataFormat.CHAT
        elif (cfg.prompt_field or cfg.completion_field) or (
            _pick(first, "", PROMPT_FIELDS) and _pick(first, "", COMPLETION_FIELDS)
        ):  # a field the user named makes it instruction data, so a missing one is named as such
            fmt = DataFormat.INSTRUCTION
        else:
            fmt = DataFormat.TEXT
    if fmt == DataFormat.TEXT:
        return Fields(fmt)
    if fmt == DataFormat.CHAT:
        need = {"--messages-field": messages}
        fields = Fields(fmt, messages=messages)
    else:
        prompt = _pick(first, cfg.prompt_field, PROMPT_FIELDS) or cfg.prompt_field or PROMPT_FIELDS[0]
        completion = (
            _pick(first, cfg.completion_field, COMPLETION_FIELDS) or cfg.completion_field or COMPLETION_FIELDS[0]
        )
        need = {"--prompt-field": prompt, "--completion-field": completion}
        if cfg.input_field:
            need["--input-field"] = cfg.input_field
        fields = Fields(fmt, prompt=prompt, completion=completion, input=cfg.input_field or _input_field(first))
    for where, rec in rows:
        for flag, name in need.items():
            if name not in rec:
                raise UserError(
                    f"{where}: no field {name!r} for {fmt.value} data (the record has: {', '.join(rec) or 'none'}); "
                    f"pass {flag}"
                )
    return fields


def _pick(rec: dict[str, Any], given: str, defaults: tuple[str, ...]) -> str:
    if given:
        return given if given in rec else ""
    return next((f for f in defaults if f in rec), "")


def _input_field(rec: dict[str, Any]) -> str:
    return next((f for f in INPUT_FIELDS if f in rec), "")


def chat_template_of(tokenizer: Any) -> Any:
    """The transformers tokenizer behind `tokenizer` when it has a chat template, else None."""
    tok = getattr(tokenizer, "tok", None)
    return tok if tok is not None and getattr(tok, "chat_template", None) else None


def _text(where: str, rec: dict[str, Any], field: str) -> str:
    v = rec.get(field)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise UserError(f"{where}: field {field!r} holds a {type(v).__name__}, not text")
    return v


def _message(where: str, field: str, n: int, m: Any) -> dict[str, Any]:
    """One message as the template takes it: {role, content, ...} with every other key it carries
    (tool_calls, reasoning_content, name, tool_call_id ...) kept; ShareGPT's {from, value} mapped."""
    at = f"{where}: {field}[{n}]"
    if not isinstance(m, dict):
        raise UserError(
            f"{at} is a {type(m).__name__}, not a message ({{role, content}} or ShareGPT's {{from, value}})"
        )
    # Columnar readers (Parquet, datasets) give every message every key of any message, absent ones None.
    m = {k: v.tolist() if hasattr(v, "tolist") else v for k, v in m.items() if v is not None}
    if "role" not in m and "from" in m:
        who = m.pop("from")
        if who not in SHAREGPT_ROLES:
            raise UserError(
                f"{at}: ShareGPT speaker {who!r} is not one of {', '.join(SHAREGPT_ROLES)}; rename it in the data"
            )
        m = {"role": SHAREGPT_ROLES[who], "content": m.pop("value", None), **m}
        if m["content"] is None:
            del m["content"]
    if not isinstance(m.get("role"), str):
        raise UserError(f"{at} has no role (keys: {', '.join(m) or 'none'}); a message is {{role, content}}")
    content = m.get("content")
    if content is None and not m.get("tool_calls"):
        raise UserError(f"{at} ({m['role']}) has no content and no tool_calls")
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise UserError(
                    f"{at} has a content part of type {kind!r}: dtrain trains on text, so content is a string "
                    "or a list of {type: text, text} parts"
                )
    elif content is not None and not isinstance(content, str):
        raise UserError(f"{at}: content is a {type(content).__name__}, not text or a list of text parts")
    return m


def _messages(where: str, rec: dict[str, Any], field: str) -> list[dict[str, Any]]:
    msgs = rec.get(field)
    if hasattr(msgs, "tolist"):  # a numpy array from pandas-backed readers
        msgs = msgs.tolist()
    if not isinstance(msgs, list) or not msgs:
        got = "an empty list" if isinstance(msgs, list) else "nothing" if msgs is None else f"a {type(msgs).__name__}"
        raise UserError(
            f"{where}: field {field!r} must be a list of messages ({{role, content}} or ShareGPT's {{from, value}}), "
            f"got {got}; fix or drop the record"
        )
    return [_message(where, field, n, m) for n, m in enumerate(msgs)]


def _joined(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """List-valued content as one string, for templates that only concatenate strings."""
    return [
        {**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
        for m in messages
    ]


class _Renderer:
    """The template applied to one record's conversation; a template that raises (Gemma's "System role
    not supported", role alternation) becomes one line naming the record and the template's message."""

    def __init__(self, where: str, tok: Any) -> None:
        self.where, self.tok = where, tok

    def __call__(self, msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError, or TypeError etc. from template code
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:240]
            raise UserError(
                f"{self.where}: the model's chat template refuses this conversation: {first}; fix the record or drop it"
            ) from None


def _incremental(render: _Renderer, messages: list[dict[str, Any]], full: str) -> list[tuple[str, bool]] | None:
    """Segments of `full` by incremental rendering: the prefix before turn i with the generation
    prompt, then through turn i. None when a prefix is not a prefix of the whole (the template rewrites
    earlier turns as the conversation grows: Qwen3 drops earlier reasoning, Mistral v0.3 moves the
    system prompt to the last user turn)."""
    segments, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True) if i else "", render(messages[: i + 1], False)
        if not (through.startswith(before) and full.startswith(through) and len(before) >= done):
            return None
        segments += [(full[done : len(before)], False), (full[len(before) : len(through)], True)]
        done = len(through)
    segments.append((full[done:], False))
    return segments


def _turn_example(render: _Renderer, messages: list[dict[str, Any]], i: int) -> list[tuple[str, bool]]:
    """Assistant turn i as the template renders it when that turn is being generated: the prompt is the
    conversation before it with the generation prompt, the target what the template writes for the
    turn when it is the last one."""
    ctx = render(messages[:i], True) if i else ""
    through = render(messages[: i + 1], False)
    if through.startswith(ctx):
        return [(ctx, False), (through[len(ctx) :], True)]
    # The prompt is not a prefix of the turn's own render (Mistral v0.3 writes the system prompt into
    # the last user turn, which is not the last message once the reply follows): the turn's text is
    # what the template writes for it after a lone user message, and must end the turn's render.
    probe = [{"role": "user", "content": "?"}]
    head, alone = render(probe, True), render([*probe, messages[i]], False)
    turn = alone[len(head) :] if alone.startswith(head) else ""
    if not turn or not through.endswith(turn):
        raise UserError(
            f"{render.where}: the chat template renders assistant turn {i} differently in every context tried, "
            "so its tokens cannot be found; pass --train-on-all"
        )
    return [(ctx, False), (turn, True)]


def _no_empty_think(segments: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    """An empty reasoning block at the start of a trained turn is prompt, not target: Qwen3's template
    writes `<think>\n\n</think>\n\n` for a turn without reasoning, and the same block is what its
    generation prompt writes with enable_thinking=False."""
    out: list[tuple[str, bool]] = []
    for text, trained in segments:
        empty = EMPTY_THINK.match(text) if trained else None
        if empty:
            out.append((text[: empty.end()], False))
            text = text[empty.end() :]
        out.append((text, trained))
    return out


def _chat_examples(
    where: str, tok: Any, messages: list[dict[str, Any]], whole: bool = False
) -> list[list[tuple[str, bool]]]:
    """The conversation as examples of (text, trained) segments, each assistant turn trained with the
    end of turn its template writes. One example when the template renders the conversation as a
    growing prefix; otherwise one example per assistant turn, each in the context the template renders
    when that turn is generated. --train-on-all: every token of the whole conversation (as rendered
    for its last assistant turn, where the template rewrites history)."""
    render = _Renderer(where, tok)
    if any(isinstance(m.get("content"), list) for m in messages):
        try:  # list content reaches a template that reads it; one that only concatenates strings gets one
            full = render(messages, False)
            messages = messages if "{'type'" not in full else _joined(messages)
        except UserError:
            messages = _joined(messages)
    full = render(messages, False)
    segments = _incremental(render, messages, full)
    if segments is not None:
        return [[(full, True)]] if whole else [_no_empty_think(segments)]
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if whole:
        last = _turn_example(render, messages, turns[-1]) if turns else [(full, True)]
        return [[("".join(t for t, _ in last), True)]]
    return [_no_empty_think(_turn_example(render, messages, i)) for i in turns]


def _instruction_segments(
    rec: dict[str, Any], where: str, f: Fields, tok: Any, whole: bool = False
) -> tuple[list[list[tuple[str, bool]]], bool]:
    """(examples' segments, whether end-of-text follows): through the chat template where there is one."""
    prompt, extra, completion = (
        _text(where, rec, f.prompt),
        _text(where, rec, f.input) if f.input else "",
        _text(where, rec, f.completion),
    )
    if tok is not None:
        user = f"{prompt}\n\n{extra}" if extra else prompt
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": completion}]
        return _chat_examples(where, tok, turns, whole), False
    if f.prompt == "instruction":  # Alpaca's records: its prompt layout
        prompt = (ALPACA_WITH_INPUT if extra else ALPACA).format(prompt=prompt, input=extra)
    else:
        prompt += extra and f"\n\n{extra}"
    return [[(prompt, False), (completion, True)]], True


def _tokenize(tokenizer: Any, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Token ids and whether each trains. A fast tokenizer sees the whole text once (offsets map
    tokens to segments); others, and the byte tokenizer, encode segment by segment."""
    tok = getattr(tokenizer, "tok", None)
    if tok is not None and getattr(tok, "is_fast", False):
        text = "".join(s for s, _ in segments)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        trained_chars, pos = [], 0
        for s, t in segments:
            trained_chars.append((pos, pos + len(s), t))
            pos += len(s)
        flags = []
        for start, end in enc["offset_mapping"]:
            flags.append(any(t and lo <= start < hi for lo, hi, t in trained_chars) if end > start else False)
        return list(enc["input_ids"]), flags
    ids: list[int] = []
    flags: list[bool] = []
    for s, t in segments:
        if not s:
            continue
        part = tokenizer.encode(s) if isinstance(tokenizer, ByteTokenizer) else tokenizer.encode_many([s])[0]
        ids += part
        flags += [t] * len(part)
    return ids, flags


# A template token's embedding row was never trained when its largest entry is at most this (Unsloth's
# test, unsloth_zoo fix_untrained_tokens: Llama-3 base's <|start_header_id|>, <|eot_id|> ... are zero
# rows), or its norm is under this share of the median row's (rows left near zero, e.g. 1e-23 in bf16).
UNTRAINED_MAX = 1e-16
UNTRAINED_NORM_SHARE = 0.01
EMBEDDING_ROWS_AT_ONCE = 8192


def untrained_template_tokens(model: torch.nn.Module, tokenizer: Any) -> list[str]:
    """The special tokens the chat template writes whose input embedding rows were never trained: what
    a base model gives with its instruct sibling's template. LoRA cannot train those rows."""
    tok = chat_template_of(tokenizer)
    if tok is None:
        return []
    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    try:
        ids = tok(tok.apply_chat_template(probe, tokenize=False), add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - a template that refuses the probe is refused, with the record, later
        return []
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    w = model.get_input_embeddings().weight.detach()
    used = sorted({i for i in ids if i in special and i < w.shape[0]})
    if not used or w.device.type == "meta":  # not loaded on this rank: nothing to read
        return []
    # Row norms a slice at a time: an fp32 copy of Llama-3's whole embedding would be 2 GiB on the GPU.
    norms = torch.cat([part.float().norm(dim=-1) for part in w.split(EMBEDDING_ROWS_AT_ONCE)])
    rows = w[used].float()
    floor = UNTRAINED_NORM_SHARE * norms.median()
    bad = [i for i, row in zip(used, rows, strict=True) if row.max() <= UNTRAINED_MAX or row.norm() < floor]
    return tok.convert_ids_to_tokens(bad)


def refuse_untrained_template_tokens(model: torch.nn.Module, tokenizer: Any, name: str) -> None:
    if bad := untrained_template_tokens(model, tokenizer):
        raise UserError(
            f"{name}: the chat template's tokens {', '.join(bad)} have embedding rows that were never trained "
            "(a base model with an instruct template), and LoRA cannot train them: fine-tune the instruct model "
            "the template belongs to (e.g. ...-Instruct), or give the base model data without the template "
            "(--format text, each conversation written out as plain text)"
        )


def bos_expected(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer adds one to plain encodes (Llama-3 does, Qwen2.5 has none)."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None or tok.bos_token_id is None:
        return None
    ids = tok("a", add_special_tokens=True)["input_ids"]
    return tok.bos_token_id if ids and ids[0] == tok.bos_token_id else None


def encode(tokenizer: Any, rows: list[Row], fields: Fields, train_on_all: bool, seq_len: int) -> Encoded:
    """Instruction or chat rows as examples of at most seq_len tokens. A chat template that writes BOS
    itself is not given a second one; otherwise BOS goes first where the tokenizer expects it."""
    tok = chat_template_of(tokenizer)
    if fields.format == DataFormat.CHAT and tok is None:
        raise UserError(
            f"{rows[0][0]}: chat data (field {fields.messages!r}), but the model's tokenizer has no chat template "
            "to render it; use a model whose tokenizer has one (an -Instruct/-chat model), or instruction data"
        )
    bos = bos_expected(tokenizer)
    out: list[Example] = []
    dropped: list[str] = []
    truncated = 0
    total = longest = 0
    for where, rec in rows:
        if fields.format == DataFormat.CHAT:
            examples, eos = _chat_examples(where, tok, _messages(where, rec, fields.messages), train_on_all), False
        else:
            examples, eos = _instruction_segments(rec, where, fields, tok, train_on_all)
        for n, segments in enumerate(examples):
            at = where if len(examples) == 1 else f"{where} (assistant turn {n + 1} of {len(examples)})"
            ids, flags = _tokenize(tokenizer, segments)
            if bos is not None and (not ids or ids[0] != bos):
                ids, flags = [bos, *ids], [False, *flags]
            if eos:
                ids, flags = [*ids, tokenizer.eos_token_id], [*flags, True]
            total, longest = total + 1, max(longest, len(ids))
            if len(ids) > seq_len:
                ids, flags, truncated = ids[:seq_len], flags[:seq_len], truncated + 1
            labels = [i if (t or train_on_all) else IGNORE for i, t in zip(ids, flags, strict=True)]
            if labels:
                labels[0] = IGNORE  # nothing in the row predicts a document's first token
            if all(x == IGNORE for x in labels):
                dropped.append(at)
                continue
            out.append(Example(ids, labels, at))
    return Encoded(out, dropped, truncated, total, longest)


def _best_fit_decreasing(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Indices into `lengths` grouped into rows of at most seq_len tokens, by best-fit decreasing: the
    longest example first, each into the open row it leaves least room in (the oldest such row on a
    tie), a new row when none has room. The order is a pure function of the lengths (a stable sort),
    so every rank builds the same rows and a resumed run the same ones again. TRL's SFT packing does
    the same (trl.data_utils._pack_bfd, with a segment tree over free space; 1.16.0); here the free
    spaces are a sorted list of the distinct amounts (at most seq_len of them) with a queue of rows each."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    spaces: list[int] = []  # the distinct free space some open row has, ascending
    rows_with: dict[int, collections.deque[int]] = {}
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(spaces, n)
        if at < len(spaces):
            space = spaces[at]
            r = rows_with[space].popleft()
            if not rows_with[space]:
                del spaces[at], rows_with[space]
        else:
            space, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        left = space - n
        if left > 0:
            if left not in rows_with:
                bisect.insort(spaces, left)
                rows_with[left] = collections.deque()
            rows_with[left].append(r)
    return rows


def pack_rows(examples: list[Example], seq_len: int, pad_id: int, packing: bool) -> torch.Tensor:
    """N x 3 x seq_len int64: token ids, labels and position ids (restarting at each example; -1 on
    padding). Packing fills rows by best-fit decreasing (`_best_fit_decreasing`); without it each
    example has a row, in data order."""
    lengths = [len(ex.ids) for ex in examples]
    groups = _best_fit_decreasing(lengths, seq_len) if packing else [[i] for i in range(len(examples))]
    out = torch.full((len(groups), 3, seq_len), IGNORE, dtype=torch.long)
    out[:, 0] = pad_id
    out[:, 2] = -1
    for r, row in enumerate(groups):
        at = 0
        for i in row:
            ex, n = examples[i], lengths[i]
            out[r, 0, at : at + n] = torch.tensor(ex.ids)
            out[r, 1, at : at + n] = torch.tensor(ex.labels)
            out[r, 2, at : at + n] = torch.arange(n)
            at += n
    return out


def forward_rows(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over the trained tokens of SFT rows `x` (B x 3 x L), and their
        count. Columns that are padding in every row are cut, to the next multiple of LENGTH_BUCKET (the
    shapes a run meets stay few). Padding that remains (only ever at a row's
        end) continues the last document's positions: it has no loss and no real token attends to it
        (causal), and a row that holds one document then has no restart, so transformers takes the plain
        causal kernel (no mask) for a batch of unpacked rows."""
    real = x[:, 2] >= 0
    length = min(x.shape[-1], -(-(int(real.any(0).nonzero().max()) + 1) // LENGTH_BUCKET) * LENGTH_BUCKET)
    ids, labels, pos = x[:, 0, :length], x[:, 1, :length], x[:, 2, :length]
    pad = pos < 0
    n_real = (~pad).sum(-1, keepdim=True)
    last = pos.gather(-1, n_real - 1)
    pos = torch.where(pad, last + torch.arange(length, device=pos.device) - n_real + 1, pos)
    inner = getattr(model, "module", model)  # under DDP, the model it wraps has the config
    impl = str(getattr(getattr(inner, "config", None), "_attn_implementation", "") or "")
    if impl.startswith("flash"):  # varlen only for one row: the batch as one padding-free row
        ids, labels, pos = ids.reshape(1, -1), labels.reshape(1, -1), pos.reshape(1, -1)
    return causal_lm_loss(model, ids, labels, position_ids=pos)


@torch.no_grad()
def packing_isolates(model: torch.nn.Module, vocab: int, device: torch.device) -> tuple[bool, float]:
    """Whether this model, with its attention kernel, keeps packed documents apart: the logits of a
    document packed after another equal those of the document alone (within the dtype's rounding).
    Returns (ok, the largest difference)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, vocab, (7,), generator=g), torch.randint(0, vocab, (9,), generator=g)
    pos = torch.cat([torch.arange(7), torch.arange(9)])
    was_training = model.training
    model.eval()
    try:
        impl = str(getattr(model.config, "_attn_implementation", "") or "")
        ids = torch.cat([a, b])[None].to(device)
        packed = model(input_ids=ids, position_ids=pos[None].to(device), use_cache=False).logits[0, 7:].float()
        alone = model(input_ids=b[None].to(device), position_ids=torch.arange(9)[None].to(device), use_cache=False)
        alone_logits = alone.logits[0].float()
    finally:
        model.train(was_training)
    diff = (packed - alone_logits).abs().max().item()
    scale = alone_logits.abs().max().item() + 1e-6
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16) or impl.startswith("flash")
    return diff <= (3e-2 if half else 1e-4) * scale, diff


def mark_trained(tokenizer: Any, ex: Example) -> str:
    """The example's text with each trained span between ⟦ and ⟧."""
    out, span, trained = [], [], False

    def flush() -> None:
        if span:
            text = _decode(tokenizer, span)
            out.append(f"{MARK_OPEN}{text}{MARK_CLOSE}" if trained else text)
            span.clear()

    # labels[i] is the target at position i: a token is trained when its own label is kept.
    for tok_id, label in zip(ex.ids, ex.labels, strict=True):
        t = label != IGNORE
        if t != trained:
            flush()
            trained = t
        span.append(tok_id)
    flush()
    return "".join(out)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    if isinstance(tokenizer, ByteTokenizer):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace") + (
            "<eos>" if tokenizer.eos_token_id in ids else ""
        )
    return tokenizer.tok.decode(ids, skip_special_tokens=False)


def describe_example(tokenizer: Any, ex: Example) -> str:
    trained = sum(1 for x in ex.labels if x != IGNORE)
    return (
        f"first example ({ex.where}): {len(ex.ids)} tokens, {trained} trained, shown between "
        f"{MARK_OPEN} and {MARK_CLOSE}:\n{mark_trained(tokenizer, ex)}"
    )


@dataclasses.dataclass
class SftData:
    fields: Fields
    train: Encoded
    eval: Encoded | None  # None: hold out a share of train


def read_sft(cfg: Any, rows: list[Row], eval_rows: list[Row] | None, tokenizer: Any, fields: Fields) -> SftData:
    """Encode the training rows (and the --eval-data rows), refusing data where nothing trains."""
    train = encode(tokenizer, rows, fields, cfg.train_on_all, cfg.seq_len)
    held = encode(tokenizer, eval_rows, fields, cfg.train_on_all, cfg.seq_len) if eval_rows is not None else None
    for name, enc in (("--data", train), ("--eval-data", held)):
        if enc is not None and not enc.examples:
            raise UserError(
                f"{name} {cfg.data if name == '--data' else cfg.eval_data}: no example has a token to train on "
                f"after masking (all {len(enc.dropped)} have an empty completion or assistant turn, or lose it to "
                f"--seq-len {cfg.seq_len}); first: {enc.dropped[0]}"
            )
    return SftData(fields, train, held)


def dropped_notice(enc: Encoded, seq_len: int) -> str:
    """One line on the examples left out (none trained) and cut (longer than seq_len), or ''."""
    parts = []
    if enc.dropped:
        named = ", ".join(enc.dropped[:DROPPED_NAMED]) + (", ..." if len(enc.dropped) > DROPPED_NAMED else "")
        parts.append(
            f"dropped {len(enc.dropped)} example(s) with no token to train on after masking (empty completion "
            f"or assistant turn, or cut off by --seq-len): {named}"
        )
    if enc.truncated:
        parts.append(
            f"cut {enc.truncated} of {enc.total} example(s) ({enc.truncated / max(enc.total, 1):.0%}) longer than "
            f"--seq-len {seq_len} to {seq_len} tokens (the longest has {enc.longest:,}); raise --seq-len to keep "
            "them whole"
        )
    return "; ".join(parts)


def split_examples(examples: list[Example], eval_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Held-out examples (whole examples, never half of one), chosen from the seed."""
    n = len(examples)
    if n < 2:
        raise UserError(f"{n} usable example(s): too few to hold one out for evaluation; add data or pass --eval-data")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    held = sorted(order[:n_eval])
    keep = sorted(order[n_eval:])
    return [examples[i] for i in keep], [examples[i] for i in held]


def eval_rows_for(cfg: Any, text_field: str) -> list[Row] | None:
    """--eval-data's rows: a path or dataset name, or a split name of --data's Hugging Face dataset."""
    if not cfg.eval_data:
        return None
    from pathlib import Path

    from dtrain.common.storage import is_remote

    local = is_remote(cfg.data) or Path(cfg.data).exists()
    is_split = not local and "/" not in cfg.eval_data and not Path(cfg.eval_data).exists()
    if is_split:
        return read_rows(cfg.data, text_field, split=cfg.eval_data, subset=cfg.data_subset)
    return read_rows(cfg.eval_data, text_field)


def build_blocks(cfg: Any, data: SftData, pad_id: int, packing: bool) -> Any:
    """The run's rows: --eval-data's examples held out whole, else a seeded share of --data's."""
    from dtrain.lora.data import Blocks

    if data.eval is not None:
        train, held = data.train.examples, data.eval.examples
    else:
        train, held = split_examples(data.train.examples, cfg.eval_fraction, cfg.run.seed)
    rows = pack_rows(train, cfg.seq_len, pad_id, packing)
    return Blocks(
        train=rows,
        eval=pack_rows(held, cfg.seq_len, pad_id, packing),
        tokens=sum(len(e.ids) for e in train),
        documents=len(train),
    )


def step_tokens(rows: torch.Tensor) -> tuple[int, int]:
    """(trained tokens, real tokens) in SFT rows: the loss's denominator, and throughput's numerator."""
    return int((rows[:, 1, 1:] != IGNORE).sum()), int((rows[:, 2] >= 0).sum())


def load_tokenizer(name: str) -> Any:
    """The model's tokenizer alone (for --show-example): no weights are read."""
    from dtrain.common import env as envmod
    from dtrain.lora.model import PRESETS, HFTokenizer, hf_token, hub_reachable

    if name in PRESETS:
        return ByteTokenizer()
    from pathlib import Path

    from transformers import AutoTokenizer

    local = Path(name).is_dir() or envmod.offline() or not hub_reachable()
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(name, token=hf_token(), local_files_only=local))
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot load the tokenizer of {name!r}: {first[:240]}") from None


def show_example(cfg: Any) -> str:
    """--show-example: the first training example as it will be trained, with trained tokens marked."""
    from dtrain.lora.data import read_documents

    rows = read_rows(cfg.data, cfg.text_field, cfg.data_split, cfg.data_subset)
    fields = resolve_fields(rows, cfg) if rows else Fields(DataFormat.TEXT)
    cfg.settle_seq_len(fields.format)
    tokenizer = load_tokenizer(cfg.model)
    if fields.format == DataFormat.TEXT:
        text = read_documents(cfg.data, cfg.text_field, rows)[0]
        ids = (tokenizer.encode(text) if isinstance(tokenizer, ByteTokenizer) else tokenizer.encode_many([text])[0])[
            : cfg.seq_len
        ]
        ex = Example(ids, ids, rows[0][0])  # plain text: every token trains
        return "text data (continued pretraining): " + describe_example(tokenizer, ex)
    enc = read_sft(cfg, rows, None, tokenizer, fields)
    notice = dropped_notice(enc.train, cfg.seq_len)
    head = f"{fields.format.value} data, loss on {'every token' if cfg.train_on_all else 'completions only'}: "
    return head + describe_example(tokenizer, enc.train.examples[0]) + (f"\n{notice}" if notice else "")
