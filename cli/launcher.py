"""Launch a workload on this machine: torchrun on localhost, one process per GPU (or a couple
of CPU processes), the run directory under --output, and the job's exit code as ours.

Signals: SIGINT/SIGTERM to dtrain are forwarded to torchrun, which forwards them to the workers
(SIGTERM: they checkpoint and exit PREEMPTED). If the job has not ended SHUTDOWN_GRACE_S later,
its process group is killed; workers die with their agent (PR_SET_PDEATHSIG), so nothing is left
behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from dtrain.cli import console
from dtrain.common.errors import ExitCode, UserError
from dtrain.common.rundir import new_run_id, read_json, write_json
from dtrain.common.storage import Store, open_store

SHUTDOWN_GRACE_S = 45.0  # torchrun gives workers 30 s after SIGTERM; GCP gives ~30 s before stop
POLL_S = 0.2


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    run_id: str
    run: Store
    nproc: int
    threads: int
    command: list[str]
    env: dict[str, str]
    resuming: bool


def count_gpus() -> int:
    """GPUs visible to this machine, without importing torch: ask nvidia-smi."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(n, len([v for v in visible.split(",") if v.strip()])) if visible else n


def auto_nproc(gpus: int, cpus: int) -> int:
    """One process per GPU; on CPU, two processes (real DDP) when there are two cores or more,
    each with half the cores as threads."""
    if gpus:
        return gpus
    return 2 if cpus >= 2 else 1


def run_target(
    workload: str, workload_args: dict[str, Any], output: str, resumed: Store | None
) -> tuple[str, Store, dict[str, Any]]:
    """The run's id and directory, and the workload's arguments that name them: `--resume <url>`
    for the run being continued, else `--run-id` (given, or a new one) under `output`."""
    if resumed is not None:
        run_id = resumed.url.rstrip("/").rsplit("/", 1)[-1]
        return run_id, resumed, {**workload_args, "output": output, "resume": resumed.url}
    run_id = workload_args.get("run_id") or new_run_id(workload)
    run = open_store(f"{output.rstrip('/')}/{run_id}")
    return run_id, run, {**workload_args, "output": output, "run_id": run_id}


def plan_local(
    workload: str,
    workload_args: dict[str, Any],
    *,
    nproc: int,
    max_restarts: int,
    output: str,
    resumed: Store | None,
) -> LocalPlan:
    """`resumed`: the run directory being continued (already located), or None for a new run."""
    from dtrain.common.config import to_argv

    run_id, run, args = run_target(workload, workload_args, output, resumed)
    gpus = count_gpus()
    cpus = os.cpu_count() or 1
    n = nproc or auto_nproc(gpus, cpus)
    threads = max(1, cpus // n)  # OMP threads per process: the cores shared out, never oversubscribed
    command = [
        sys.executable,
        "-m",
        "dtrain.common.launch",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(n),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "--rdzv-id",
        run_id,
        "--max-restarts",
        str(max_restarts),
        "-m",
        f"dtrain.{workload}.train",
        *to_argv(args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env["DTRAIN_INTERNAL_TTY"] = "1" if sys.stdout.isatty() else "0"
    if console.state.debug:
        env["DTRAIN_DEBUG"] = "1"
    return LocalPlan(run_id, run, n, threads, command, env, resuming=resumed is not None)


def run_local(plan: LocalPlan) -> int:
    """Run the plan to the end; returns the job's exit code (see ExitCode)."""
    proc = subprocess.Popen(plan.command, env=plan.env, start_new_session=True)
    forwarded: list[int] = []
    deadline = [float("inf")]

    def forward(signum: int, _frame: Any) -> None:
        if forwarded and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            _kill_group(proc, signal.SIGKILL)
        forwarded.append(signum)
        deadline[0] = min(deadline[0], time.monotonic() + SHUTDOWN_GRACE_S)
        _kill_group(proc, signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline[0]:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(POLL_S)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait()
    return _outcome(plan.run, proc.returncode, forwarded)


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _outcome(run: Store, code: int, forwarded: Sequence[int]) -> int:
    """The job's exit code, reconciled with what the workload recorded in status.json: a SIGTERM'd
    torchrun exits 143 even though its workers checkpointed and exited PREEMPTED."""
    status = read_json(run, "status.json") or {}
    state = status.get("state")
    if state == "preempted":
        return int(ExitCode.PREEMPTED)
    if state == "completed" and code == 0:
        return 0
    if code < 0:  # torchrun itself was killed by a signal
        code = int(ExitCode.INTERRUPTED) if -code == signal.SIGINT else int(ExitCode.FAILURE)
    if signal.SIGINT in forwarded and code not in (0, int(ExitCode.USAGE)):
        code = int(ExitCode.INTERRUPTED)
    elif code == 128 + signal.SIGTERM:
        code = int(ExitCode.FAILURE)
    if state == "running" and code != 0:
        # Rank 0 died without recording its end (killed, OOM): record it so `dtrain runs` is right.
        with contextlib.suppress(OSError, UserError):
            write_json(
                run,
                "status.json",
                {
                    **status,
                    "state": "failed",
                    "exit_code": code,
                    "updated": time.time(),
                    "error": "the job was killed or crashed",
                },
            )
    return code
