"""Launch a workload on this machine: torchrun on localhost, one process per GPU (or a couple of CPU
processes), the run directory under --output, and the job's exit code as ours.

Stopping: the caller's Handle (dtrain.control.events) is polled; INTERRUPT and TERMINATE are sent
to torchrun as SIGINT and SIGTERM, which forwards them to the workers (SIGTERM: they checkpoint and
exit PREEMPTED). If the job has not ended SHUTDOWN_GRACE_S later, or on KILL, its process group is
killed. torchrun runs in a session of its own and gets SIGTERM from the kernel if this process dies
(PR_SET_PDEATHSIG), and its workers get SIGKILL if it dies (dtrain.common.launch): no process of the
job outlives the launcher, however the launcher ends.

Hangs (docs/hangs.md): the launcher watches the ranks' progress itself (dtrain.control.hangwatch). A hung job
is stopped (SIGTERM, SIGKILL HANG_GRACE_S later) and ends ExitCode.HUNG, or, while torchrun has restarts
left (--max-restarts), its ranks are killed and torchrun starts them again from the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dtrain.common import jobenv
from dtrain.common.errors import ExitCode, UserError
from dtrain.common.nproc import MAX_PROCS_PER_CORE, auto_nproc, processes  # noqa: F401  # their home: common
from dtrain.common.procs import dies_with_parent
from dtrain.common.rundir import read_json, run_location, write_json
from dtrain.common.storage import Store
from dtrain.control.events import Events, Handle, Stop

# torchrun's restarts (--max-restarts) with a fresh rendezvous store each time. By default (torch >= 2.4) the
# workers of every restart share the agent's one TCPStore, unprefixed: a restarted rank can read its peer's
# gloo address from the previous generation before the peer rewrites it, and fails with "Connection refused"
# (2 of 4 restarts of the torchrun script in tests/control/test_local_hangs.py). With this, rank 0 hosts a new
# store for every start.
RESTARTABLE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
SHUTDOWN_GRACE_S = jobenv.STOP_GRACE_S  # SIGTERM, then this long before SIGKILL
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
    max_restarts: int = 0  # torchrun's restarts (after a crash or a hang)
    hang_timeout: float | None = None  # None: from the step time; 0: no hang detection (docs/hangs.md)


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


def run_target(
    workload: str, workload_args: Mapping[str, Any], output: str, resumed: Store | None
) -> tuple[str, Store, dict[str, Any]]:
    """The run's id and directory, worked out once here and passed down: the workload receives the
    directory itself (`--run-dir`), and `--resume` when it continues one."""
    if resumed is not None:
        run_id = resumed.url.rstrip("/").rsplit("/", 1)[-1]
        return run_id, resumed, {**workload_args, "output": output, "resume": resumed.url, "run_dir": resumed.url}
    run_id, run = run_location(workload, output, workload_args.get("run_id") or "")
    return run_id, run, {**workload_args, "output": output, "run_id": run_id, "run_dir": run.url}


def plan_local(
    workload: str,
    workload_args: Mapping[str, Any],
    *,
    module: str,
    nproc: int,
    max_restarts: int,
    output: str,
    resumed: Store | None,
    oversubscribe: bool = False,
    tty: bool = False,
    debug: bool = False,
    hang_timeout: float | None = None,
) -> LocalPlan:
    """`resumed`: the run directory being continued (already located), or None for a new run.
    `tty`: the caller's output is a terminal (rank 0 then draws a live progress bar)."""
    from dtrain.common.config import to_argv

    if importlib.util.find_spec("torch") is None:
        raise UserError(
            f"training on this machine needs torch, which this Python ({sys.executable}) lacks: "
            "pip install 'dtrain[train]' (scripts/setup.sh does it), or train on a cluster with --cluster NAME"
        )
    gpus = count_gpus()
    cpus = os.cpu_count() or 1
    n = processes(nproc, gpus=gpus, cpus=cpus, oversubscribe=oversubscribe)
    run_id, run, args = run_target(workload, workload_args, output, resumed)
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
        module,
        *to_argv(args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    env["DTRAIN_INTERNAL_TTY"] = "1" if tty else "0"
    if max_restarts:
        env.update(RESTARTABLE_ENV)
    if debug:
        env["DTRAIN_DEBUG"] = "1"
    return LocalPlan(
        run_id, run, n, threads, command, env, resuming=resumed is not None, max_restarts=max_restarts,
        hang_timeout=hang_timeout,
    )  # fmt: skip


def run_local(plan: LocalPlan, *, handle: Handle, events: Events | None = None) -> int:
    """Run the plan to the end; returns the job's exit code (see ExitCode). The job's output goes
    to this process's own stdout and stderr; a hang's line and stragglers go to `events`."""
    from dtrain.common.nodeagent import HANG_GRACE_S
    from dtrain.control.hangwatch import Action, LocalHangWatch

    env = dict(plan.env)
    watch = LocalHangWatch.start(plan.hang_timeout, env, plan.run, events or Events(), restarts=plan.max_restarts)
    try:
        proc = subprocess.Popen(
            plan.command, env=env, start_new_session=True, preexec_fn=dies_with_parent(signal.SIGTERM)
        )
    except BaseException:
        if watch is not None:
            watch.close()
        raise
    forwarded: list[int] = []
    deadline = float("inf")
    hung = False
    try:
        while proc.poll() is None:
            if watch is not None and not hung and watch.check(proc.pid) == Action.STOP:
                hung = True  # nothing to save: SIGTERM, and SIGKILL soon (a stuck rank answers neither)
                _kill_group(proc, signal.SIGTERM)
                deadline = min(deadline, time.monotonic() + HANG_GRACE_S)
            for stop in handle.take():
                if stop == Stop.KILL:
                    _kill_group(proc, signal.SIGKILL)
                    continue
                signum = signal.SIGINT if stop == Stop.INTERRUPT else signal.SIGTERM
                forwarded.append(signum)
                deadline = min(deadline, time.monotonic() + SHUTDOWN_GRACE_S)
                _kill_group(proc, signum)
            if time.monotonic() > deadline:
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            _kill_group(proc, signal.SIGKILL)
            proc.wait()
        if watch is not None:
            watch.sweep()
            watch.close()
    return outcome(plan.run, proc.returncode, forwarded, hung=watch.error if watch is not None else "")


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def outcome(run: Store, code: int, forwarded: Sequence[int], *, hung: str = "") -> int:
    """The job's exit code, reconciled with what the workload recorded in status.json: a SIGTERM'd
    torchrun exits 143 even though its workers checkpointed and exited PREEMPTED. `hung`: the job was
    stopped for a hang (status.json's error, "hung: ..."): it ends ExitCode.HUNG, whatever its ranks said."""
    status = read_json(run, "status.json") or {}
    state = status.get("state")
    if hung or (code == ExitCode.HUNG and state in (None, "running")):
        # Without `hung`: a cluster's agent stopped it (exit 4); the launcher's line and the run's events say where.
        _failed(run, status, int(ExitCode.HUNG), hung or "hung: a rank made no progress for its hang timeout "
                "(the hang event in events.jsonl names it; its stacks are under hangs/)")  # fmt: skip
        return int(ExitCode.HUNG)
    if state == "preempted":
        return int(ExitCode.PREEMPTED)
    if state == "completed" and (code == 0 or signal.SIGTERM in forwarded):
        return 0  # a stop that came after the run had finished (its teardown) does not undo it
    if code < 0:  # torchrun itself was killed by a signal
        code = int(ExitCode.INTERRUPTED) if -code == signal.SIGINT else int(ExitCode.FAILURE)
    if signal.SIGINT in forwarded and code not in (0, int(ExitCode.USAGE)):
        code = int(ExitCode.INTERRUPTED)
    elif code == 128 + signal.SIGTERM:
        code = int(ExitCode.FAILURE)
    if state == "running" and code != 0:
        # Rank 0 died without recording its end (killed, OOM): record it so `dtrain runs` is right.
        _failed(run, status, code, "the job was killed or crashed")
    return code


def _failed(run: Store, status: dict[str, Any], code: int, error: str) -> None:
    with contextlib.suppress(OSError, UserError):
        write_json(run, "status.json", {**status, "state": "failed", "exit_code": code, "updated": time.time(),
                                        "error": error})  # fmt: skip
