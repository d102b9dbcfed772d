"""Projects the way users keep them, for tests of users' own programs (tests/programs, tests/cluster, tests/slurm)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import zipfile
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


def write_wheel(folder: Path, name: str, version: str, code: str) -> Path:
    """A pure-Python wheel made by hand (a zip with its metadata and RECORD): no build backend, no index."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": code.encode(),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dtrain-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return out


# A program whose last rank freezes its launcher (torchrun) and then itself (SIGSTOP) before its first step, as a
# rank stuck in its set-up looks from outside (issue 31); the other ranks step and log through the SDK.
FREEZE_BEFORE_FIRST_STEP = """\
import os
import signal
import time

from dtrain import sdk

if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    os.kill(os.getppid(), signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)
for step in range(1, 100000):
    time.sleep(0.1)
    sdk.log(step, loss=1.0 / step)
"""


def make_freeze_project(dest: Path) -> Path:
    """A folder with train.py = FREEZE_BEFORE_FIRST_STEP."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "train.py").write_text(FREEZE_BEFORE_FIRST_STEP)
    return dest
