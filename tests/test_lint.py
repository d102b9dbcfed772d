"""The code passes the project's linter and formatter (configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ["cli", "packages", "tests", "benchmarks"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(exe).exists():
        pytest.skip("ruff is not installed (it is in the dev extra)")
    return subprocess.run([exe, *args, *SOURCES], cwd=REPO, capture_output=True, text=True, check=False)


def test_ruff_check():
    r = ruff("check", "--output-format", "concise")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format():
    r = ruff("format", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
