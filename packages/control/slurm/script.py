"""A Slurm job's files, written by dtrain into the job's directory `<workdir>/runs/<run id>/` (on the login
node, and on every node of a cluster whose nodes have disks of their own):

    code/       dtrain's node-side code (as the SSH launcher syncs it), with dtrain.common.slurmstep
    job.json    what every node runs: the node agent's job spec for each node with placeholders that only
                the allocation can fill in (addresses, the first node, processes per node), and the
                `program` table the batch step reads. Holds the job's environment (HF_TOKEN if set):
                written 0600, like an SSH key; never the trackers' API keys (jobenv.SECRET_ENV)
    slurm.sh    the batch script: #SBATCH options, then dtrain.common.slurmstep's batch step

A job (program_files) is a user's program or a built-in, as the SSH launcher runs it: its spec is
dtrain.control.remote_program.program_spec's, so a job in Slurm runs exactly what `dtrain train --cluster`
runs on a cluster without it. A user's program has its working directory beside code/ as work/ (synced, not
in the tar: dtrain.control.slurm.programs); a built-in has none. An evaluation (module_files) is one process.
"""

from __future__ import annotations

import dataclasses
import io
import json
import shlex
import tarfile
import time
from collections.abc import Mapping
from typing import Any

from dtrain.common.slurmstep import ARGS_TOKEN
from dtrain.control.cluster import Cluster, Node

MASTER = Node(name="__dtrain_master__", address="__dtrain_master_addr__")  # the allocation's first node


@dataclasses.dataclass(frozen=True)
class BatchFiles:
    script: str
    job: dict[str, Any]

    def job_json(self) -> bytes:
        """job.json's bytes: the job less the trackers' secrets (jobenv.SECRET_ENV), which a file never holds."""
        return (json.dumps(_without_secrets(self.job), indent=1, sort_keys=True) + "\n").encode()


def _without_secrets(value: Any) -> Any:
    """`value` with every "env" table, at any depth (each node's spec, a container's inner one), less the
    names in jobenv.SECRET_ENV."""
    from dtrain.common.jobenv import SECRET_ENV

    if isinstance(value, dict):
        return {
            k: {n: x for n, x in v.items() if n not in SECRET_ENV}
            if k == "env" and isinstance(v, dict)
            else _without_secrets(v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_without_secrets(v) for v in value]
    return value


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _set(argv: list[str], name: str, value: str) -> None:
    argv[argv.index(name) + 1] = value


def module_files(
    cluster: Cluster,
    *,
    module: str,
    argv: list[str],
    label: str,
    workload: str,
    run_id: str,
    run_url: str,
    job_dir: str,
    gpus_per_node: int,
) -> BatchFiles:
    """The batch script and job.json of a one-node job that runs `python -m MODULE ARGV` as one process
    through the node agent, as dtrain.control.evals runs it on a cluster's master (no torchrun). The same
    batch step; a requeued job runs the same line again. Its node log stays in the job's directory
    (`keep_log`): the run's logs/ are its training's."""
    assert cluster.slurm is not None and not cluster.image
    s = cluster.slurm
    from dtrain.control.remote import NodeWork, node_spec

    nodes = {n.name: n for n in cluster.nodes} if s.managed else {"*": s.login}
    stand_in = dataclasses.replace(cluster, nodes=(MASTER,))  # one process: no rendezvous to fill in
    specs = {}
    for key, node in nodes.items():
        work = NodeWork(tail=[node.python, "-m", module, ARGS_TOKEN], torchrun=False)
        some_node = dataclasses.replace(node, name="__dtrain_node__", address="__dtrain_addr__")
        threads: Any = "__dtrain_threads__"  # a placeholder, filled in on the node
        specs[key] = node_spec(stand_in, some_node, work, run_id=label, nproc=1, threads=threads, gpus=gpus_per_node)
    job = {
        "version": 1,
        "workload": workload,
        "run_id": run_id,
        "run_url": run_url,
        "name": workload,
        "python": s.login.python,
        "dir": job_dir,
        "image": "",
        "resume": False,
        "argv_new": list(argv),
        "argv_resume": list(argv),
        "specs": specs,
        "nproc": 1,
        "oversubscribe": False,
        "interactive": False,
        "keep_log": False,
        "max_continuations": s.max_continuations,
    }
    return BatchFiles(script=batch_script(cluster, job, nodes=1, gpus_per_node=gpus_per_node), job=job)


def program_template(plan: Any, node: Node) -> dict[str, Any]:
    """The node agent's spec for a user's program (dtrain.control.remote_program.program_spec, the SSH
    launcher's) on any node of an allocation: what only the allocation knows is left as dtrain.common.slurmstep's
    placeholders; the node's rank among them. Paths are relative to the job's directory on the node."""
    from dtrain.common import jobenv
    from dtrain.control.remote_program import program_spec

    # The synced-mode spec even for a job in an image: each node's step wraps it in its container after it fills
    # in the allocation and installs the requirements (dtrain.common.slurmstep.node_program_spec).
    stand_in = dataclasses.replace(plan.cluster, nodes=(MASTER,), image="")
    some_node = dataclasses.replace(node, name="__dtrain_node__", address="__dtrain_addr__")
    # rank 0: the spec the first node runs (it forwards the metrics); the node's step adjusts it for the others.
    spec = program_spec(
        plan, plan.target, stand_in, some_node, rank=0,
        nproc="__dtrain_nproc__", threads="__dtrain_threads__", restore=False,  # type: ignore[arg-type]
    )  # fmt: skip
    env = spec["env"]
    for ours, token in ((jobenv.NODE_RANK, "__dtrain_node_rank__"), (jobenv.NNODES, "__dtrain_nnodes__")):
        env[ours] = token
        env.update({plain: token for plain, name in jobenv.COMMAND_ENV.items() if name == ours and plain in env})
    if plan.job.program.under_torchrun:
        argv = spec["argv"]
        _set(argv, "--nnodes", "__dtrain_nnodes__")
        _set(argv, "--rdzv-conf", _option(argv, "--rdzv-conf").replace("is_host=0", "is_host=__dtrain_is_host__"))
    return spec


def program_files(
    plan: Any,
    *,
    job_dir: str,
    name: str,
    nodes: int,
    interactive: bool,
    gpus_per_node: int,
    config: dict[str, Any] | None,
    time: str = "",
) -> BatchFiles:
    """The batch script and job.json of a job (`plan`: a launchers.Plan with its run: a user's program, or a
    built-in: launch.builtin_job). job.json's `program` table says what the batch step and each node's step do
    for it (dtrain.common.slurmstep.program_started, node_program_spec): whether it has a working directory (a
    built-in has none: no requirements, dtrain's code), the project's setup commands and each node's base
    interpreter (requirements are installed on the nodes), the starts before this job, whether the job's
    directory is one the nodes share, and the run's config.json for its first start (None: a built-in writes
    its own)."""
    cluster = plan.cluster
    assert cluster.slurm is not None
    s = cluster.slurm
    members = {n.name: n for n in cluster.nodes} if s.managed else {"*": s.login}
    specs = {key: program_template(plan, node) for key, node in members.items()}
    job = {
        "version": 1,
        "kind": "builtin" if plan.own_config else "program",
        "workload": plan.job.name,
        "run_id": plan.target.run_id,
        "run_url": plan.target.run.url,
        "name": name,
        "python": s.login.python,
        "dir": job_dir,
        "image": cluster.image,
        "resume": plan.target.resumed,
        "argv_new": [],
        "argv_resume": [],
        "specs": specs,
        "nproc": plan.nproc,
        "oversubscribe": plan.oversubscribe,
        "interactive": interactive,
        "time": time or s.time,
        "max_continuations": s.max_continuations,
        "max_restarts": plan.max_restarts,  # requeues after a hang; the agents' hang timeout is in each spec
        "program": {
            "workdir": plan.job.workdir is not None,
            "torchrun": plan.job.program.under_torchrun,
            "setup": list(plan.job.setup),
            "python": {key: node.python for key, node in members.items()},
            "restarts": plan.target.restarts,
            "shared": s.shared_workdir,
            "config": config,
            "docker": {key: node.docker for key, node in members.items()},  # with the image: each node's docker
        },
    }
    return BatchFiles(script=batch_script(cluster, job, nodes=nodes, gpus_per_node=gpus_per_node), job=job)


def batch_script(cluster: Cluster, job: dict[str, Any], *, nodes: int, gpus_per_node: int) -> str:
    """The sbatch script: whole nodes, one task each, requeued after a node failure; the job's output
    appended to slurm-<job id>.out in its directory; then the batch step (dtrain.common.slurmstep)."""
    assert cluster.slurm is not None
    s = cluster.slurm
    options = [
        f"--job-name={job['name']}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        "--exclusive",
        "--requeue",
        "--open-mode=append",
        f"--chdir={job['dir']}",
        f"--output={job['dir']}/slurm-%j.out",
    ]
    options += [f"--{key}={getattr(s, key)}" for key in ("partition", "account", "constraint") if getattr(s, key)]
    options += time_options(job.get("time", s.time))
    if gpus_per_node:
        options.append(f"--gres=gpu:{gpus_per_node}")
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {o}" for o in options),
        f"# dtrain {job['workload']} run {job['run_id']} (dtrain submit; docs/slurm.md). The batch step decides",
        "# whether the run starts or resumes, then runs one node task per node through srun.",
        'export PYTHONPATH="$PWD/code"',
        f"exec {shlex.quote(job['python'])} -m dtrain.common.slurmstep batch job.json",
    ]
    return "\n".join(lines) + "\n"


def time_options(limit: str) -> list[str]:
    """sbatch's --time (`limit`: the job's --time, else the cluster table's; "": the partition's) and the warning
    signal before it: Slurm sends the batch step (B:, the batch shell, which is the step itself) WARN_SIGNAL
    warning_lead_s before the limit; the step then stops the job as a preemption does and requeues it
    (dtrain.common.slurmstep.batch). None for a job without a limit."""
    from dtrain.control.slurm.spec import WARN_SIGNAL, limit_seconds, warning_lead_s

    seconds = limit_seconds(limit)
    if limit and seconds is None:  # UNLIMITED, 0
        return [f"--time={limit}"]
    lead = warning_lead_s(seconds)
    return [*([f"--time={limit}"] if limit else []), f"--signal=B:{WARN_SIGNAL}@{lead}"]


def tar_of(files: Mapping[str, tuple[bytes, int]]) -> bytes:
    """An uncompressed tar of name -> (bytes, mode), as files are sent to the nodes over SSH's stdin."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, (data, mode) in files.items():
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), int(time.time()), mode
            tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()
