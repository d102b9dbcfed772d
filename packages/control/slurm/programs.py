"""A user's own program as a Slurm job: `dtrain submit train.py ...` (queued: the job id back at once) and
`dtrain train train.py --cluster <a Slurm cluster>` (through an allocation, followed live). A built-in
(`dtrain submit mnist`) is the same kind of job (launch.builtin_job): its module under torchrun, dtrain's own
code and no working directory. One batch step (dtrain.common.slurmstep), one node agent, the SSH contract.

    plan = launch.resolve(LaunchRequest(job=job, flags={"run.cluster": "demo"}), events=..., handle=...)
    result = submit_plan(plan, name="lr-3e-3", events=...)   # SubmitResult: the job id (launch.submit)
    result = run_program(plan, events=..., handle=...)       # launchers.slurm, for `dtrain train`

How the pieces reach the nodes:

- The working directory goes with dtrain.common.codesync, not in the job's tar like dtrain's own code: to
  `<workdir>/code/<project>` on every host that holds the job's files (the login node, whose workdir the
  compute nodes share, on a user's cluster; every node on dtrain's own, whose disks are their own), then a
  hard-linked snapshot `<job dir>/work` that a later sync never changes under a queued or running job. A
  resubmission with unchanged code sends nothing, a changed file only that file: a project is megabytes and
  a queue holds many jobs of one project, where a tar per job would copy all of it every time.
- Requirements are installed on the nodes when the job starts (dtrain.common.deps, once per node per content
  hash, in `<workdir>/envs`: one shared folder where the workdir is shared, under deps' lock): the login node
  may not be the machine, nor have the Python, the job runs on.
- The checkpoint directory (`--checkpoint-dir`, else dtrain's own `checkpoints/`) is in the job's directory:
  node-local on dtrain's own clusters, where every node copies its own to `<run>/ckpt` and puts the newest
  complete copy back before a requeued or resumed job starts (dtrain.common.nodeagent.JobFiles); one folder
  for the whole job on a shared workdir, copied by the first node and put back once by the batch step.
- The run (config.json, status.json with its starts) is recorded by the batch step when the job starts, so a
  job that never ran leaves no run (a built-in writes its own config.json, which holds its resolved config);
  DTRAIN_RESTART_COUNT is the starts before this job plus Slurm's requeues, so a requeued built-in continues
  its run from the checkpoint put back (dtrain.common.workload).
"""

from __future__ import annotations

import time
from typing import Any

from dtrain.common.errors import UserError
from dtrain.common.storage import is_remote
from dtrain.control.events import Events, Handle
from dtrain.control.slurm.attend import attend
from dtrain.control.slurm.session import JobRecord, Session
from dtrain.control.slurm.submit import SubmitResult, job_gpus, sbatch_job, ship_files, survey


def submit_plan(plan: Any, *, name: str = "", events: Events) -> SubmitResult:
    """Queue a launchers.Plan (`dtrain submit`: dtrain.control.launch.submit) on its Slurm cluster, on the job's
    nodes (0: the cluster table's); returns at once with the job id."""
    with Session(plan.cluster, accept_new_host_keys=plan.accept_new_host_keys) as s:
        return _submit(s, plan, name=name, interactive=False, events=events)[0]


def run_program(plan: Any, *, events: Events, handle: Handle) -> Any:
    """`dtrain train <program> --cluster <a Slurm cluster>`: queued, then followed here until it ends (Ctrl-C
    stops it); a LaunchResult with the job's exit code."""
    with Session(plan.cluster, accept_new_host_keys=plan.accept_new_host_keys) as s:
        t0 = time.monotonic()
        sub, rec = _submit(s, plan, name=plan.job.name, interactive=True, events=events)
        return attend(s, sub, rec, t0, what=plan.job.name, events=events, handle=handle)


def _submit(s: Session, plan: Any, *, name: str, interactive: bool, events: Events) -> tuple[SubmitResult, JobRecord]:
    """Check the job against Slurm's partition, ship dtrain's node code and the job's files, sync the working
    directory, sbatch: four SSH round trips (the survey; the files; the sync, to each host at once; sbatch). A
    program without a working directory (a built-in) is dtrain's code, in the job's files; one that writes its own
    config.json (plan.own_config) gets none from here."""
    from dtrain.common.nproc import processes
    from dtrain.control.remote_program import sync_excludes, sync_workdir
    from dtrain.control.slurm.script import program_files
    from dtrain.control.userjob import program_config

    job, t, cluster, spec = plan.job, plan.target, s.cluster, s.spec
    nodes = job.nodes or spec.nodes or (len(cluster.nodes) if spec.managed else 1)
    partition, members = survey(s, nodes, events)
    gpus = job_gpus(s, members)
    if plan.nproc and job.program.under_torchrun:  # checked against the partition's smallest node
        cpus = min(n.cpus for n in members)
        processes(plan.nproc, gpus=gpus, cpus=cpus, oversubscribe=plan.oversubscribe, where=f"partition {partition}")
    if nodes > 1 and not is_remote(t.run.url) and not cluster.shared_fs:
        raise UserError(
            f"a job on {nodes} nodes needs --output that every node reaches: a gs://bucket/prefix (or set "
            f"shared_fs = true in [clusters.{cluster.name}] if {t.run.url} is on a shared filesystem)"
        )
    name = name or job.name
    job_dir = f"{s.workdir}/runs/{t.run_id}"
    config = None if plan.own_config else program_config(t, job, cluster=cluster.name, nodes=nodes, nproc=None)
    files = program_files(
        plan,
        job_dir=job_dir,
        name=name,
        nodes=nodes,
        interactive=interactive,
        gpus_per_node=gpus,
        config=config,
        time=getattr(job, "time", ""),
    )
    kind = "" if plan.own_config else "program"
    rec = JobRecord("", name, job.name, t.run_id, t.run.url, job_dir, nodes, time.time(), cluster.name, kind=kind)
    ship_files(s, rec, files)
    if job.workdir is not None:
        sync_workdir(
            s.ssh, t, job.workdir, sync_excludes(job, t.run.url), events, nodes=s.file_nodes,
            limit_mb=job.code_limit_mb,
        )  # fmt: skip
    rec = sbatch_job(s, rec)
    result = SubmitResult(rec.job_id, name, job.name, t.run_id, t.run.url, cluster.name, nodes, partition, t.resumed)
    return result, rec


__all__ = ["submit_plan", "run_program"]
