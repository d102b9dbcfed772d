"""The job table and a session on a Slurm cluster's login node.

sbatch's job id is all Slurm knows of a job; dtrain keeps, on the login node, one small file per job it
submitted (`<workdir>/jobs/<job id>.json`: the workload, the run id and URL, the job's directory), a
`JobRecord`. Everything else (state, restarts, times, exit code) is read from Slurm each time, through a
`Session`: SSH to the login node (and, where a job's files live on each node, to the others) and Slurm's
commands there.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import shlex
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.cluster import Cluster, Node
from dtrain.control.slurm.commands import JobState, Slurm, not_found
from dtrain.control.ssh import SSH

JOBS_DIR = "jobs"  # under the login node's workdir: the job table
POLL_S = 1.0  # how often a follower (or a cancel waiting for the job to end) asks Slurm about the job
JOB_ID_CHARS = frozenset("0123456789")


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


class Session:
    """SSH to a Slurm cluster's login node (and, where the job's files live on each node, to the others),
    Slurm's commands there, and the job table."""

    def __init__(self, cluster: Cluster, *, accept_new_host_keys: bool = False) -> None:
        from dtrain.control import launchers

        launchers.require(cluster, launchers.Feature.QUEUE)
        assert cluster.slurm is not None
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
        return self.slurm.jobs([rec.job_id], since=sacct_since(rec.submitted)).get(rec.job_id)


def sacct_since(epoch: float) -> str:
    """A start time for sacct that is surely before `epoch` whatever the cluster's time zone."""
    return (datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc) - datetime.timedelta(days=1)).strftime(
        "%Y-%m-%d"
    )
