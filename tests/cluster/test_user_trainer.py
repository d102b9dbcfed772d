"""A script driven by Hugging Face's own Trainer (tests/programs/projects/hf_trainer: no dtrain code in it)
on the two-host test bed, 1 process per host (DDP on gloo across the hosts): it learns, and a run whose
launcher is killed mid-way resumes from the run's copy of the checkpoint folder (in a gcp-storage-emulator
bucket inside h0) and ends with the very weights of an uninterrupted run. Real CLI, OpenSSH, torchrun.

Each host keeps its own `out/`: h0 (rank 0) writes the model, optimizer, scheduler and trainer state, h1
only its RNG state (rng_state_1.pth); the restore puts the union of both hosts' copies back on each, so
both ranks find the whole checkpoint and Trainer's resume is exact (see tests/programs/test_trainer.py).

Needs root (skips otherwise; CI runs as root)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from runs import CLI
from trainer_project import complete_checkpoints, digest, losses, make_trainer_project, resumed_from

from dtrain.common.storage import open_store

from .bed import Testbed
from .test_launch import bucket, cli_env, host_processes, job_processes
from .test_user_programs import FAST, dtrain

pytestmark = [pytest.mark.root, pytest.mark.slow]

STEPS, SAVE_EVERY = 60, 10
ARGS = ["--max-steps", str(STEPS), "--save-steps", str(SAVE_EVERY)]
# About 3.5 s between two saves. The agents' last copy after the launcher dies takes the folder as the
# stopped job left it, and Trainer writes a checkpoint's files one after another with no marker of a
# whole one: the stop must land between two saves (it does, a second or two after the copy seen), or
# the newest checkpoint folder could be half written.
SLOW_ARGS = [*ARGS, "--sleep", "0.3"]


@pytest.fixture(scope="module")
def emulator(testbed: Testbed) -> str:
    return testbed.start_gcs_emulator(testbed.hosts[0])


@pytest.fixture(scope="module")
def cwd(testbed: Testbed, known_hosts: Path, emulator: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Trainer project, whose dtrain.toml describes the test bed as cluster `bed`."""
    d = make_trainer_project(tmp_path_factory.mktemp("trainer-project") / "proj")
    toml = testbed.cluster_toml("bed", sys.executable, env={"STORAGE_EMULATOR_HOST": emulator}, known_hosts=known_hosts)
    (d / "dtrain.toml").write_text(toml)
    return d


class Started:
    """A `dtrain` process whose output is read on a thread (so it never blocks on a full pipe)."""

    def __init__(self, cwd: Path, emulator: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [*CLI, *args], cwd=cwd, env={**cli_env(cwd, emulator), **FAST}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)


def run_of(out: str) -> str | None:
    found = [ln for ln in out.splitlines() if ln.startswith(("starting ", "resuming ")) and " run " in ln]
    return found[0].split(" run ", 1)[1].split()[0] if found else None


def on_h0(out: str) -> str:
    return "".join(ln + "\n" for ln in out.splitlines() if ln.startswith("[h0] "))


def copied(out: str, rid: str) -> int:
    """The newest whole Trainer checkpoint in h0's (node 0's) newest copy of the folder in the bucket."""
    node0 = open_store(f"{out}/{rid}/ckpt").child("node-00000")
    names = sorted(n for n in node0.list() if n.endswith(".json") and n[0].isdigit())
    return max(complete_checkpoints(node0.read_bytes(names[-1]).decode()), default=0) if names else 0


def workers(bed: Testbed) -> dict[str, list[str]]:
    """Each host's processes running the script (torchrun's workers), as command lines."""
    return host_processes(bed, lambda cmd: "train.py" in cmd)


def kill_once_copied(job: Started, bed: Testbed, copied: Callable[[str], int], at_least: int, timeout: float) -> str:
    """Waits until the run's copy holds a checkpoint of step `at_least` or later (`copied(run id)`), SIGKILLs the
    launcher (the agents stop the job and copy its folder last) and waits until no process of the job is left on
    any host: the run's id."""
    deadline = time.monotonic() + timeout
    rid = None
    while time.monotonic() < deadline:
        rid = rid or run_of(job.output)
        if rid and copied(rid) >= at_least:
            break
        assert job.proc.poll() is None, job.output[-4000:]
        time.sleep(0.2)
    else:
        job.proc.kill()
        pytest.fail(f"no copy of step {at_least} or later within {timeout} s:\n{job.output[-4000:]}")
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait()
    deadline = time.monotonic() + 60
    while (any(job_processes(bed).values()) or any(workers(bed).values())) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(job_processes(bed).values()), job_processes(bed)
    assert not any(workers(bed).values()), workers(bed)
    return rid


def test_trainer_script_on_two_hosts_killed_mid_run_resumes_to_the_uninterrupted_weights(
    cwd: Path, emulator: str, testbed: Testbed
):
    out = bucket(emulator)
    base = ["train", "train.py", "--cluster", "bed", "--nproc", "1", "--output", out, "--checkpoint-dir", "out",
            "--env", "HF_HUB_OFFLINE=1"]  # fmt: skip
    whole = dtrain(cwd, emulator, *base, "--", *ARGS)
    assert whole.returncode == 0, whole.stdout[-4000:] + whole.stderr
    seen = losses(on_h0(whole.stdout))  # each host's first process prints Trainer's logs (log_on_each_node)
    assert len(seen) == STEPS // 10 and seen[-1] < 0.7 * seen[0], seen
    expected = digest(whole.stdout)
    status = json.loads(open_store(f"{out}/{run_of(whole.stdout)}").read_bytes("status.json"))
    assert status["state"] == "completed"

    job = Started(cwd, emulator, *base, "--", *SLOW_ARGS)
    rid = kill_once_copied(job, testbed, lambda rid: copied(out, rid), 20, timeout=300)
    last_copy = copied(out, rid)
    assert 20 <= last_copy < STEPS, last_copy

    resumed = dtrain(cwd, emulator, "train", "--resume", rid, "--output", out, "--cluster", "bed")
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr
    assert "checkpoint directory restored from the run" in resumed.stdout
    assert "2 node(s) x 1 process(es) under torchrun" in resumed.stdout  # the run's own world, without --nproc
    assert resumed_from(resumed.stdout) >= last_copy
    assert digest(resumed.stdout) == expected
    status = json.loads(open_store(f"{out}/{rid}").read_bytes("status.json"))
    assert status["state"] == "completed" and status["starts"] == 2
