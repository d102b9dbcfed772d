"""The training stacks users already use, unchanged (tests/programs/projects/accelerate and lightning: no dtrain
code in them), on the two-host test bed under dtrain's torchrun: accelerate with 2 processes on each host (4 in
all), Lightning's Trainer with DDP, 1 on each. A run whose launcher is killed mid-way resumes from the run's
copy of its checkpoint folder (in a gcp-storage-emulator bucket inside h0) and carries on to the end: it says
the step it resumed at, and prints for the next step the very loss the killed run printed for it.

Each host keeps its own `out/`, and both stacks save rank 0's files on h0 only (the model, the optimizer, the
step; accelerate writes each process's RNG state where that process runs): the restore puts the union of both
hosts' copies back on each, so every rank loads the whole checkpoint. Real CLI, OpenSSH, torchrun, gloo.

Needs root (skips otherwise; CI runs as root)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from stacks import make_stack_project, resumed_at, saved_in, step_losses

from dtrain.common.storage import open_store

from .bed import Testbed
from .test_launch import bucket
from .test_user_programs import dtrain
from .test_user_trainer import Started, kill_once_copied, on_h0

pytestmark = [pytest.mark.root, pytest.mark.slow]

STEPS, SAVE_EVERY = 40, 10


@pytest.fixture(scope="module")
def emulator(testbed: Testbed) -> str:
    return testbed.start_gcs_emulator(testbed.hosts[0])


def project(stack: str, testbed: Testbed, known_hosts: Path, emulator: str, folder: Path) -> Path:
    """The stack's project, whose dtrain.toml describes the test bed as cluster `bed`."""
    d = make_stack_project(stack, folder / "proj")
    toml = testbed.cluster_toml("bed", sys.executable, env={"STORAGE_EMULATOR_HOST": emulator}, known_hosts=known_hosts)
    (d / "dtrain.toml").write_text(toml)
    return d


def copied(stack: str, out: str, rid: str) -> int:
    """The newest checkpoint of the stack in h0's (node 0's) newest copy of the folder in the bucket."""
    node0 = open_store(f"{out}/{rid}/ckpt").child("node-00000")
    names = sorted(n for n in node0.list() if n.endswith(".json") and n[0].isdigit())
    return max(saved_in(stack, node0.read_bytes(names[-1]).decode()), default=0) if names else 0


@pytest.mark.parametrize(("stack", "nproc"), [("accelerate", 2), ("lightning", 1)])
def test_a_stacks_script_on_two_hosts_killed_mid_run_resumes_from_the_runs_copy(
    stack: str, nproc: int, testbed: Testbed, known_hosts: Path, emulator: str, tmp_path: Path
):
    cwd = project(stack, testbed, known_hosts, emulator, tmp_path)
    out = bucket(emulator)
    args = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    base = ["train", "train.py", "--cluster", "bed", "--nproc", str(nproc), "--output", out, "--checkpoint-dir", "out"]
    # A pause after each step (0.2 s: 2 s between saves) gives time to see a copy and kill mid-way.
    job = Started(cwd, emulator, *base, "--", *args, "--sleep", "0.2")
    rid = kill_once_copied(job, testbed, lambda rid: copied(stack, out, rid), 2 * SAVE_EVERY, timeout=240)
    last_copy = copied(stack, out, rid)
    assert 2 * SAVE_EVERY <= last_copy < STEPS, last_copy

    # The rest at full speed: `--sleep 0` after the run's own line (the last one wins).
    resumed = dtrain(cwd, emulator, "train", "--resume", rid, "--output", out, "--cluster", "bed", "--", "--sleep", "0")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr
    assert "checkpoint directory restored from the run" in resumed.stdout
    assert f"2 node(s) x {nproc} process(es) under torchrun" in resumed.stdout  # the run's own world
    # What h0 printed: accelerate's print is each node's first process's (Lightning's, rank 0's).
    at = resumed_at(on_h0(resumed.stdout))
    assert at >= last_copy, (at, last_copy)
    before, after = step_losses(on_h0(job.output)), step_losses(on_h0(resumed.stdout))
    assert min(after) == at + 1 and max(after) == STEPS, sorted(after)
    assert after[at + 1] == before[at + 1], (at, before, after)  # carried on: the very loss of the same step
    status = json.loads(open_store(f"{out}/{rid}").read_bytes("status.json"))
    assert status["state"] == "completed" and status["starts"] == 2
