"""Fixtures for the LoRA tests: a small real-text corpus (a few modules of Python's standard
library, ~87 KB: ~1,300 training and 68 held-out blocks of 64 bytes), written once per module; and a
preset an eighth as wide as tiny-llama for runs inside the test process."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

CORPUS_MODULES = ("textwrap.py", "string.py", "shutil.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join((stdlib / name).read_text(encoding="utf-8") for name in CORPUS_MODULES), encoding="utf-8")
    return path


# tiny-llama's matrix products take seconds a step in fp16 on a CPU (no native fp16 matmul); this
# preset takes a tenth of a second, and goes through the same code.
MICRO_LLAMA = dict(
    vocab_size=258,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture
def micro_llama(monkeypatch: pytest.MonkeyPatch) -> str:
    """The preset name `micro-llama`, known to dtrain.lora.model in this test."""
    from dtrain.lora import model

    monkeypatch.setitem(model.PRESETS, "micro-llama", model.Preset("llama", MICRO_LLAMA, model.LLAMA_TARGETS))
    return "micro-llama"
