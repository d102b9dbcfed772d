"""`dtrain train` through Slurm once the job is queued: its output here live until it ends, Ctrl-C stops it,
its exit code is the command's.
"""

from __future__ import annotations

import contextlib
import subprocess
import time

from dtrain.common.errors import ExitCode
from dtrain.control.events import Events, Handle, Stop
from dtrain.control.launch_result import LaunchResult
from dtrain.control.slurm.commands import JobState
from dtrain.control.slurm.joblogs import follow_job
from dtrain.control.slurm.session import JobRecord, Session
from dtrain.control.slurm.submit import SubmitResult


def attend(
    s: Session, sub: SubmitResult, rec: JobRecord, t0: float, *, what: str, events: Events, handle: Handle
) -> LaunchResult:
    """`dtrain train` through Slurm once the job is queued: its output here live until it ends, Ctrl-C stops
    it, its exit code is ours; the job is cancelled if this process goes away (its SSH connection closes)."""
    verb = "resuming" if sub.resuming else "starting"
    events.emit(
        "launch",
        f"{verb} {what} run {sub.run_id} on cluster {sub.cluster} through Slurm: job {sub.job_id}, "
        f"{sub.nodes} node(s) in partition {sub.partition} (submitted in {time.monotonic() - t0:.1f} s)",
        run_id=sub.run_id,
        workload=sub.workload,
        nodes=sub.nodes,
        job_id=sub.job_id,
    )
    guard = s.ssh.popen(
        s.login,
        f"cat >/dev/null; scancel {sub.job_id}",
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C reaches dtrain, which stops the job; this only guards
    )
    try:
        interrupted: list[Stop] = []
        unsubscribe = handle.subscribe(interrupted.append)
        try:
            state = follow_job(s, rec, events=events, handle=handle, control=True)
        finally:
            unsubscribe()
    finally:
        with contextlib.suppress(OSError):
            guard.stdin.close()  # type: ignore[union-attr]
        guard.wait(timeout=30)
    return LaunchResult(sub.workload, sub.run_id, sub.url, _exit_code(state, interrupted), sub.cluster)


def _exit_code(state: JobState | None, stops: list[Stop]) -> int:
    """dtrain's exit code for how the job ended: Slurm's exit code of the batch step, which is the job's
    (dtrain.common.slurmstep), unless the caller stopped it."""
    if any(s in (Stop.INTERRUPT, Stop.KILL) for s in stops):
        return int(ExitCode.INTERRUPTED)
    if state is None:
        return int(ExitCode.FAILURE)
    if state.state == "COMPLETED":
        return int(ExitCode.OK)
    if state.state in ("CANCELLED", "TIMEOUT", "PREEMPTED"):
        return int(ExitCode.PREEMPTED)  # SIGTERM: the ranks checkpointed; `--resume` continues the run
    code = state.exit_code
    return code if code in (int(ExitCode.USAGE), int(ExitCode.PREEMPTED)) else int(ExitCode.FAILURE)
