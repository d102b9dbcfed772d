"""A real Slurm in the network-namespace test bed (scripts/slurmbed.py): three hosts with Debian's slurm-wlm
and munge, nothing configured. h0 and h1 are cluster `bed` (backend hosts, slurm = true): dtrain sets Slurm
up on them (`dtrain slurm setup`), as on its own clusters. h2 is made a login node of that Slurm (its
configuration and key, no slurmd), and cluster `user` (backend = "slurm") reaches the same Slurm through
it, as someone with an existing cluster would.

Runs write to a directory every host sees (the bed's `shared`, as /home on a Slurm cluster). Everything is
real: slurmctld, slurmd, munged, sbatch/srun, sshd, torchrun and gloo.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from runs import CLI, isolated_env

REPO = Path(__file__).resolve().parents[2]
FASHION = Path("/usr/share/datasets/fashion-mnist")


def _load_slurmbed():
    if "dtrain_slurmbed" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dtrain_slurmbed", REPO / "scripts" / "slurmbed.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["dtrain_slurmbed"] = module
        spec.loader.exec_module(module)
    return sys.modules["dtrain_slurmbed"]


SlurmBed = _load_slurmbed().SlurmBed


# Slurm states after which a job does nothing more (a requeued job passes through PENDING, not these).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "DEADLINE"}


@dataclasses.dataclass
class Env:
    """The test bed, a working directory whose dtrain.toml names clusters `bed` and `user`, and the CLI."""

    sb: SlurmBed
    cwd: Path
    runs: Path  # --output of every run: on the bed's shared filesystem
    setup_output: str = ""  # what `dtrain slurm setup` printed when the bed was made

    def env(self) -> dict[str, str]:
        return isolated_env(
            self.cwd,
            XDG_CONFIG_HOME=str(self.cwd / "config"),
            XDG_CACHE_HOME=str(self.cwd / "xdg-cache"),
            COLUMNS="200",
            # Checkpoints are written on each node and copied to the run: every half second, not every 30 s.
            DTRAIN_INTERNAL_MIRROR_INTERVAL_S="0.5",
        )

    def dtrain(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*CLI, *args], cwd=self.cwd, env=self.env(), capture_output=True, text=True, timeout=timeout
        )

    def start(self, *args: str, session: bool = False) -> subprocess.Popen:
        """The CLI in the background; `session`: in a session of its own, as on a terminal (signal its group)."""
        return subprocess.Popen(
            [*CLI, *args],
            cwd=self.cwd,
            env=self.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=session,
        )

    def submit(self, *args: str, cluster: str = "bed") -> str:
        """`dtrain submit` of a short Fashion-MNIST run; the job id it printed."""
        r = self.dtrain("submit", "mnist", "--cluster", cluster, *MNIST, "--output", str(self.runs), *args)
        assert r.returncode == 0, r.stdout + r.stderr
        job = r.stdout.strip()
        assert job.isdigit(), r.stdout
        return job

    def jobs(self, cluster: str = "bed") -> dict[str, dict]:
        r = self.dtrain("jobs", "--cluster", cluster, "--all", "--json")
        assert r.returncode == 0, r.stderr
        return {j["job_id"]: j for j in json.loads(r.stdout)}

    def wait(self, job: str, predicate, timeout: float = 270, what: str = "", cluster: str = "bed") -> dict:
        """Poll `dtrain jobs` until predicate(job's row) holds; the row."""
        deadline = time.monotonic() + timeout
        row: dict = {}
        while time.monotonic() < deadline:
            row = self.jobs(cluster).get(job, {})
            if row and predicate(row):
                return row
            if row.get("state", "").split(" ")[0] in ENDED:  # nothing more will happen to it: say why now
                log = self.dtrain("logs", job, "--cluster", cluster, timeout=120)
                pytest.fail(f"job {job} ended before {what or 'the condition'}: {row}\n{log.stdout[-3000:]}")
            time.sleep(1)
        pytest.fail(f"job {job}: {what or 'condition'} not reached in {timeout:.0f} s; last: {row}")

    def run_dir(self, job: str, cluster: str = "bed") -> Path:
        return Path(self.jobs(cluster)[job]["url"])


# 2 nodes x 1 process, 2 epochs over 16,000 images: 62 steps an epoch at the global batch of 256 (the
# cluster tests' accuracy bar: 0.80).
EPOCHS, TRAIN_IMAGES, BATCH = 2, 16_000, 256
TOTAL_STEPS = EPOCHS * (TRAIN_IMAGES // BATCH)
MNIST = ["--dataset", "fashion-mnist", "--epochs", str(EPOCHS), "--train-split", f"train[:{TRAIN_IMAGES}]",
         "--batch-size", str(BATCH), "--nproc", "1"]  # fmt: skip


# A short 2-node run (one epoch of 8,000 images, a small evaluation, a checkpoint every 8 steps of its 31): what the
# tests that interrupt a job (a crashed node, a preempted worker) run, and compare with the weights of `uninterrupted`.
SHORT = ["--epochs", "1", "--train-split", "train[:8000]", "--eval-split", "test[:2000]", "--checkpoint-every", "8"]


# Session scope: scripts/test.sh runs the default tests first and the slow ones after, in one session, so the
# package's tests are not contiguous; the bed is built once and destroyed at the end of the session.
@pytest.fixture(scope="session")
def sbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmBed]:
    if reason := SlurmBed.available():
        pytest.skip(reason)
    sb = SlurmBed.create(3, tmp_path_factory.mktemp("slurmbed"))
    try:
        yield sb
    finally:
        sb.destroy()


@pytest.fixture(scope="session")
def bed(sbed: SlurmBed, tmp_path_factory: pytest.TempPathFactory) -> Env:
    """Clusters `bed` (h0, h1; Slurm set up by dtrain) and `user` (the same Slurm through login node h2)."""
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("needs Debian's dataset-fashion-mnist (scripts/setup.sh installs it as root)")
    cwd = tmp_path_factory.mktemp("slurm-cwd")
    runs = sbed.shared / "runs"
    runs.mkdir()
    py = sys.executable
    toml = sbed.hosts_toml("bed", py, nodes=2) + "\n"
    toml += sbed.slurm_toml("user", py, login=sbed.host("h2"), workdir=sbed.shared / "user")
    (cwd / "dtrain.toml").write_text(toml)
    env = Env(sbed, cwd, runs)
    r = env.dtrain("slurm", "setup", "--cluster", "bed", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    env.setup_output = r.stdout
    sbed.make_login(sbed.host("h2"), sbed.host("h0"))
    return env


@pytest.fixture(scope="session")
def uninterrupted(bed: Env) -> dict:
    """The SHORT run, trained once per session without interruption (its `dtrain jobs` row; url: the run, in the
    bed's shared runs folder): the weights a crashed or preempted job of the same run must resume to. Where the run
    is written does not change them."""
    job = bed.submit(*SHORT)
    return bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED (the uninterrupted run)")
