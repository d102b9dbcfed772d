"""Queue a job on a cluster with Slurm and return at once with its job id: any job (dtrain.control.launch.submit,
through dtrain.control.slurm.programs.submit_plan) or one module on one node (`submit_module`, an evaluation).
The steps every submission shares: the survey of the login node and its partition (`survey`), the GPUs a job
asks of each node (`job_gpus`), its files shipped (`ship_files`) and sbatch with its job-table entry
(`sbatch_job`).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time

from dtrain.common.errors import UserError
from dtrain.control.cluster import Cluster
from dtrain.control.events import Events
from dtrain.control.slurm.commands import SINFO_NODES, SlurmNode, parse_nodes
from dtrain.control.slurm.script import BatchFiles, tar_of
from dtrain.control.slurm.session import JOBS_DIR, JobRecord, Session
from dtrain.control.slurm.spec import MANAGED_PARTITION


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


def survey(s: Session, nodes: int, events: Events) -> tuple[str, list[SlurmNode]]:
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


def job_gpus(s: Session, members: list[SlurmNode]) -> int:
    """GPUs a job asks of each node: the table's gpus_per_node, else all of the partition's smallest node
    on dtrain's own clusters, else none (a user's Slurm: its table says)."""
    return s.spec.gpus_per_node or (min(n.gpus for n in members) if s.spec.managed else 0)


def _queue(s: Session, rec: JobRecord, files: BatchFiles) -> JobRecord:
    """Ship a job's files to rec.dir where its nodes read them (dtrain's code, job.json, the batch script),
    then sbatch it with its job-table entry; the record with the job id Slurm gave it. Two round trips (the
    files to each node at once; sbatch with the entry)."""
    ship_files(s, rec, files)
    return sbatch_job(s, rec)


def ship_files(s: Session, rec: JobRecord, files: BatchFiles) -> None:
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


def sbatch_job(s: Session, rec: JobRecord) -> JobRecord:
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
        partition, members = survey(s, 1, events)
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
            gpus_per_node=job_gpus(s, members),
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
