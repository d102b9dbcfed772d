"""Projects the way users keep them, for tests of users' own programs (tests/programs, tests/cluster)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

PROJECTS = Path(__file__).parent / "programs" / "projects"


def make_ddp_project(dest: Path, *, rows: int = 64) -> Path:
    """projects/ddp plus configs/model.json and data/points.pt (a noisy linear target), as a user has them."""
    import torch

    shutil.copytree(PROJECTS / "ddp", dest)
    (dest / "configs").mkdir()
    (dest / "configs" / "model.json").write_text(json.dumps({"inputs": 4, "lr": 0.05}))
    (dest / "data").mkdir()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.01 * torch.randn(rows, 1, generator=g)
    torch.save({"x": x, "y": y}, dest / "data" / "points.pt")
    return dest
