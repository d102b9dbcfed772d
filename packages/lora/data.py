"""Text for LoRA: read once, tokenised once, packed into fixed-length blocks with no padding (every
token is a real token), and split into training and held-out blocks deterministically from the seed.

`--data` is a text or JSONL file, a directory of them, a gs:// object or prefix, or (online) a
Hugging Face dataset name. Documents are joined with the tokenizer's end-of-text token and the
stream is cut into blocks of seq_len tokens, as transformers' run_clm example does; the remainder
shorter than a block is dropped.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from dtrain.common import env as envmod
from dtrain.common.errors import UserError
from dtrain.common.storage import is_remote, open_store
from dtrain.lora.model import ByteTokenizer

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".json")

# Bytes that text does not hold: the C0 controls and DEL, but not the whitespace that text does
# hold (\t \n \r \f). A file with more than this share of them is refused as binary: ordinary text
# has none, a log with colour escapes a few percent, UTF-16 saved without a BOM (valid UTF-8 byte
# for byte) half. Random binary rarely gets this far: it is not valid UTF-8.
CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F])
_CONTROL_RE = re.compile(b"[" + re.escape(CONTROL_BYTES) + b"]")
MAX_CONTROL_FRACTION = 0.30


@dataclasses.dataclass
class Blocks:
    train: torch.Tensor  # int64, N x seq_len
    eval: torch.Tensor
    tokens: int  # tokens in the stream before cutting
    documents: int


def decode_text(name: str, raw: bytes) -> str:
    """`raw` as text, or a UserError naming the file and the byte offset where it stops being text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{name}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): --data takes UTF-8 text; "
            "convert the file (iconv -t UTF-8) or leave it out"
        ) from None
    control = len(raw) - len(raw.translate(None, CONTROL_BYTES))
    if control > MAX_CONTROL_FRACTION * len(raw):
        first = _CONTROL_RE.search(raw).start()  # type: ignore[union-attr]
        raise UserError(
            f"{name}: binary, not text: {control:,} of its {len(raw):,} bytes ({control / len(raw):.1%}) are "
            f"control bytes, the first (0x{raw[first]:02x}) at offset {first}; --data takes text with at most "
            f"{MAX_CONTROL_FRACTION:.0%} control bytes"
        )
    return text


def _records(name: str, raw: bytes, text_field: str) -> list[str]:
    text = decode_text(name, raw)
    if not name.endswith((".jsonl", ".json")):
        return [text]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise UserError(f"{name}:{n}: not a JSON record ({e})") from None
        if not isinstance(rec, dict) or text_field not in rec:
            fields = ", ".join(rec) if isinstance(rec, dict) else type(rec).__name__
            raise UserError(f"{name}:{n}: record has no field {text_field!r} (it has: {fields}); pass --text-field")
        out.append(str(rec[text_field]))
    return out


def read_texts(spec: str, text_field: str) -> list[str]:
    """Every document named by `spec`, in a fixed order."""
    if is_remote(spec):
        store = open_store(spec)
        try:
            return _records(spec, store.read_bytes(""), text_field)
        except (FileNotFoundError, IsADirectoryError):
            pass
        names = [n for n in store.list("") if n.endswith(TEXT_SUFFIXES)]
        if not names:
            raise UserError(f"--data {spec}: no object there, and no {'/'.join(TEXT_SUFFIXES)} objects under it")
        return [doc for n in names for doc in _records(store.join(n), store.read_bytes(n), text_field)]
    path = Path(spec)
    if path.is_file():
        return _records(str(path), path.read_bytes(), text_field)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"--data {spec}: directory has no {', '.join(TEXT_SUFFIXES)} files")
        return [doc for f in files for doc in _records(str(f), f.read_bytes(), text_field)]
    return _hub_dataset(spec, text_field)


def _hub_dataset(name: str, text_field: str) -> list[str]:
    from dtrain.lora.model import hub_reachable

    if envmod.offline() or not hub_reachable():
        raise UserError(
            f"--data {name}: no such file or directory, and the Hugging Face hub is out of reach to "
            "load it as a dataset name (offline)"
        )
    try:
        import datasets
    except ImportError:
        raise UserError(f"--data {name}: not a file; to use Hugging Face datasets: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # noqa: BLE001 - the hub raises many types; one line for the user
        raise UserError(f"--data {name}: cannot load it as a dataset: {str(e).splitlines()[0][:200]}") from None
    if text_field not in ds.column_names:
        raise UserError(
            f"--data {name}: no column {text_field!r} (columns: {', '.join(ds.column_names)}); pass --text-field"
        )
    return [str(t) for t in ds[text_field]]


def tokenize(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """One int64 stream: each document's tokens followed by end-of-text."""
    eos = tokenizer.eos_token_id
    if isinstance(tokenizer, ByteTokenizer):
        parts = []
        for t in texts:
            parts += [torch.frombuffer(bytearray(t.encode("utf-8")), dtype=torch.uint8).long(), torch.tensor([eos])]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    ids = tokenizer.encode_many(texts)
    return torch.tensor([tok for doc in ids for tok in (*doc, eos)], dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int, eval_fraction: float, seed: int, source: str) -> Blocks:
    n = stream.numel() // seq_len
    if n < 2:
        raise UserError(
            f"--data {source} gives {stream.numel()} tokens: too short for two blocks of --seq-len "
            f"{seq_len} (one to train on, one to evaluate); add text or lower --seq-len"
        )
    blocks = stream[: n * seq_len].view(n, seq_len)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    return Blocks(train=blocks[order[n_eval:]], eval=blocks[order[:n_eval]], tokens=stream.numel(), documents=0)


def read_documents(spec: str, text_field: str) -> list[str]:
    """The non-empty documents of `spec`; read before the model loads, so bad data fails fast."""
    texts = [t for t in read_texts(spec, text_field) if t]
    if not texts:
        raise UserError(f"--data {spec} holds no text")
    return texts


def load_blocks(
    spec: str,
    text_field: str,
    tokenizer: Any,
    seq_len: int,
    eval_fraction: float,
    seed: int,
    texts: list[str] | None = None,
) -> Blocks:
    texts = texts if texts is not None else read_documents(spec, text_field)
    blocks = pack(tokenize(tokenizer, texts), seq_len, eval_fraction, seed, spec)
    blocks.documents = len(texts)
    return blocks
