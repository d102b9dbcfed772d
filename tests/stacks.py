"""The training stacks users already use (tests/programs/projects/accelerate, lightning, trl), as projects a
user keeps, and what tests read from their runs: the step a resumed run started at, the loss printed at each
step, and which of the stack's checkpoints a copy of the checkpoint folder (dtrain.common.mirror's
manifests) holds."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from projects import PROJECTS

# What each stack's checkpoint of step N leaves in its folder, by a file written with it (one per step).
SAVED_RE = {
    # accelerator.save_state: the model, the optimizer, each process's RNG and the registered step counter
    "accelerate": re.compile(r"step_(\d+)/custom_checkpoint_0\.pkl"),
    # ModelCheckpoint(every_n_train_steps=...): one file a save, beside last.ckpt
    "lightning": re.compile(r"epoch=\d+-step=(\d+)\.ckpt"),
}


def make_stack_project(stack: str, dest: Path) -> Path:
    """projects/<stack>, with a .gitignore as a user keeps one (the outputs are not code)."""
    shutil.copytree(PROJECTS / stack, dest)
    (dest / ".gitignore").write_text("out/\nxdg-cache/\nconfig/\n")
    return dest


def resumed_at(text: str) -> int:
    found = re.findall(r"resumed at step (\d+)", text)
    assert len(found) == 1, text[-4000:]
    return int(found[0])


def step_losses(text: str) -> dict[int, str]:
    """The loss each step printed (`step N loss X`, rank 0 only), as printed."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+) loss (\S+)", text)}


def saved_in(stack: str, manifest_text: str) -> list[int]:
    """The steps of the stack's checkpoints that one manifest of the checkpoint folder's copy holds."""
    files = json.loads(manifest_text)["files"]
    return sorted(int(m.group(1)) for rel in files if (m := SAVED_RE[stack].fullmatch(rel)))


SFT_WORDS = ["the", "a", "one", "two", "three", "four", "five", "cat", "dog", "sat", "ran", "on", "under", "mat"]


def make_trl_project(dest: Path, *, rows: int = 64) -> Path:
    """A folder for `trl sft`, all made here (nothing downloaded): model/ a tiny Llama built from a config (about
    4,600 parameters) with a byte-pair tokenizer trained on the data, and data/train.jsonl, short texts in TRL's
    language-modelling format ({"text": ...})."""
    import random

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    texts = [" ".join(rng.choice(SFT_WORDS) for _ in range(rng.randint(4, 12))) for _ in range(rows)]
    (dest / "data").mkdir(parents=True)
    (dest / "data" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    raw.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=64, special_tokens=specials, show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")  # fmt: skip
    tok.save_pretrained(dest / "model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(dest / "model")
    (dest / ".gitignore").write_text("out/\nxdg-cache/\nconfig/\n")
    return dest


def trl_losses(text: str) -> list[str]:
    """The training losses Trainer logged (logging_steps 1: one a step), in order, as printed."""
    return re.findall(r"\{'loss': '([^']+)'", text)
