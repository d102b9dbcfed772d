"""Data and a model for the SFT tests: a BPE tokenizer trained here on a small word list, with a chat
template written here (BOS first, role tags, an end-of-turn token), saved beside a tiny Llama so the
pair is a local model directory like a hub model's; and chat and instruction records in each file
format dtrain reads."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

WORDS = "the a cat dog sat ran on under mat log red blue big small why how what is are".split()  # noqa: SIM905
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
# BOS from the template, then one tag per turn; the generation prompt opens an assistant turn.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_tokenizer(
    chat_template: str | None = TEMPLATE,
    add_bos: bool = False,
    specials: list[str] | None = None,
    bos: str | None = "<s>",
    eos: str = "</s>",
) -> Any:
    """A BPE tokenizer trained on WORDS; `specials` are added to SPECIALS (a real template's tokens),
    `bos`/`eos` name the model family's (None: no BOS, as Qwen has none)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    extra = [t for t in specials or [] if t not in SPECIALS]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300 + len(extra),
        special_tokens=SPECIALS + extra,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([sentence(rng, 12) for _ in range(300)], trainer)
    if add_bos:  # as Llama-3's tokenizer does: BOS on every encode with special tokens
        bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=bos, eos_token=eos, unk_token="<unk>")
    if chat_template:
        tok.chat_template = chat_template
    return tok


def make_model_dir(path: Path, tok: Any, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    tok.save_pretrained(path)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def chat_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": sentence(rng, 3)}] if rng.random() < 0.3 else []
        for _turn in range(rng.randint(1, 2)):
            msgs += [
                {"role": "user", "content": sentence(rng, rng.randint(2, 6))},
                {"role": "assistant", "content": sentence(rng, rng.randint(2, 8))},
            ]
        out.append({"messages": msgs, "id": len(out)})
    return out


def alpaca_records(n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [
        {"instruction": sentence(rng, 5), "input": sentence(rng, 3) if i % 2 else "", "output": sentence(rng, 6)}
        for i in range(n)
    ]


def write(records: list[dict[str, Any]], path: Path) -> Path:
    """`records` in the format `path`'s suffix names."""
    if path.suffix == ".json":
        path.write_text(json.dumps(records, indent=1))
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(records[0]))
            w.writeheader()
            w.writerows(records)
    else:
        raise ValueError(path)
    return path
