"""The Hugging Face Trainer project (tests/programs/projects/hf_trainer) and what tests read from its runs:
the checkpoint a resumed run started from, the final weights' digest, the losses Trainer printed, and
which Trainer checkpoints a copy of the checkpoint directory (dtrain.common.mirror's manifests) holds."""

from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

from projects import PROJECTS

# A Trainer checkpoint is whole once trainer_state.json is there: Trainer writes it last.
COMPLETE_RE = re.compile(r"checkpoint-(\d+)/trainer_state\.json")


def make_trainer_project(dest: Path) -> Path:
    """projects/hf_trainer, with a .gitignore as a user keeps one (the outputs are not code)."""
    shutil.copytree(PROJECTS / "hf_trainer", dest)
    (dest / ".gitignore").write_text("out/\nxdg-cache/\nconfig/\n")
    return dest


def digest(text: str) -> str:
    """The final weights' digest the script printed (once: rank 0 only)."""
    found = re.findall(r"final digest ([0-9a-f]{64}) ", text)
    assert len(found) == 1, text[-4000:]
    return found[0]


def resumed_from(text: str) -> int:
    found = re.findall(r"resumed from checkpoint-(\d+)", text)
    assert len(found) == 1, text[-4000:]
    return int(found[0])


def losses(text: str) -> list[float]:
    """The training losses Trainer printed (every logging_steps), in order."""
    out = []
    for m in re.finditer(r"\{'loss': [^}]*\}", text):
        out.append(float(ast.literal_eval(m.group(0))["loss"]))
    return out


def complete_checkpoints(manifest_text: str) -> list[int]:
    """The steps of the whole Trainer checkpoints one manifest of the checkpoint directory's copy holds."""
    files = json.loads(manifest_text)["files"]
    return sorted(int(m.group(1)) for rel in files if (m := COMPLETE_RE.fullmatch(rel)))
