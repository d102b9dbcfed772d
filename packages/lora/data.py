"""Data for LoRA: read once, tokenised once, and cut into fixed-length rows, split into training and
held-out rows deterministically from the seed.

`--data` (and `--eval-data`) is a file, a directory of them, a gs:// object or prefix, or (online) a
Hugging Face dataset name. Files are plain text (.txt .md .rst .py: one document each) or records:
JSON Lines (.jsonl), a JSON array or JSON Lines (.json), Parquet (.parquet) and CSV (.csv). Every
source is read as a list of rows (a dict per record; a plain-text file is one row {text_field: its
text}), each with a label (`file:line`, `file[index]`) that error messages name.

Plain text (this module): documents are joined with the tokenizer's end-of-text token and the
stream is cut into blocks of seq_len tokens, as transformers' run_clm example does; the remainder
shorter than a block is dropped. Instruction and chat data (dtrain.lora.sft) keep documents apart.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import torch

from dtrain.common import env as envmod
from dtrain.common.errors import UserError
from dtrain.common.storage import is_remote, open_store
from dtrain.lora.model import ByteTokenizer

PLAIN_SUFFIXES = (".txt", ".md", ".rst", ".py")
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
TEXT_SUFFIXES = PLAIN_SUFFIXES + RECORD_SUFFIXES  # what a directory or a bucket prefix is searched for

# Bytes that text does not hold: the C0 controls and DEL, but not the whitespace that text does
# hold (\t \n \r \f). A file with more than this share of them is refused as binary: ordinary text
# has none, a log with colour escapes a few percent, UTF-16 saved without a BOM (valid UTF-8 byte
# for byte) half. Random binary rarely gets this far: it is not valid UTF-8.
CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F])
_CONTROL_RE = re.compile(b"[" + re.escape(CONTROL_BYTES) + b"]")
MAX_CONTROL_FRACTION = 0.30

Row = tuple[str, dict[str, Any]]  # (where it came from, for messages; the record)
DEFAULT_SPLIT = "train"  # a Hugging Face dataset's split when --data-split is not given
# What `datasets` says when a subset (config) or split is not there, with the list of those that are.
_UNKNOWN_SPLIT = re.compile(r"Unknown split \"(?P<name>[^\"]*)\"\. Should be one of (?P<have>\[.*?\])")
_UNKNOWN_SUBSET = re.compile(r"BuilderConfig '(?P<name>[^']*)' not found\. Available: (?P<have>\[.*?\])")
_MISSING_SUBSET = re.compile(
    r"Config name is missing\.\s*Please pick one among the available configs: (?P<have>\[.*?\])"
)


@dataclasses.dataclass
class Blocks:
    """Plain text: int64 N x seq_len token blocks. Instruction/chat data (dtrain.lora.sft): int64
    N x 3 x seq_len, rows of (token ids, labels with -100 where no loss, position ids restarting at
    each document, -1 on padding)."""

    train: torch.Tensor
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


def _jsonl_rows(name: str, text: str) -> list[Row]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise UserError(f"{name}:{n}: not a JSON record ({e})") from None
        if not isinstance(rec, dict):
            raise UserError(f"{name}:{n}: a JSON {type(rec).__name__}, not a record ({{field: value, ...}})")
        out.append((f"{name}:{n}", rec))
    return out


def _json_rows(name: str, text: str) -> list[Row]:
    """A .json file: a JSON array of records (Alpaca's layout), else JSON Lines."""
    if not text.lstrip().startswith("["):
        return _jsonl_rows(name, text)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{name}: not a JSON array of records ({e})") from None
    bad = next((i for i, r in enumerate(data) if not isinstance(r, dict)), None)
    if bad is not None:
        raise UserError(f"{name}[{bad}]: a JSON {type(data[bad]).__name__}, not a record ({{field: value, ...}})")
    return [(f"{name}[{i}]", r) for i, r in enumerate(data)]


def _parquet_rows(name: str, raw: bytes) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{name}: reading Parquet needs pyarrow: pip install 'dtrain[lora]'") from None
    try:
        table = pq.read_table(io.BytesIO(raw))
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file; one line
        raise UserError(f"{name}: not a readable Parquet file ({str(e).splitlines()[0][:200]})") from None
    return [(f"{name} row {i}", r) for i, r in enumerate(table.to_pylist())]


def _csv_rows(name: str, text: str) -> list[Row]:
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        # DictReader's line_num is the line a record ends on; the header is line 1.
        return [(f"{name}:{reader.line_num}", dict(r)) for r in reader]
    except csv.Error as e:
        raise UserError(f"{name}: not readable as CSV ({e})") from None


def parse_rows(name: str, raw: bytes, text_field: str) -> list[Row]:
    """The records of one file, by its suffix; a plain-text file is one record {text_field: text}."""
    if name.endswith(".parquet"):
        return _parquet_rows(name, raw)
    text = decode_text(name, raw)
    if name.endswith(".jsonl"):
        return _jsonl_rows(name, text)
    if name.endswith(".json"):
        return _json_rows(name, text)
    if name.endswith(".csv"):
        return _csv_rows(name, text)
    return [(name, {text_field: text})]


def read_rows(spec: str, text_field: str, split: str = "", subset: str = "") -> list[Row]:
    """Every record named by `spec`, in a fixed order (`split`, default train, and `subset` are for
    Hugging Face datasets; a file or bucket refuses them rather than ignore them)."""
    if (split or subset) and (is_remote(spec) or Path(spec).exists()):
        flag = f"--data-subset {subset}" if subset else f"--data-split {split}"
        raise UserError(f"{flag}: a subset or split names part of a Hugging Face dataset; --data {spec} is a file")
    if is_remote(spec):
        store = open_store(spec)
        try:
            return parse_rows(spec, store.read_bytes(""), text_field)
        except (FileNotFoundError, IsADirectoryError):
            pass
        names = [n for n in store.list("") if n.endswith(TEXT_SUFFIXES)]
        if not names:
            raise UserError(f"--data {spec}: no object there, and no {'/'.join(TEXT_SUFFIXES)} objects under it")
        return [row for n in names for row in parse_rows(store.join(n), store.read_bytes(n), text_field)]
    path = Path(spec)
    if path.is_file():
        return parse_rows(str(path), path.read_bytes(), text_field)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise UserError(f"--data {spec}: directory has no {', '.join(TEXT_SUFFIXES)} files")
        return [row for f in files for row in parse_rows(str(f), f.read_bytes(), text_field)]
    return _hub_rows(spec, split or DEFAULT_SPLIT, subset)


def hub_name(spec: str) -> bool:
    """Whether `spec` can name a Hugging Face dataset (`name` or `owner/name`), not only a missing path."""
    return not spec.startswith(("/", "./", "../", "~")) and spec.count("/") <= 1


def _names(listed: str) -> str:
    """`datasets`' printed list of names ("['a', 'b']") as "a, b"."""
    import ast

    try:
        return ", ".join(str(n) for n in ast.literal_eval(listed))
    except (ValueError, SyntaxError):
        return listed


def _hub_rows(name: str, split: str, subset: str = "") -> list[Row]:
    """A split (of a subset, or config) of a Hugging Face dataset, through `datasets` (HF_ENDPOINT and
    HF_HOME honoured); a subset or split that is not there is one line naming those that are. Offline
    (DTRAIN_OFFLINE or HF_HUB_OFFLINE set, or the hub's host does not resolve) only the datasets cache
    is read: a dataset loaded once online loads again without the hub."""
    from dtrain.lora.model import hub_reachable, hub_refusal

    offline = envmod.offline() or not hub_reachable()
    missing = f"--data {name}: no such file or directory"
    if not hub_name(name):
        raise UserError(
            missing
            + (", and the Hugging Face hub is out of reach to load it as a dataset name (offline)" if offline else "")
        )
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"--data {name}: not a file; to use Hugging Face datasets: pip install 'dtrain[lora]'"
        ) from None
    # DTRAIN_OFFLINE alone does not reach `datasets`, which reads HF_HUB_OFFLINE once, at import: set
    # its switch (the one its own tests set) for this call only, so it reads its cache and nothing else.
    was_offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = was_offline or offline
    try:
        ds = datasets.load_dataset(name, subset or None, split=split)
    except Exception as e:  # noqa: BLE001 - the hub raises many types; one line for the user
        if offline and isinstance(e, ConnectionError):  # not in the cache
            raise UserError(
                f"{missing}, and the Hugging Face hub is out of reach to load it as a dataset name (offline: "
                "DTRAIN_OFFLINE or HF_HUB_OFFLINE is set, or the hub's host does not resolve) and the datasets "
                "cache does not hold it; load it once online, or pass a local file"
            ) from None
        refusal = None if offline else hub_refusal(e, f"--data {name}")  # gated (401/403), rate-limited (429)
        if refusal:
            raise UserError(refusal) from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if "/" not in name and "namespace/name" in first:  # datasets' hf:// paths need owner/name
            raise UserError(
                f"--data {name}: `datasets` loads a Hugging Face dataset only by its full id, owner/name (the Hub's "
                "old bare names now live under an owner, e.g. imdb is stanfordnlp/imdb): pass --data OWNER/"
                f"{name}, as the dataset's page names it"
            ) from None
        if isinstance(e, datasets.exceptions.DatasetNotFoundError):  # a typo'd path lands here too
            raise UserError(
                f"{missing}, and not a dataset on the Hugging Face hub ({first}); check the name, or set "
                "HF_TOKEN for a private or gated dataset"
            ) from None
        whole = " ".join(str(e).split())
        if m := _UNKNOWN_SPLIT.search(whole):
            raise UserError(
                f"--data {name}: no split {split!r}{f' in subset {subset!r}' if subset else ''}; it has "
                f"{_names(m['have'])}: pass one with --data-split (or --eval-data)"
            ) from None
        if m := _UNKNOWN_SUBSET.search(whole):
            raise UserError(
                f"--data {name}: no subset {subset!r}; it has {_names(m['have'])}: pass one with --data-subset"
            ) from None
        if m := _MISSING_SUBSET.search(whole):
            raise UserError(
                f"--data {name}: the dataset has several subsets ({_names(m['have'])}): pass one with --data-subset"
            ) from None
        raise UserError(f"--data {name}: cannot load split {split!r} as a dataset: {first}") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = was_offline
    part = f"{subset}/{split}" if subset else split
    return [(f"{name}[{part}] row {i}", r) for i, r in enumerate(ds)]


def texts_of(rows: list[Row], text_field: str) -> list[str]:
    """The documents of plain-text data: each row's `text_field`, which must be a string (a list of
    chat messages is never turned into its repr)."""
    out = []
    for where, rec in rows:
        if text_field not in rec:
            raise UserError(
                f"{where}: record has no field {text_field!r} (it has: {', '.join(rec)}); pass --text-field"
            )
        value = rec[text_field]
        if value is None:
            continue
        if not isinstance(value, str):
            raise UserError(
                f"{where}: field {text_field!r} holds a {type(value).__name__}, not text: for chat data "
                "(a list of {role, content} messages) pass --format chat; for instruction data --format instruction"
            )
        out.append(value)
    return out


def read_texts(spec: str, text_field: str) -> list[str]:
    """Every document named by `spec`, in a fixed order."""
    return texts_of(read_rows(spec, text_field), text_field)


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


def read_documents(spec: str, text_field: str, rows: list[Row] | None = None) -> list[str]:
    """The non-empty documents of `spec`; read before the model loads, so bad data fails fast."""
    texts = [t for t in (texts_of(rows, text_field) if rows is not None else read_texts(spec, text_field)) if t]
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
    eval_texts: list[str] | None = None,
) -> Blocks:
    """Plain text as blocks; with `eval_texts` (--eval-data), every block of those is held out and
    every block of `spec` trains."""
    texts = texts if texts is not None else read_documents(spec, text_field)
    if eval_texts is None:
        blocks = pack(tokenize(tokenizer, texts), seq_len, eval_fraction, seed, spec)
    else:
        train, held = tokenize(tokenizer, texts), tokenize(tokenizer, eval_texts)
        n, m = train.numel() // seq_len, held.numel() // seq_len
        if n < 1 or m < 1:
            which, size = ("--data", train.numel()) if n < 1 else ("--eval-data", held.numel())
            raise UserError(f"{which} gives {size} tokens: less than one block of --seq-len {seq_len}; lower --seq-len")
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
        blocks = Blocks(
            train=train[: n * seq_len].view(n, seq_len)[order],
            eval=held[: m * seq_len].view(m, seq_len),
            tokens=train.numel(),
            documents=0,
        )
    blocks.documents = len(texts)
    return blocks
