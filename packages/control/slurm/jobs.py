"""Jobs on a cluster with Slurm: submit, list, cancel, logs (followed live or not), and `dtrain train`
through Slurm (an allocation, then the same torchrun, followed on the terminal until it ends).

    result = submit(LaunchRequest(workload="mnist", flags={...}), nodes=2, name="lr-3e-3", events=..., handle=...)
    rows = list_jobs(cluster)                       # JobRow: Slurm's state, restarts, the run, its last metric
    cancel(cluster, "12", events=..., handle=...)   # the ranks get SIGTERM, checkpoint and stop: CANCELLED
    for line in job_logs(cluster, "12"): ...        # every node's lines in time order
    follow_logs(cluster, "12", events=..., handle=...)   # `output` events as lines are written, to the end

The job table: sbatch's job id is all Slurm knows of a job; dtrain keeps, on the login node, one small
file per job it submitted (`<workdir>/jobs/<job id>.json`: the workload, the run id and URL, the job's
directory). Everything else (state, restarts, times, exit code) is read from Slurm each time.

Logs: every node's task writes its lines, stamped, to `logs/<node>.log` in the job's directory (see
dtrain.common.slurmstep). On a cluster whose login node shares its workdir with the compute nodes (a
user's Slurm) they are all read there; on dtrain's own clusters, on each node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import queue
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.slurmstep import PROGRESS_PREFIX
from dtrain.common.storage import is_remote
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Events, Handle, Stop
from dtrain.control.slurm.commands import SINFO_NODES, JobState, Slurm, SlurmNode, not_found, parse_nodes
from dtrain.control.slurm.commands import expand_hostlist as expand_nodelist  # its home: commands
from dtrain.control.slurm.script import JobFiles, tar_of
from dtrain.control.slurm.spec import MANAGED_PARTITION, STALL_AFTER_S
from dtrain.control.ssh import SSH

if TYPE_CHECKING:
    from dtrain.control.launch import LaunchRequest, LaunchResult
    from dtrain.control.runs import LogLine

JOBS_DIR = "jobs"  # under the login node's workdir: the job table
POLL_S = 1.0  # how often a follower asks Slurm about the job
DRAIN_S = 1.0  # after the job ended: its last lines still on their way
FOLLOW_RESTART_S = 5.0  # a follower whose connection dropped is started again this much later
INT_GRACE_S = 5.0  # Ctrl-C: the job gets SIGINT, then is cancelled this much later (as the SSH launcher)
CANCEL_WAIT_S = 180.0  # cancel waits for the ranks to checkpoint and stop (KillWait is 60 s on dtrain's clusters)
RECENT_S = 24 * 3600  # `dtrain jobs` without --all: active jobs, and jobs submitted in the last day
JOB_ID_CHARS = frozenset("0123456789")
METRICS_WAIT_S = 10.0  # `dtrain jobs`: the most it waits for the last metrics lines of runs in buckets
METRICS_READERS = 8  # ... read by this many threads at most


# ---------------------------------------------------------------------------------------------
# the job table


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """What dtrain recorded about a job it submitted (the rest is Slurm's)."""

    job_id: str
    name: str
    workload: str
    run_id: str
    url: str  # the run's directory or gs:// URL
    dir: str  # the job's directory on the nodes: <workdir>/runs/<run id>
    nodes: int
    submitted: float  # epoch seconds, this machine's clock
    cluster: str
    eval_id: str = ""  # an evaluation of the run (dtrain eval --queue): it writes <url>/eval/<eval_id>.json
    kind: str = ""  # "program": a user's own program (dtrain.control.slurm.programs); "": a built-in

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobRecord:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


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


class Session:
    """SSH to a Slurm cluster's login node (and, where the job's files live on each node, to the others),
    Slurm's commands there, and the job table."""

    def __init__(self, cluster: Cluster, *, accept_new_host_keys: bool = False) -> None:
        if cluster.slurm is None:
            raise UserError(
                f'cluster {cluster.name!r} has no Slurm: jobs queue on Slurm clusters (backend = "slurm", '
                "a hosts cluster with slurm = true, or gcp); on this one use `dtrain train`"
            )
        self.cluster, self.spec = cluster, cluster.slurm
        self.login = cluster.slurm.login
        self.ssh = SSH(cluster, accept_new_host_keys=accept_new_host_keys)
        self.slurm = Slurm(self.ssh, self.login)
        self._workdir = ""

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ssh.close()

    def workdir_is(self, path: str) -> None:
        self._workdir = path

    @property
    def workdir(self) -> str:
        """The login node's workdir, absolute (Slurm's --chdir and --output need absolute paths)."""
        if not self._workdir:
            w = shlex.quote(self.login.workdir)
            command = f"mkdir -p {w} && cd {w} && pwd"
            p = self.slurm.query(command)
            if p.returncode != 0:
                raise self.slurm.error(command, p)
            self._workdir = p.stdout.decode().strip()
        return self._workdir

    @property
    def file_nodes(self) -> tuple[Node, ...]:
        """Where a job's directory lives: the login node when its workdir is shared, else every node."""
        return (self.login,) if self.spec.shared_workdir else self.cluster.nodes

    def record(self, job_id: str) -> JobRecord:
        if not job_id or not set(job_id) <= JOB_ID_CHARS:
            raise UserError(f"{job_id!r} is not a Slurm job id (digits, as `dtrain submit` printed it)")
        path = shlex.quote(f"{self.workdir}/{JOBS_DIR}/{job_id}.json")
        p = self.slurm.query(f"cat {path}")
        if p.returncode != 0:
            raise not_found(job_id, self.cluster.name)
        return JobRecord.from_dict(json.loads(p.stdout))

    def records(self) -> list[JobRecord]:
        d = shlex.quote(f"{self.workdir}/{JOBS_DIR}")
        out = self.slurm.query(f"cat {d}/*.json 2>/dev/null | tr '\\n' ' '; echo").stdout.decode()  # JSON objects
        decoder, text, records = json.JSONDecoder(), out.strip(), []
        while text:
            obj, end = decoder.raw_decode(text)
            records.append(JobRecord.from_dict(obj))
            text = text[end:].lstrip()
        return sorted(records, key=lambda r: int(r.job_id))

    def state(self, rec: JobRecord) -> JobState | None:
        return self.slurm.jobs([rec.job_id], since=_since(rec.submitted)).get(rec.job_id)


def _since(epoch: float) -> str:
    """A start time for sacct that is surely before `epoch` whatever the cluster's time zone."""
    return (datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc) - datetime.timedelta(days=1)).strftime(
        "%Y-%m-%d"
    )


# ---------------------------------------------------------------------------------------------
# submit


@dataclasses.dataclass(frozen=True)
class SubmitResult:
    job_id: str
    name: str
    workload: str
    run_id: str
    url: str
    cluster: str
    nodes: int
    partition: str
    resuming: bool


def submit(req: LaunchRequest, *, nodes: int = 0, name: str = "", events: Events, handle: Handle) -> SubmitResult:
    """Queue `req`'s built-in as a Slurm job on its cluster and return at once with the job id: the same job as a
    user's program (launch.builtin_plan, slurm.programs.submit_plan)."""
    from dtrain.control import backends
    from dtrain.control.launch import builtin_plan, resolve
    from dtrain.control.settings import get_cluster
    from dtrain.control.slurm.programs import submit_plan

    r = resolve(req)
    cfg = get_cluster(r.settings)
    start = getattr(backends.get(cfg.backend), "ensure_running", None)
    # A provisioning backend's cluster may be stopped (autostop): start it first; its addresses may change.
    if start is not None and start(cfg, events=events, handle=handle):
        r = resolve(req)
    return submit_plan(builtin_plan(req, r), nodes=nodes, name=name, events=events)


def _survey(s: Session, nodes: int, events: Events) -> tuple[str, list[SlurmNode]]:
    """One round trip: the login node's workdir (made, and remembered by the session) and Slurm's nodes;
    the job's partition and its nodes (see _partition)."""
    w = shlex.quote(s.login.workdir)
    try:
        survey = s.slurm.run(f"mkdir -p {w} && cd {w} && pwd && echo @@ && {SINFO_NODES}")
    except UserError as e:
        if not s.spec.managed or "has no `" in str(e):
            raise
        raise UserError(f"{e}: is Slurm set up there? run dtrain slurm setup --cluster {s.cluster.name}") from None
    s.workdir_is(survey.split("@@", 1)[0].strip())
    return _partition(s, *parse_nodes(survey.split("@@", 1)[1]), nodes, events)


def _gpus(s: Session, members: list[SlurmNode]) -> int:
    """GPUs a job asks of each node: the table's gpus_per_node, else all of the partition's smallest node
    on dtrain's own clusters, else none (a user's Slurm: its table says)."""
    return s.spec.gpus_per_node or (min(n.gpus for n in members) if s.spec.managed else 0)


def _queue(s: Session, rec: JobRecord, files: JobFiles) -> JobRecord:
    """Ship a job's files to rec.dir where its nodes read them (dtrain's code, job.json, the batch script),
    then sbatch it with its job-table entry; the record with the job id Slurm gave it. Two round trips (the
    files to each node at once; sbatch with the entry)."""
    _ship(s, rec, files)
    return _sbatch(s, rec)


def _ship(s: Session, rec: JobRecord, files: JobFiles) -> None:
    """dtrain's code, job.json and the batch script into rec.dir on every host that holds the job's files."""
    from dtrain.control.remote import code_archive

    archive, _digest = code_archive()
    bundle = tar_of(
        {
            "code.tar.gz": (archive, 0o600),
            "job.json": (files.job_json(), 0o600),
            "slurm.sh": (files.script.encode(), 0o755),
        }
    )
    d = shlex.quote(rec.dir)
    unpack = f"mkdir -p {d}/code && cd {d} && umask 077 && tar -xf - && tar -xzf code.tar.gz -C code && rm code.tar.gz"
    s.ssh.each(lambda node: s.ssh.run(node, unpack, input=bundle, timeout=120), s.file_nodes)


def _sbatch(s: Session, rec: JobRecord) -> JobRecord:
    """sbatch rec.dir's batch script and write the job-table entry in one round trip; the record with its id."""
    fields = {k: v for k, v in dataclasses.asdict(rec).items() if k != "job_id"}
    job_id = s.slurm.sbatch(
        f"{rec.dir}/slurm.sh", rec.dir, json.dumps(fields)[:-1].encode() + b', "job_id": "', f"{s.workdir}/{JOBS_DIR}"
    )
    return dataclasses.replace(rec, job_id=job_id)


def submit_module(
    cluster: Cluster,
    *,
    module: str,
    argv: list[str],
    label: str,
    workload: str,
    run_id: str,
    url: str,
    eval_id: str = "",
    accept_new_host_keys: bool = False,
    events: Events,
) -> SubmitResult:
    """Queue `python -m MODULE ARGV` as a one-node, one-process job (an evaluation: dtrain.evaluate) and
    return at once with the job id. Its files go to <workdir>/runs/<label>, not the run's own job
    directory; its job-table entry names the run it works on (`run_id`, `url`) and `workload`
    (`eval:mnist`), and `eval_id` the evaluation it writes under the run."""
    from dtrain.control.slurm.script import module_files

    with Session(cluster, accept_new_host_keys=accept_new_host_keys) as s:
        partition, members = _survey(s, 1, events)
        job_dir = f"{s.workdir}/runs/{label}"
        files = module_files(
            s.cluster,
            module=module,
            argv=argv,
            label=label,
            workload=workload,
            run_id=run_id,
            run_url=url,
            job_dir=job_dir,
            gpus_per_node=_gpus(s, members),
        )
        rec = JobRecord("", workload, workload, run_id, url, job_dir, 1, time.time(), cluster.name, eval_id=eval_id)
        rec = _queue(s, rec, files)
    return SubmitResult(rec.job_id, rec.name, workload, run_id, url, cluster.name, 1, partition, resuming=False)


def _partition(
    s: Session, rows: list[SlurmNode], default: str, nodes: int, events: Events
) -> tuple[str, list[SlurmNode]]:
    """The job's partition (checked to exist and to have `nodes` nodes) and its nodes. Nodes that are not up
    are named: a job that needs them waits for them (nothing is lost)."""
    names = sorted({n.partition for n in rows})
    wanted = s.spec.partition or (MANAGED_PARTITION if s.spec.managed else default)
    if not wanted:
        raise UserError(
            f"cluster {s.cluster.name} has no default Slurm partition: set partition = ... in "
            f"[clusters.{s.cluster.name}] (partitions: {', '.join(names) or 'none'})"
        )
    members = [n for n in rows if n.partition == wanted]
    if not members:
        hint = f"run dtrain slurm setup --cluster {s.cluster.name}" if s.spec.managed else "partitions: "
        raise UserError(
            f"cluster {s.cluster.name} has no Slurm partition {wanted!r} "
            f"({hint}{'' if s.spec.managed else ', '.join(names) or 'none'})"
        )
    if nodes > len(members):
        raise UserError(
            f"--nodes {nodes} is more nodes than partition {wanted} of cluster {s.cluster.name} has "
            f"({len(members)}): use --nodes {len(members)} or fewer"
        )
    for n in members:
        if not n.up:
            events.warning(
                f"node {n.name} is {n.state} in Slurm: jobs that need it wait for it; "
                f"`dtrain doctor --cluster {s.cluster.name}` says why"
            )
    return wanted, members


# ---------------------------------------------------------------------------------------------
# list and cancel


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
        states = s.slurm.jobs([r.job_id for r in records], since=_since(min(r.submitted for r in records)))
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


@dataclasses.dataclass(frozen=True)
class CancelResult:
    job_id: str
    run_id: str
    url: str
    was: str  # Slurm's state when cancelled (PENDING, RUNNING)
    state: JobState | None  # after: CANCELLED once the ranks have checkpointed and stopped
    checkpoint: str  # the run's last complete checkpoint (step-XXXXXXXX), "" if none (or an evaluation's job)
    eval_id: str = ""  # the job evaluated the run (dtrain eval --queue): this evaluation was stopped


def cancel(
    cluster: Cluster, job_id: str, *, events: Events, handle: Handle, accept_new_host_keys: bool = False
) -> CancelResult:
    """Cancel a queued or running job: Slurm sends SIGTERM to every rank, they checkpoint and stop, the
    job ends CANCELLED. Waits (at most CANCEL_WAIT_S) until no process of the job is left."""
    with Session(cluster, accept_new_host_keys=accept_new_host_keys) as s:
        rec = s.record(job_id)
        before = s.state(rec)
        if before is None or not before.active:
            how = f"{before.state}{f' at {before.ended}' if before.ended else ''}" if before else "Slurm has no record"
            raise UserError(f"job {job_id} has already ended ({how}): nothing to cancel; its run is {rec.url}")
        s.slurm.cancel(job_id)
        events.info(f"cancelling job {job_id} ({before.state}): its ranks checkpoint and stop")
        state = _wait_settled(s, rec, CANCEL_WAIT_S, handle)
        if rec.eval_id and state is not None and state.settled:
            _settle_eval(s, rec)
        checkpoint = "" if rec.eval_id else _checkpoint(s, rec)
        return CancelResult(job_id, rec.run_id, rec.url, before.state, state, checkpoint, rec.eval_id)


def _wait_settled(s: Session, rec: JobRecord, timeout: float, handle: Handle) -> JobState | None:
    deadline = time.monotonic() + timeout
    while True:
        state = s.state(rec)
        if state is None or state.settled or time.monotonic() > deadline or handle.stopped:
            return state
        time.sleep(POLL_S)


# On the login node, with the job's code (its directory there): the record of an evaluation on a path there.
SETTLE_EVAL = (
    "import sys; from dtrain.common.storage import open_store; from dtrain.evaluate import records; "
    "records.mark_cancelled(open_store(sys.argv[1]), sys.argv[2])"
)


def _settle_eval(s: Session, rec: JobRecord) -> None:
    """A cancelled evaluation's record: one cancelled while queued never started and still says pending
    (one cancelled while running says failed, interrupted, itself). Best effort: the job is cancelled."""
    with contextlib.suppress(Exception):
        if is_remote(rec.url):
            from dtrain.common.storage import open_store
            from dtrain.evaluate import records

            records.mark_cancelled(open_store(rec.url), rec.eval_id)
            return
        py, d = shlex.quote(s.login.python), shlex.quote(rec.dir)
        args = " ".join(shlex.quote(a) for a in (SETTLE_EVAL, rec.url, rec.eval_id))
        s.slurm.run(f'cd {d} && PYTHONPATH="$PWD/code" {py} -c {args}')


# On the login node, with the job's code (its directory there): a built-in run's last complete checkpoint.
LATEST_CHECKPOINT = (
    "import sys; from dtrain.common.rundir import last_checkpoint_name; print(last_checkpoint_name(sys.argv[1]))"
)


def _checkpoint(s: Session, rec: JobRecord) -> str:
    """The name of a built-in run's last complete checkpoint (step-XXXXXXXX), read where the run lives; for a
    user's program, the newest copy of its checkpoint directory (ckpt/node-<n>/<seq>.json, dtrain.common.mirror)."""
    if rec.kind == "program":
        return _checkpoint_copy(s, rec)
    with contextlib.suppress(Exception):
        if is_remote(rec.url):
            from dtrain.common.rundir import last_checkpoint_name

            return last_checkpoint_name(rec.url)
        py, d = shlex.quote(s.login.python), shlex.quote(rec.dir)
        args = " ".join(shlex.quote(a) for a in (LATEST_CHECKPOINT, rec.url))
        return s.slurm.run(f'cd {d} && PYTHONPATH="$PWD/code" {py} -c {args}').strip()
    return ""


def _checkpoint_copy(s: Session, rec: JobRecord) -> str:
    """A program run's newest checkpoint-directory copy (the copy a --resume or requeue restores), "" if none."""
    from dtrain.common.rundir import CKPT_PREFIX

    names: list[str] = []
    with contextlib.suppress(Exception):
        if is_remote(rec.url):
            from dtrain.common.storage import open_store

            names = open_store(rec.url).child(CKPT_PREFIX).list("node-")
        else:
            d = shlex.quote(f"{rec.url}/{CKPT_PREFIX}")
            out = s.slurm.run(f"cd {d} 2>/dev/null && ls -1 node-*/*.json 2>/dev/null || true")
            names = out.split()
    manifests = [n for n in names if re.fullmatch(r"node-\d{5}/\d{8}\.json", n)]
    if not manifests:
        return ""
    newest = max(manifests, key=lambda n: n.rsplit("/", 1)[1])
    return f"{CKPT_PREFIX}/{newest}"


# ---------------------------------------------------------------------------------------------
# logs


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
        state = _follow(s, rec, events=events, handle=handle, control=False)
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


def _follow(s: Session, rec: JobRecord, *, events: Events, handle: Handle, control: bool) -> JobState | None:
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


# ---------------------------------------------------------------------------------------------
# dtrain train through Slurm


def attend(
    s: Session, sub: SubmitResult, rec: JobRecord, t0: float, *, what: str, events: Events, handle: Handle
) -> LaunchResult:
    """`dtrain train` through Slurm once the job is queued: its output here live until it ends, Ctrl-C stops
    it, its exit code is ours; the job is cancelled if this process goes away (its SSH connection closes)."""
    from dtrain.control.launch import LaunchResult

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
            state = _follow(s, rec, events=events, handle=handle, control=True)
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


__all__ = [
    "submit",
    "submit_module",
    "list_jobs",
    "cancel",
    "job_logs",
    "follow_logs",
    "attend",
    "Session",
    "JobRecord",
    "JobRow",
]
