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
