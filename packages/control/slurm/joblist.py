"""`dtrain jobs`: the jobs dtrain submitted to a cluster with Slurm's view of each (`list_jobs`, one `JobRow`
a job), their node-hours and cost, and whether each is stalled (`stalled`, which autostop reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import queue
import shlex
import threading
import time
from collections.abc import Mapping
from typing import Any

from dtrain.common.storage import is_remote
from dtrain.control.cluster import Cluster
from dtrain.control.slurm.commands import JobState
from dtrain.control.slurm.commands import expand_hostlist as expand_nodelist  # its home: commands
from dtrain.control.slurm.session import JobRecord, Session, sacct_since
from dtrain.control.slurm.spec import STALL_AFTER_S

RECENT_S = 24 * 3600  # `dtrain jobs` without --all: active jobs, and jobs submitted in the last day
METRICS_WAIT_S = 10.0  # `dtrain jobs`: the most it waits for the last metrics lines of runs in buckets
METRICS_READERS = 8  # ... read by this many threads at most


@dataclasses.dataclass(frozen=True)
class JobRow:
    """One line of `dtrain jobs`."""

    record: JobRecord
    state: JobState | None  # None: Slurm no longer knows the job (no accounting kept it)
    last_metric: dict[str, Any]  # the run's last metrics.jsonl line ({} before its first)
    node_hours: float = 0.0  # Slurm's elapsed time of the job's current (or last) start x its nodes
    usd: float | None = None  # node_hours at the cluster's node prices (an estimate); None: no price known
    stalled_since: float | None = None  # running, and its metrics have not advanced since (epoch seconds)

    @property
    def stalled(self) -> bool:
        return self.stalled_since is not None

    def as_dict(self) -> dict[str, Any]:
        s = self.state
        return {
            "job_id": self.record.job_id,
            "name": self.record.name,
            "workload": self.record.workload,
            "state": s.state if s else "UNKNOWN",
            "reason": s.reason if s else "",
            "nodes": (s.nodes if s and s.nodes else self.record.nodes),
            "nodelist": s.nodelist if s else "",
            "submitted": _local(self.record.submitted),  # when it was submitted (a requeue resets Slurm's)
            "started": s.started if s else "",
            "ended": s.ended if s else "",
            "duration": s.elapsed if s else "",
            "exit_code": s.exit_code if s else None,
            "restarts": s.restarts if s else 0,
            "continuations": s.continuations if s else 0,  # requeued at the time limit to continue the run
            "time_limit": time_limit_state(s),
            "hang_restarts": s.hang_restarts if s else 0,  # requeued after a hang (dtrain:hangs:N in its comment)
            "stragglers": s.stragglers if s else "",  # "h1 rank 1 (2.3x)": as the batch step last saw them
            "run_id": self.record.run_id,
            "url": self.record.url,
            "eval_id": self.record.eval_id,
            "kind": self.record.kind or "builtin",  # "program": a user's own
            "last_metric": self.last_metric,
            "node_hours": round(self.node_hours, 4),
            "usd": None if self.usd is None else round(self.usd, 4),
            "stalled": self.stalled,
            "stalled_since": _local(self.stalled_since) if self.stalled_since is not None else "",
        }


def time_limit_state(s: JobState | None) -> str:
    """A job's time-limit continuations in words, "" for a job that has had none: `continuing (time limit, N)`
    while it waits to start again or runs again, `completed (time limit, N)` and the like once it ended, and
    `stopped at the time limit (N, max_continuations)` when it reached its limit of continuations."""
    if s is None or not s.comment:
        return ""
    n = s.continuations
    if s.continuations_stopped:
        return f"stopped at the time limit ({n}, max_continuations)"
    if not n:
        return ""
    if s.active:
        return f"continuing (time limit, {n})"
    return f"{s.state.lower()} (time limit, {n})"


def _local(epoch: float) -> str:
    """This machine's local time, as Slurm prints times (Slurm's own are in the cluster's time zone)."""
    return datetime.datetime.fromtimestamp(epoch).strftime("%Y-%m-%dT%H:%M:%S")


def list_jobs(
    cluster: Cluster, *, all_jobs: bool = False, accept_new_host_keys: bool = False, now: float | None = None
) -> list[JobRow]:
    """The jobs dtrain submitted to `cluster`, oldest first, with Slurm's view of each: every one with
    `all_jobs`, else those still queued or running and those submitted in the last day. Each with its
    node-hours, their estimated cost, and whether it is stalled (`now`: epoch seconds, for tests)."""
    with Session(cluster, accept_new_host_keys=accept_new_host_keys) as s:
        records = s.records()
        if not records:
            return []
        states = s.slurm.jobs([r.job_id for r in records], since=sacct_since(min(r.submitted for r in records)))
        now = time.time() if now is None else now
        shown = [
            r
            for r in records
            if all_jobs or now - r.submitted < RECENT_S or (r.job_id in states and states[r.job_id].active)
        ]
        metrics = _last_metrics(s, [r for r in shown if not r.eval_id])  # an evaluation logs no metrics
        rows = []
        for r in shown:
            rows.append(job_row(cluster, r, states.get(r.job_id), {} if r.eval_id else metrics.get(r.run_id), now))
        return rows


def stalled(cluster: Cluster, *, now: float | None = None, accept_new_host_keys: bool = False) -> list[JobRow]:
    """The running jobs on `cluster` whose runs have logged no metrics line for the cluster's
    stall_after (SlurmSpec.stall_after; the table's `stall_after`, default 30m). A stalled job holds
    its nodes but does no work: idle detection (autostop) must not count it as activity."""
    rows = list_jobs(cluster, accept_new_host_keys=accept_new_host_keys, now=now)
    return [r for r in rows if r.stalled]


def job_row(
    cluster: Cluster, rec: JobRecord, state: JobState | None, last: dict[str, Any] | None, now: float
) -> JobRow:
    """A job's line: its node-hours and their cost at the cluster's node prices, and its stall. `last`:
    the run's last metrics line, None if the run could not be read (then it is not called stalled)."""
    seconds = elapsed_seconds(state.elapsed) if state else 0
    nodes = (state.nodes or rec.nodes) if state else 0
    hours = seconds * nodes / 3600
    usd = None
    if cluster.node_usd_per_hour:
        usd = seconds / 3600 * sum(job_node_prices(cluster.node_usd_per_hour, state.nodelist if state else "", nodes))
    stall_after = cluster.slurm.stall_after if cluster.slurm else STALL_AFTER_S
    # An evaluation logs no metrics while it works: it is never "stalled" for want of them.
    since = None if rec.eval_id or last is None else stall_since(state, last, stall_after=stall_after, now=now)
    return JobRow(rec, state, last or {}, node_hours=hours, usd=usd, stalled_since=since)


def stall_since(state: JobState | None, last: dict[str, Any], *, stall_after: float, now: float) -> float | None:
    """When a running job's metrics last advanced, if that is `stall_after` seconds or more before `now`;
    else None. "Advanced": the time of the run's last metrics.jsonl line, or the job's current start
    (now - Slurm's elapsed, free of the cluster's time zone) when that is later: a job that was requeued
    or has not logged its first line yet counts from when it started."""
    if state is None or state.state != "RUNNING":
        return None
    started = now - elapsed_seconds(state.elapsed)
    logged = last.get("time")
    advanced = (
        max(started, float(logged)) if isinstance(logged, (int, float)) and not isinstance(logged, bool) else started
    )
    return advanced if now - advanced >= stall_after else None


def elapsed_seconds(text: str) -> int:
    """Slurm's durations ([D-][HH:]MM:SS, as sacct's Elapsed and scontrol's RunTime print them) in
    seconds; 0 for what is not one (empty, INVALID)."""
    days, _, rest = text.strip().rpartition("-")
    parts = rest.split(":")
    if not all(p.isdigit() for p in parts) or not 2 <= len(parts) <= 3 or (days and not days.isdigit()):
        return 0
    h, m, s = ([0] * (3 - len(parts))) + [int(p) for p in parts]
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def job_node_prices(prices: Mapping[str, float], nodelist: str, nodes: int) -> list[float]:
    """The hourly price of each of a job's `nodes` nodes: by name from Slurm's nodelist where the cluster
    prices that node, and the mean of the cluster's node prices for the rest (a node Slurm names
    otherwise, or a job that has not started)."""
    named = [prices[n] for n in expand_nodelist(nodelist) if n in prices]
    mean = sum(prices.values()) / len(prices)
    return named[:nodes] + [mean] * max(0, nodes - len(named))


def _last_metrics(s: Session, records: list[JobRecord]) -> dict[str, dict[str, Any] | None]:
    """Each run's last metrics.jsonl line ({} before its first; None: the run could not be read): gs://
    runs read from here, paths on the login node in one SSH round trip."""
    out: dict[str, dict[str, Any] | None] = dict(_remote_last_metrics([r for r in records if is_remote(r.url)]))
    paths = [r for r in records if not is_remote(r.url)]
    if paths:
        command = "; ".join(
            f"echo {shlex.quote(r.run_id)} $(tail -n 1 {shlex.quote(r.url + '/metrics.jsonl')} 2>/dev/null)"
            for r in paths
        )
        for line in s.slurm.run(command).splitlines():
            run_id, _, text = line.partition(" ")
            out[run_id] = last_line(text)
    return out


def _remote_last_metrics(
    records: list[JobRecord], *, wait_s: float = METRICS_WAIT_S, readers: int = METRICS_READERS
) -> dict[str, dict[str, Any] | None]:
    """The last metrics line of runs in buckets, read side by side by at most `readers` threads, waiting
    at most `wait_s` in all: a bucket that cannot be reached (deleted, an emulator gone, no route) is
    retried by the storage library for minutes, and `dtrain jobs` must not wait for it. A run not read
    in time, or not readable, is None. The threads are daemons: one still waiting ends with the process."""
    from dtrain.common.storage import open_store

    out: dict[str, dict[str, Any] | None] = dict.fromkeys((r.run_id for r in records), None)
    todo: queue.Queue[JobRecord] = queue.Queue()
    for r in records:
        todo.put(r)

    def read() -> None:
        while True:
            try:
                r = todo.get_nowait()
            except queue.Empty:
                return
            with contextlib.suppress(Exception):
                out[r.run_id] = last_line(open_store(r.url).read_bytes("metrics.jsonl").decode())

    threads = [threading.Thread(target=read, daemon=True) for _ in range(min(readers, len(records)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + wait_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return dict(out)


def last_line(text: str) -> dict[str, Any]:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    try:
        value = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
