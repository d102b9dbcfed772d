"""Fixtures for users' own programs: a project folder the way users keep one (train.py, a config file, a
data folder, optionally requirements.txt), copied from projects/ into a temporary directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from projects import make_ddp_project


@pytest.fixture
def ddp_project(tmp_path: Path) -> Path:
    return make_ddp_project(tmp_path / "proj")
