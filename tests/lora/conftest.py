"""Fixtures for the LoRA tests: a small real-text corpus (a few modules of Python's standard
library, ~87 KB: ~1,300 training and 68 held-out blocks of 64 bytes), written once per module."""

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
