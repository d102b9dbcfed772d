"""A start-up hang on the real Slurm bed (tests/slurm/conftest.py; docs/hangs.md): a user's program submitted to two
nodes whose last rank freezes its torchrun and itself (SIGSTOP) before its first step. With --startup-timeout 5 the
node agent names it as a start-up hang; the batch step records it and ends the job (exit 4, not requeued: its
--max-restarts is 0), the run failed for that reason. Real slurmctld, slurmd, sbatch/srun, torchrun.

Needs root (network namespaces; CI runs as root), Debian's slurm-wlm and munge."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
from projects import make_freeze_project

from dtrain.common.nodeagent import HANG_GRACE_S, RANKS_ENDED_WAIT_S
from dtrain.common.slurmstep import NODES_ENDED_WAIT_S

from .conftest import Env
from .test_slurm_bed import job_processes
from .test_slurm_hangs import rows, wait_for
from .test_slurm_programs import BED, dtrain

pytestmark = [pytest.mark.root, pytest.mark.slow]

STARTUP_S = 5


@pytest.mark.timeout(300)
def test_a_rank_frozen_before_its_first_step_ends_the_job_as_a_start_up_hang(bed: Env, tmp_path: Path) -> None:
    project = make_freeze_project(tmp_path / "proj")
    t0 = time.monotonic()
    r = dtrain(bed, "submit", "train.py", *BED, "--nproc", "1", "--output", str(bed.runs), "--workdir", str(project),
               "--startup-timeout", str(STARTUP_S), "--name", "startup-hang")  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stdout + r.stderr
    job = r.stdout.strip()
    row = bed.wait(job, lambda j: j["state"] == "FAILED", timeout=180, what="FAILED after the start-up hang")
    took = time.monotonic() - t0
    assert row["exit_code"] == 4 and row["restarts"] == 0 and row["hang_restarts"] == 0, row
    run = Path(row["url"])
    events = rows(run / "events.jsonl")
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


def _launchers(bed: Env, host: str) -> list[int]:
    """dtrain.common.launch (torchrun, in-process) on `host`: the process that starts the ranks."""
    found = []
    for pid in bed.sb.bed.pids(bed.sb.host(host)):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "dtrain.common.launch" in cmd:
            found.append(pid)
    return found


# Every rank joins the process group (a real rendezvous, and torchrun's exit barrier at the end), says it is up, logs
# a few steps and exits 0.
FINISH_SCRIPT = """\
import os
import time

import torch.distributed as dist

from dtrain import sdk

dist.init_process_group("gloo")
print(f"rank {os.environ['RANK']} up", flush=True)
for step in range(1, 31):
    time.sleep(0.2)
    sdk.log(step, loss=1.0 / step)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
def test_a_frozen_torchrun_whose_ranks_finished_does_not_hold_the_job(bed: Env, tmp_path: Path) -> None:
    """torchrun frozen on h1 (SIGSTOP) while its rank works: the ranks finish, and the job ends COMPLETED (exit 0)
    within a bound, its run completed, instead of holding both nodes for minutes (h1's agent stops its torchrun;
    the batch step ends h0's step, whose torchrun waits in its exit barrier for h1's)."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "train.py").write_text(FINISH_SCRIPT)
    r = dtrain(bed, "submit", "train.py", *BED, "--nproc", "1", "--output", str(bed.runs), "--workdir", str(project),
               "--name", "frozen-torchrun")  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stdout + r.stderr
    job = r.stdout.strip()
    run = Path(bed.wait(job, lambda j: j["state"] == "RUNNING", timeout=120, what="RUNNING")["url"])
    pids = wait_for(lambda: rows(run / "metrics.jsonl") and _launchers(bed, "h1"), 120, "a step, and torchrun on h1")
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        row = bed.wait(job, lambda j: j["state"] == "COMPLETED", timeout=200, what="COMPLETED")
        ended = time.time()
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert row["exit_code"] == 0, row
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed", status
    held = ended - max(m["time"] for m in rows(run / "metrics.jsonl"))
    print(f"frozen torchrun on h1: the job ended {held:.1f} s after the run's last metrics row")
    out = bed.dtrain("logs", job, "--cluster", "bed").stdout
    assert "all exited 0 30 s ago, but their launcher has not ended: stopping it" in out, out[-3000:]
    assert "ended 30 s ago and the other nodes' steps ended 0, but their steps go on: ending them" in out, out[-3000:]
    assert held < max(RANKS_ENDED_WAIT_S + HANG_GRACE_S, NODES_ENDED_WAIT_S) + 30, held
