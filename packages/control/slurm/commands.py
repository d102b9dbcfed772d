"""Slurm's own commands, run on the login node over SSH, with their output parsed.

    sbatch --parsable            submit (the job id back)
    scontrol -o show job|part    jobs Slurm holds in memory (pending, running, ended within MinJobAge),
                                 with their restart counts; partitions and their node counts
    sinfo -N                     the nodes of a partition: CPUs, GPUs, state
    sacct                        ended jobs: from slurmdbd where there is one (-D: one record per start),
                                 else from the job-completion file of dtrain's own clusters (sacct -c)
    scancel                      cancel, or signal (--signal)

A Slurm command missing on the login node is one line that says so; any other failure is Slurm's own
message, on one line.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import time
from collections.abc import Iterable

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.cluster import Node
from dtrain.control.ssh import SSH, NodeError

TIMEOUT_S = 60
QUERY_ATTEMPTS = 3
QUERY_RETRY_S = 0.5
# Slurm's job states: waiting, running, and ended (with what dtrain says about each ending).
PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESV_DEL_HOLD"})
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "SUSPENDED", "STOPPED", "RESIZING"})
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
     "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}
)  # fmt: skip
SACCT_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Submit", "Start", "End", "Elapsed", "NNodes", "NodeList")
_KV_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/:]*)=")


def parse_kv(line: str) -> dict[str, str]:
    """One line of `scontrol -o show ...`: Key=value pairs (a value may hold spaces: it runs to the next Key=)."""
    matches = list(_KV_RE.finditer(line))
    out = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list as names, in order: "demo-master,demo-worker-[0-2,5]", "n[08-10]",
    "gpu[1-2]-ib" (a suffix after the brackets), "rack[1-2]-n[01-02]" (several bracket groups). The one
    reading of a host list for every part of dtrain (`dtrain jobs`' cost, the cluster service's view of
    which nodes run jobs). A bracket part that is not a number or a range of numbers ("n[a-c]": Slurm
    never writes one) is kept as written, rather than dropped or failing."""
    names: list[str] = []
    for expr in _split_top_level(text.strip()):
        names.extend(_expand_host(expr))
    return names


def _split_top_level(text: str) -> list[str]:
    """`text` split at the commas that are not inside brackets."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        current += ch
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _expand_host(expr: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", expr)
    if m is None:
        return [expr]
    prefix, ranges, rest = m.groups()
    tails = _expand_host(rest) if rest else [""]
    heads: list[str] = []
    for part in (p.strip() for p in ranges.split(",")):
        lo, dash, hi = part.partition("-")
        if lo.isdigit() and (not dash or (hi.isdigit() and int(hi) >= int(lo))):
            heads += [f"{prefix}{str(i).zfill(len(lo))}" for i in range(int(lo), int(hi or lo) + 1)]
        elif part:
            heads.append(prefix + part)
    return [h + t for h in heads for t in tails]


@dataclasses.dataclass(frozen=True)
class JobState:
    """What Slurm says about one job."""

    job_id: str
    name: str
    state: str  # Slurm's state: PENDING, RUNNING, COMPLETED, CANCELLED, ...
    reason: str = ""  # why it waits (Priority, Resources, ...)
    exit_code: int | None = None  # the batch script's exit code (dtrain's codes), once it ended
    restarts: int = 0  # times Slurm started it again (requeued after a node failure or a preemption)
    submitted: str = ""  # Slurm's times, in the cluster's local time zone, as it prints them
    started: str = ""
    ended: str = ""
    elapsed: str = ""  # [D-]HH:MM:SS
    nodes: int = 0
    nodelist: str = ""
    comment: str = ""  # the job's Slurm comment: dtrain's continuations, hang requeues, stragglers (slurmstep)

    @property
    def continuations(self) -> int:
        """Times the job reached its time limit and was requeued to continue its run."""
        from dtrain.common.slurmstep import continuations

        return continuations(self.comment)[0]

    @property
    def continuations_stopped(self) -> bool:
        """The job reached its time limit after its last allowed continuation: it was not requeued."""
        from dtrain.common.slurmstep import continuations

        return continuations(self.comment)[1]

    @property
    def hang_restarts(self) -> int:
        """Times the job's ranks hung and the job was requeued to resume its run."""
        from dtrain.common.slurmstep import hang_requeues

        return hang_requeues(self.comment)

    @property
    def stragglers(self) -> str:
        """The job's stragglers as its batch step last saw them ("h1 rank 1 (2.3x)"; "": none)."""
        from dtrain.common.slurmstep import stragglers_of, stragglers_text

        return stragglers_text(stragglers_of(self.comment))

    @property
    def active(self) -> bool:
        """Waiting or running: not ended (a job being cancelled is ended, even while its processes exit)."""
        return self.state not in FINAL_STATES

    @property
    def settled(self) -> bool:
        """Ended, and no process of it is left (cancelled and timed-out jobs pass through COMPLETING)."""
        return not self.active


def _time(value: str) -> str:
    return "" if value in ("", "Unknown", "None", "N/A") else value


def _exit_code(value: str) -> int | None:
    code, _, sig = value.partition(":")
    if not code.isdigit():
        return None
    return 128 + int(sig) if sig.isdigit() and int(sig) else int(code)


def job_from_scontrol(kv: dict[str, str]) -> JobState:
    state = kv.get("JobState", "")
    return JobState(
        job_id=kv.get("JobId", ""),
        name=kv.get("JobName", ""),
        state=state,
        reason="" if kv.get("Reason") in (None, "None") else kv["Reason"],
        exit_code=_exit_code(kv.get("ExitCode", "")) if state in FINAL_STATES else None,
        restarts=int(kv.get("Restarts", "0") or 0),
        submitted=_time(kv.get("SubmitTime", "")),
        started=_time(kv.get("StartTime", "")) if state not in PENDING_STATES else "",
        ended=_time(kv.get("EndTime", "")) if state in FINAL_STATES else "",
        elapsed=kv.get("RunTime", ""),
        nodes=int(kv.get("NumNodes", "0").split("-")[0] or 0),
        nodelist="" if kv.get("NodeList") in (None, "(null)") else kv["NodeList"],
        comment="" if kv.get("Comment") in (None, "(null)") else kv["Comment"],
    )


def jobs_from_sacct(text: str, completion: bool) -> dict[str, JobState]:
    """sacct -P records, one per start of a job (-D; the completion file also keeps one per start): the
    last record of a job is how it ended, the records before it its restarts."""
    fields = [f.lower() for f in (COMPLETION_FIELDS if completion else SACCT_FIELDS)]
    records: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        values = line.split("|")
        if len(values) != len(fields):
            continue
        rec = dict(zip(fields, values, strict=True))
        if "." in rec["jobid"]:
            continue  # a step (12.batch, 12.0), not the job
        records.setdefault(rec["jobid"], []).append(rec)
    out = {}
    for job_id, recs in records.items():
        first, last = recs[0], recs[-1]
        state = last["state"].split()[0]  # "CANCELLED by 0" -> CANCELLED
        out[job_id] = JobState(
            job_id=job_id,
            name=last["jobname"],
            state=state,
            exit_code=_exit_code(last.get("exitcode", "")),
            restarts=len(recs) - 1,
            submitted=_time(first.get("submit", "")),
            started=_time(last.get("start", "")),
            ended=_time(last.get("end", "")),
            elapsed=last.get("elapsed") or _elapsed(last.get("start", ""), last.get("end", "")),
            nodes=int(last.get("nnodes", "0") or 0),
            nodelist=last.get("nodelist", ""),
        )
    return out


def _elapsed(start: str, end: str) -> str:
    """end - start as Slurm prints durations ([D-]HH:MM:SS), from two of its times ("" if either is missing)."""
    import datetime

    try:
        seconds = int((datetime.datetime.fromisoformat(end) - datetime.datetime.fromisoformat(start)).total_seconds())
    except ValueError:
        return ""
    days, rest = divmod(max(0, seconds), 86400)
    hms = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{hms}" if days else hms


# The job-completion file (jobcomp/filetxt, dtrain's own clusters) has no submit time or elapsed column.
COMPLETION_FIELDS = ("JobID", "JobName", "State", "ExitCode", "Start", "End", "NNodes", "NodeList")


@dataclasses.dataclass(frozen=True)
class SlurmNode:
    """One node of one partition, as sinfo shows it."""

    name: str
    partition: str
    cpus: int
    gpus: int
    state: str  # idle, alloc, mix, down*, drain, ... ("*": not responding)

    @property
    def up(self) -> bool:
        return "*" not in self.state and self.state.rstrip("~#!%$@^-+") in READY_STATES


READY_STATES = frozenset({"idle", "alloc", "mix", "comp", "allocated", "mixed", "completing"})
SINFO_NODES = "sinfo -h -N -o '%P|%N|%c|%G|%t'"


def parse_nodes(text: str) -> tuple[list[SlurmNode], str]:
    """SINFO_NODES' output: every (partition, node) row, and the default partition (sinfo marks it with *)."""
    rows, default = [], ""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 5:
            continue
        partition, name, cpus, gres, state = parts
        if partition.endswith("*"):
            partition = default = partition[:-1]
        gpus = sum(int(m.group(1)) for m in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres))
        rows.append(SlurmNode(name, partition, int(cpus) if cpus.isdigit() else 0, gpus, state))
    return rows, default


class Slurm:
    """Slurm's commands on the login node of `ssh`'s cluster."""

    def __init__(self, ssh: SSH, login: Node) -> None:
        self.ssh, self.login = ssh, login

    def run(self, command: str, *, input: bytes | None = None, timeout: float = TIMEOUT_S) -> str:  # noqa: A002
        """Run a shell command line on the login node; its stdout, or one line saying why it failed."""
        p = self.ssh.run(self.login, command, input=input, timeout=timeout, check=False)
        if p.returncode != 0:
            raise self.error(command, p)
        return p.stdout.decode(errors="replace")

    def query(self, command: str, *, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
        """A command that only reads (never sbatch or scancel): tried again when the SSH connection itself
        failed, as it now and then does for a moment (a shared connection closing as a new one opens)."""
        for attempt in range(QUERY_ATTEMPTS):
            try:
                return self.ssh.run(self.login, command, timeout=timeout, check=False)
            except NodeError:
                if attempt == QUERY_ATTEMPTS - 1:
                    raise
                time.sleep(QUERY_RETRY_S)
        raise AssertionError("unreachable")

    def error(self, command: str, p: subprocess.CompletedProcess) -> UserError:
        err = " ".join(p.stderr.decode(errors="replace").split())
        word = command.split()[0]
        missing = re.search(r"([\w.-]+): (?:command )?not found", err)
        if p.returncode == 127 and missing:
            word = missing.group(1)
            return UserError(
                f"the login node {self.login.destination} has no `{word}`: dtrain needs Slurm's client commands "
                "there (sbatch, squeue, scontrol, scancel, sacct): point login at a Slurm login node, or install "
                "slurm-client on it"
            )
        for prefix in ("sbatch: error: Batch job submission failed: ", "sbatch: error: ", "slurm_load_jobs error: "):
            if prefix in err:
                err = err.split(prefix, 1)[1]
                break
        return UserError(f"{word} on {self.login.destination} failed: {err or f'exit {p.returncode}'}")

    # -- queries --------------------------------------------------------------------------------------

    def nodes(self) -> tuple[list[SlurmNode], str]:
        """Every partition's nodes, and the default partition."""
        return parse_nodes(self.run(SINFO_NODES))

    def jobs(self, ids: Iterable[str], *, since: str = "") -> dict[str, JobState]:
        """What Slurm knows of these jobs: scontrol for the ones it holds, sacct for the others (since
        `since`, a Slurm time); ids it knows nothing of are left out."""
        ids = list(dict.fromkeys(ids))
        if not ids:
            return {}
        command = f"scontrol -o show job {ids[0]}" if len(ids) == 1 else "scontrol -o show job"
        p = self.query(command)
        if p.returncode != 0 and b"Invalid job id" not in p.stderr:
            raise self.error(command, p)
        held = {}
        for line in p.stdout.decode(errors="replace").splitlines():
            kv = parse_kv(line)
            if kv.get("JobId") in ids:
                held[kv["JobId"]] = job_from_scontrol(kv)
        missing = [i for i in ids if i not in held]
        return {**self.accounted(missing, since=since), **held} if missing else held

    def accounted(self, ids: list[str], *, since: str = "") -> dict[str, JobState]:
        """Ended jobs from sacct: slurmdbd's records, else the job-completion file (`sacct -c`), else none."""
        joined = ",".join(ids)
        start = shlex.quote(since or "2000-01-01")
        fields, completion = ",".join(SACCT_FIELDS), ",".join(COMPLETION_FIELDS)
        command = (
            f"sacct -n -P -X -D -j {joined} -S {start} -o {fields} 2>/dev/null && echo '@@dbd' || "
            f"sacct -c -n -P -j {joined} -S {start} -o {completion} 2>/dev/null"
        )
        p = self.query(command)
        text = p.stdout.decode(errors="replace")
        from_dbd = text.rstrip().endswith("@@dbd")
        return jobs_from_sacct(text.replace("@@dbd", ""), completion=not from_dbd)

    # -- actions --------------------------------------------------------------------------------------

    def sbatch(self, script: str, cwd: str, record: bytes, table: str) -> str:
        """Submit the batch script at `script` (a path on the login node) and write `record` (JSON lacking
        its last field, the job id) as <table>/<job id>.json there, in one round trip; the job id."""
        command = (
            f"cd {shlex.quote(cwd)} && id=$(sbatch --parsable {shlex.quote(script)}) && id=${{id%%;*}} && "
            f"mkdir -p {shlex.quote(table)} && umask 077 && "
            f'{{ cat; printf \'%s"}}\\n\' "$id"; }} > {shlex.quote(table)}/"$id".json && echo "$id"'
        )
        out = self.run(command, input=record)
        job_id = out.strip().splitlines()[-1] if out.strip() else ""
        if not job_id.isdigit():
            raise UserError(f"sbatch on {self.login.destination} printed no job id: {out.strip()[:200]!r}")
        return job_id

    def cancel(self, job_id: str, signal: str = "", *, ended_ok: bool = False) -> None:
        """scancel: the job's steps get SIGTERM, then SIGKILL after KillWait; with `signal`, only that signal.
        `ended_ok`: a job that has ended meanwhile is no error."""
        option = f"--signal={signal} " if signal else ""
        try:
            self.run(f"scancel {option}{shlex.quote(job_id)}")
        except UserError as e:
            if not (ended_ok and any(s in str(e) for s in ("Invalid job id", "already completing or completed"))):
                raise


def not_found(job_id: str, cluster: str) -> UserError:
    return UserError(
        f"no job {job_id} on cluster {cluster}: `dtrain jobs --cluster {cluster} --all` lists the jobs dtrain "
        "submitted there",
        exit_code=ExitCode.USAGE,
    )


__all__ = [
    "Slurm",
    "expand_hostlist",
    "JobState",
    "SlurmNode",
    "parse_kv",
    "parse_nodes",
    "jobs_from_sacct",
    "job_from_scontrol",
    "not_found",
]
