"""A start-up hang on the real Slurm bed (tests/slurm/conftest.py; docs/hangs.md): a user's program submitted to two
nodes whose last rank freezes its torchrun and itself (SIGSTOP) before its first step. With --startup-timeout 5 the
node agent names it as a start-up hang; the batch step records it and ends the job (exit 4, not requeued: its
--max-restarts is 0), the run failed for that reason. Real slurmctld, slurmd, sbatch/srun, torchrun.

Needs root (network namespaces; CI runs as root), Debian's slurm-wlm and munge."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .conftest import Env
from .test_slurm_bed import job_processes
from .test_slurm_programs import BED, dtrain

pytestmark = [pytest.mark.root, pytest.mark.slow]

FREEZE_SCRIPT = """\
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
STARTUP_S = 5


@pytest.mark.timeout(300)
def test_a_rank_frozen_before_its_first_step_ends_the_job_as_a_start_up_hang(bed: Env, tmp_path: Path) -> None:
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text(FREEZE_SCRIPT)
    t0 = time.monotonic()
    r = dtrain(bed, "submit", "train.py", *BED, "--nproc", "1", "--output", str(bed.runs), "--workdir", str(project),
               "--startup-timeout", str(STARTUP_S), "--name", "startup-hang")  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stdout + r.stderr
    job = r.stdout.strip()
    row = bed.wait(job, lambda j: j["state"] == "FAILED", timeout=180, what="FAILED after the start-up hang")
    took = time.monotonic() - t0
    assert row["exit_code"] == 4 and row["restarts"] == 0 and row["hang_restarts"] == 0, row
    run = Path(row["url"])
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if x.strip()]
    (hang,) = [e for e in events if e["event"] == "hang"]
    assert hang["phase"] == "startup" and hang["timeout_s"] == STARTUP_S and hang["step"] is None, hang
    status = json.loads((run / "status.json").read_text())
    assert (status["state"], status["exit_code"]) == ("failed", 4), status
    assert "before its first step, at start-up" in status["error"], status
    out = bed.dtrain("logs", job, "--cluster", "bed").stdout
    lines = [ln for ln in out.splitlines() if "dtrain: hang on " in ln]
    assert len(lines) == 1 and "before its first step, at start-up; stacks in " in lines[0], out[-3000:]
    deadline = time.monotonic() + 30
    while any(job_processes(bed).values()):
        assert time.monotonic() < deadline, job_processes(bed)
        time.sleep(1)
    print(f"start-up hang on Slurm: the job FAILED (exit 4) {took:.1f} s after `dtrain submit`")
