"""A job's logs: every node's lines in time order (`job_logs`), or followed live as `output` events until the
job ends (`follow_logs`; `follow_job`, which `dtrain train` through Slurm also uses, can stop the job).

Every node's task writes its lines, stamped, to `logs/<node>.log` in the job's directory (see
dtrain.common.slurmstep). On a cluster whose login node shares its workdir with the compute nodes (a
user's Slurm) they are all read there; on dtrain's own clusters, on each node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import shlex
import subprocess
import threading
import time
from typing import TYPE_CHECKING

from dtrain.common.errors import UserError
from dtrain.common.slurmstep import PROGRESS_PREFIX
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Events, Handle, Stop
from dtrain.control.slurm.commands import JobState
from dtrain.control.slurm.joblist import time_limit_state
from dtrain.control.slurm.session import POLL_S, JobRecord, Session

if TYPE_CHECKING:
    from dtrain.control.runs import LogLine

DRAIN_S = 1.0  # after the job ended: its last lines still on their way
FOLLOW_RESTART_S = 5.0  # a follower whose connection dropped is started again this much later
INT_GRACE_S = 5.0  # Ctrl-C: the job gets SIGINT, then is cancelled this much later (as the SSH launcher)


def job_logs(cluster: Cluster, job_id: str, *, accept_new_host_keys: bool = False) -> list[LogLine]:
    """Every node's lines of a job (all its starts), in time order."""
    with Session(cluster, accept_new_host_keys=accept_new_host_keys) as s:
        rec = s.record(job_id)
        command = _follow_command(s, rec, once=True)
        outs = s.ssh.each(lambda n: s.ssh.run(n, command, timeout=120, check=False), s.file_nodes)
    lines = []
    for p in outs.values():
        for raw in p.stdout.decode(errors="replace").splitlines():
            parsed = _parse(raw)
            if parsed is not None and not parsed.text.startswith(PROGRESS_PREFIX):
                lines.append(parsed)
    return sorted(lines, key=lambda ln: ln.stamp)


def _follow_command(s: Session, rec: JobRecord, *, once: bool) -> str:
    py = shlex.quote(s.login.python)
    return f'cd {shlex.quote(rec.dir)} && PYTHONPATH="$PWD/code" exec {py} -m dtrain.common.slurmstep follow logs' + (
        " --once" if once else ""
    )


def _parse(raw: str) -> LogLine | None:
    """`<node> <stamp> <text>` as the follower prints it."""
    from dtrain.control.runs import LogLine

    node, _, rest = raw.partition(" ")
    stamp, _, text = rest.partition(" ")
    return LogLine(stamp, node, text) if node and stamp else None


@dataclasses.dataclass(frozen=True)
class FollowResult:
    job_id: str
    state: JobState | None  # how the job ended (None: Slurm has no record of it)
    stopped: bool  # the caller stopped following before the job ended


def follow_logs(
    cluster: Cluster, job_id: str, *, events: Events, handle: Handle, accept_new_host_keys: bool = False
) -> FollowResult:
    """Every node's lines of a job as `output` events, as they are written, until the job ends (or the
    caller stops following: the job goes on)."""
    with Session(cluster, accept_new_host_keys=accept_new_host_keys) as s:
        rec = s.record(job_id)
        state = follow_job(s, rec, events=events, handle=handle, control=False)
        return FollowResult(job_id, state, stopped=handle.stopped)


class _Followers:
    """A follower (dtrain.common.slurmstep follow) on each host that holds the job's logs, their lines in one
    queue. One whose connection dropped (its node rebooted, say) is started again, and the lines it had
    already given are skipped (the log files only grow)."""

    def __init__(self, s: Session, rec: JobRecord) -> None:
        self.s, self.command = s, _follow_command(s, rec, once=False)
        self.lines: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self.procs: dict[str, subprocess.Popen] = {}
        self.counts: dict[tuple[str, str], int] = {}  # (host, the log's node) -> lines given
        self.skip: dict[tuple[str, str], int] = {}
        self.restart_at: dict[str, float] = {}
        for node in s.file_nodes:
            self._start(node)

    def _start(self, node: Node) -> None:
        p = self.s.ssh.popen(
            node,
            self.command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is for dtrain: the job's last lines still come
        )
        self.procs[node.name] = p
        threading.Thread(target=_read, args=(node.name, p, self.lines), daemon=True).start()

    def drain(self, events: Events, wait: float) -> None:
        """Report every line that has come (waiting up to `wait` for the first); restart dropped followers."""
        try:
            host, raw = self.lines.get(timeout=wait)
        except queue.Empty:
            host, raw = "", None
        while host:
            if raw is None:
                self.restart_at[host] = time.monotonic() + FOLLOW_RESTART_S
            else:
                key = (host, raw.partition(" ")[0])
                if self.skip.get(key, 0) > 0:
                    self.skip[key] -= 1
                else:
                    self.counts[key] = self.counts.get(key, 0) + 1
                    _show(raw, events)
            try:
                host, raw = self.lines.get_nowait()
            except queue.Empty:
                host = ""
        for name, at in list(self.restart_at.items()):
            if time.monotonic() >= at:
                del self.restart_at[name]
                self.skip.update({k: v for k, v in self.counts.items() if k[0] == name})
                self._start(next(n for n in self.s.file_nodes if n.name == name))

    def close(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(OSError):
                p.stdin.close()  # type: ignore[union-attr]  # the follower exits when its stdin closes
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def follow_job(s: Session, rec: JobRecord, *, events: Events, handle: Handle, control: bool) -> JobState | None:
    """Follow a job's logs until it ends. `control`: the caller's stop requests stop the job (dtrain
    train); otherwise they stop the following only."""
    followers = _Followers(s, rec)
    last: JobState | None = None
    kill_at = float("inf")
    next_poll = 0.0
    ended_at = float("inf")
    try:
        while time.monotonic() < ended_at + DRAIN_S:
            for stop in handle.take():
                if not control:
                    return last
                kill_at = min(kill_at, _stop_job(s, rec, stop, events))
            if time.monotonic() > kill_at:
                s.slurm.cancel(rec.job_id, ended_ok=True)
                kill_at = float("inf")
            followers.drain(events, wait=0.1)
            if time.monotonic() >= next_poll and ended_at == float("inf"):
                next_poll = time.monotonic() + POLL_S
                state = s.state(rec)
                _report(last, state, events)
                last = state
                if state is None or state.settled:
                    ended_at = time.monotonic()
        followers.drain(events, wait=0)
        return last
    finally:
        followers.close()


def _read(node: str, p: subprocess.Popen, out: queue.Queue) -> None:
    for raw in p.stdout:  # type: ignore[union-attr]
        out.put((node, raw.decode(errors="replace").rstrip("\r\n")))
    out.put((node, None))


def _show(raw: str, events: Events) -> None:
    line = _parse(raw)
    if line is None:
        return
    if line.text.startswith(PROGRESS_PREFIX):
        with contextlib.suppress(ValueError):
            ev = json.loads(line.text[len(PROGRESS_PREFIX) :])
            if isinstance(ev, dict):
                events.emit("progress", **ev)
        return
    events.emit("output", line.text, node=line.node)


def _report(before: JobState | None, now: JobState | None, events: Events) -> None:
    """A stage event when the job's state changes (queued and why, running where, requeued)."""
    if now is None or (
        before is not None and (before.state, before.restarts, before.comment) == (now.state, now.restarts, now.comment)
    ):
        return
    if before is not None and (
        now.continuations > before.continuations or now.continuations_stopped > before.continuations_stopped
    ):
        n = now.continuations
        events.emit(
            "time-limit",
            f"dtrain: job {now.job_id} reached its time limit: {time_limit_state(now)}",
            job_id=now.job_id,
            continuations=n,
            continued=not now.continuations_stopped,
        )
    if before is not None and now.restarts > before.restarts:
        why = " after a hang" if now.hang_restarts > before.hang_restarts else ""
        events.emit("stage", f"dtrain: job {now.job_id} was requeued{why} (restart {now.restarts}): it resumes the run")
    if now.state in ("PENDING", "REQUEUED"):
        events.emit("stage", f"dtrain: job {now.job_id} is queued ({now.reason or now.state})")
    elif now.state == "RUNNING" and (before is None or before.state != "RUNNING"):
        events.emit("stage", f"dtrain: job {now.job_id} is running on {now.nodelist}")


def _stop_job(s: Session, rec: JobRecord, stop: Stop, events: Events) -> float:
    """Pass the caller's stop request to the job; returns when to cancel it outright (inf: not needed)."""
    if stop == Stop.KILL:
        s.slurm.cancel(rec.job_id, "KILL", ended_ok=True)
        s.slurm.cancel(rec.job_id, ended_ok=True)
        return float("inf")
    if stop == Stop.INTERRUPT:
        events.info("dtrain: interrupted: stopping the job on every node")
        try:
            s.slurm.cancel(rec.job_id, "INT", ended_ok=True)
        except UserError:  # still queued: no process to signal; it just leaves the queue
            s.slurm.cancel(rec.job_id, ended_ok=True)
        return time.monotonic() + INT_GRACE_S
    events.info("dtrain: SIGTERM: the job checkpoints and stops on every node")
    s.slurm.cancel(rec.job_id, ended_ok=True)  # Slurm's own termination: SIGTERM, then SIGKILL after KillWait
    return float("inf")
