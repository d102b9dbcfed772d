"""The fast pieces of the stack tests (tests/programs/test_stacks.py, tests/cluster/test_user_stacks.py): what
they read from a run (the copy's manifests, the printed steps and losses), and the accelerate script's choice of
the checkpoint it resumes from."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from projects import PROJECTS
from stacks import resumed_at, saved_in, step_losses, trl_losses


def manifest(*files: str) -> str:
    return json.dumps({"seq": 1, "node": 0, "files": {f: {"sha256": "0" * 64, "size": 1} for f in files}})


def test_a_manifest_names_the_checkpoints_each_stack_wrote():
    acc = manifest("step_10/model.safetensors", "step_10/custom_checkpoint_0.pkl", "step_20/model.safetensors")
    assert saved_in("accelerate", acc) == [10]  # step_20's step counter is not there yet
    lit = manifest("last.ckpt", "epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "epoch=1-step=20.ckpt.tmp")
    assert saved_in("lightning", lit) == [10, 20]


def test_what_the_scripts_print_is_read_per_step_and_from_h0_lines_too():
    text = "[h0] resumed at step 20\n[h0] step 21 loss 3.5000\n[h0] step 22 loss 3.2500\nstep 40 loss 1.0\n"
    assert resumed_at(text) == 20
    assert step_losses(text) == {21: "3.5000", 22: "3.2500", 40: "1.0"}
    logged = "{'loss': '4.039', 'grad_norm': '1.177'}\n{'train_runtime': '0.73', 'train_loss': '3.488'}\n"
    assert trl_losses(logged) == ["4.039"]  # the summary's train_loss is not a step's


def test_the_accelerate_script_resumes_from_its_highest_step_not_the_last_name(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("acc_train", PROJECTS / "accelerate" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name in ("step_9", "step_10", "step_100", "step_x", "other", "step_"):
        (tmp_path / name).mkdir()
    assert script.saved_steps(str(tmp_path)) == [9, 10, 100]
    assert script.saved_steps(str(tmp_path / "missing")) == []
