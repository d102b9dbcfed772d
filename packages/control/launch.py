"""The front door of every job: `dtrain train`, `dtrain submit` and the dashboard's POST /jobs build one
`LaunchRequest`, and `resolve` turns it into a launchers.Plan, once, in one place.

    result = launch(LaunchRequest(workload="mnist", flags={"mnist.epochs": 3}), events=Events(), handle=Handle())
    result = launch(LaunchRequest(job=job, flags={"run.cluster": "lab"}), events=..., handle=...)   # a program
    queued = submit(LaunchRequest(workload="mnist", nodes=2, flags={"run.cluster": "demo"}), events=..., handle=...)

The request carries what the user gave (settings keys -> values; None: not given). `resolve` reads the
settings, starts the cluster if its backend made it and it is stopped (autostop), and turns a built-in into
a program right there (`builtin_job`: its module under torchrun with its flags, its settings resolved with a
resumed run's saved config beneath the file, environment and flags). Below it there is one kind of job: a
Plan, which every launcher carries out the same way whatever program it holds. Progress comes as events,
stopping goes through the handle, and the job's exit code comes back in the result.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.common import jobenv
from dtrain.common.errors import UserError
from dtrain.common.jobenv import STOP_GRACE_S
from dtrain.control.events import Events, Handle
from dtrain.control.launch_result import LaunchResult

if TYPE_CHECKING:
    from dtrain.control.launchers import Feature, Plan
    from dtrain.control.program import Job
    from dtrain.control.slurm.submit import SubmitResult


def _grace_s() -> float:
    """The stop grace period (SIGTERM, then this long before SIGKILL); DTRAIN_INTERNAL_STOP_GRACE_S shortens it
    for tests."""
    return float(os.environ.get("DTRAIN_INTERNAL_STOP_GRACE_S", STOP_GRACE_S))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    """One job as the user asked for it: a built-in by its name (`workload`, its settings among `flags`), or a
    user's program (`job`, from dtrain.control.jobs_file.program_request, with its [run] settings in `flags`)."""

    workload: str = ""
    job: Job | None = None
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # settings key -> value or None
    config_path: Path | None = None  # --config; None: ./dtrain.toml if there is one
    image: str = ""  # run in this Docker image on every node of the cluster (container mode)
    accept_new_host_keys: bool = False
    oversubscribe: bool = False  # allow more processes than cores (or GPUs)
    tty: bool = False  # the job's output goes to a terminal: rank 0 draws a live progress bar
    debug: bool = False  # keep torchrun's own logs
    # A built-in's --time and --nodes (`dtrain submit mnist`); a program's are in its job (its line, its table).
    time: str = ""  # a Slurm job's --time ("": the cluster table's); Slurm clusters only
    nodes: int = 0
    grace_s: float = dataclasses.field(default_factory=_grace_s)

    def __post_init__(self) -> None:
        if bool(self.workload) == (self.job is not None):
            raise ValueError("a LaunchRequest names a built-in (workload) or holds a program (job), not both")


def resolve(req: LaunchRequest, *, events: Events, handle: Handle, needs: tuple[Feature, ...] = ()) -> Plan:
    """The request resolved once into a launchers.Plan: the one plan builder for every job. Every refusal comes
    first (bad input, a feature in `needs` that its cluster's launcher lacks), before anything is reached; then
    a cluster that its backend made and that is stopped (autostop) is started, and the plan made again from the
    record that left (a node's address may change)."""
    return _resolved(req, events=events, handle=handle, needs=needs)[0]


def _resolved(
    req: LaunchRequest, *, events: Events, handle: Handle, needs: tuple[Feature, ...] = ()
) -> tuple[Plan, Any]:
    from dtrain.control import backends

    plan, settings, cfg = _plan(req, needs)
    if backends.start_if_stopped(cfg, events=events, handle=handle):
        plan, settings, cfg = _plan(req, needs)
    return plan, settings


def launch(req: LaunchRequest, *, events: Events, handle: Handle) -> LaunchResult:
    """Run the job to its end where the settings say, through its cluster's launcher; the job's exit code."""
    from dtrain.control import launchers

    plan, settings = _resolved(req, events=events, handle=handle)
    result = launchers.get(plan.cluster.launcher).launch(plan, events=events, handle=handle)
    if req.workload and getattr(settings.workload(req.workload), "show_example", False):
        # --show-example prints an example and exits before a run directory is made: no run to point at
        return dataclasses.replace(result, run_id="", url="")
    return result


def submit(req: LaunchRequest, *, name: str = "", events: Events, handle: Handle) -> SubmitResult:
    """Queue the job on its cluster's queue (Slurm) and return at once with the job id."""
    from dtrain.control.launchers import Feature
    from dtrain.control.slurm.programs import submit_plan

    plan = resolve(req, events=events, handle=handle, needs=(Feature.QUEUE,))
    return submit_plan(plan, name=name, events=events)


def _plan(req: LaunchRequest, needs: tuple[Feature, ...] = ()) -> tuple[Plan, Any, Any]:
    """The Plan of `req` (nothing started, nothing written), the settings it was made from and its cluster's
    table (a settings.ClusterConfig)."""
    from dtrain.control import backends, launchers
    from dtrain.control.program import check_program
    from dtrain.control.settings import get_cluster, load_settings, run_output
    from dtrain.control.userjob import program_target

    if req.job is not None:
        check_program(req.job)
    settings = load_settings(req.config_path, req.flags)
    cfg = get_cluster(settings)
    cluster = backends.get(cfg.backend).cluster(cfg)
    for feature in needs:
        launchers.require(cluster, feature)
    # Container mode on every launcher that has nodes (here.py refuses it); --time; an image where one is needed.
    cluster = launchers.job_cluster(cluster, image=req.image, time=req.job.time if req.job is not None else req.time)
    output = run_output(settings, cluster)  # a gcp cluster's runs go to its bucket
    if req.job is not None:
        job, mounts, line, own_config = req.job, (), req.job.program.describe(), False
        if settings.run.tracker and jobenv.TRACKERS not in job.env:  # what dtrain.sdk.log reports to: docs/trackers.md
            names = ",".join(k.value for k in settings.run.tracker)
            job = dataclasses.replace(job, env={**job.env, jobenv.TRACKERS: names})
        target = program_target(job, output, settings.run.run_id, settings.run.resume)
    else:  # a built-in becomes a program here; its flags are its config, which it writes in config.json itself
        settings, job, target, mounts = builtin_job(req, settings, output)
        line, own_config = "", True
    # A queue's nodes are its scheduler's to pick (Slurm's, from its partition, which is checked there).
    if job.nodes and not launchers.has(cluster, launchers.Feature.QUEUE):
        if job.nodes > len(cluster.nodes):
            raise UserError(
                f"--nodes {job.nodes} is more than cluster {cluster.name or 'this machine'}'s "
                f"{len(cluster.nodes)} node(s)"
            )
        cluster = dataclasses.replace(cluster, nodes=cluster.nodes[: job.nodes])
    plan = launchers.Plan(
        job=job,
        target=target,
        cluster=cluster,
        own_config=own_config,
        line=line,
        nproc=settings.launch.nproc,
        max_restarts=settings.launch.max_restarts,
        hang_timeout=settings.launch.hang_timeout_s,
        startup_timeout=settings.launch.startup_timeout,
        sample_interval=settings.launch.sample_interval,
        image=req.image,
        accept_new_host_keys=req.accept_new_host_keys,
        oversubscribe=req.oversubscribe,
        tty=req.tty,
        debug=req.debug,
        grace_s=req.grace_s,
        mounts=mounts,
    )
    return plan, settings, cfg


def builtin_job(req: LaunchRequest, settings: Any, output: str) -> tuple[Any, Job, Any, tuple[tuple[str, str], ...]]:
    """A built-in as a program: (its settings with a resumed run's saved config beneath the file, environment and
    flags, validated as a whole; its Job: its module under torchrun with its flags; its run, placed as a program's
    is; the node paths its flags name, mounted at the same place in container mode)."""
    from dtrain.common.config import to_argv
    from dtrain.common.rundir import locate, read_json, run_location
    from dtrain.control.program import MODULE, Job, Program
    from dtrain.control.remote import node_paths
    from dtrain.control.settings import load_settings
    from dtrain.control.userjob import Target, resumed_target
    from dtrain.control.workloads import builtin

    workload = req.workload
    resumed = None
    if settings.run.resume:
        # The run's own config sits beneath the file, environment and flags.
        resumed = locate(output, settings.run.resume)
        saved = read_json(resumed, "config.json") or {}
        if saved.get("workload", workload) != workload:
            raise UserError(f"run {resumed.url} is a {saved['workload']} run: use `dtrain train {saved['workload']}`")
        flat = saved.get("config") or {}
        settings = load_settings(req.config_path, req.flags, saved=(f"{resumed.url}/config.json", workload, flat))
    settings.workload(workload)  # validate the whole workload config before starting anything
    # Its flags: the settings given, and where the run lives (`--run-dir`; `--resume` when it continues one).
    explicit = dict(settings.explicit(workload))
    if resumed is not None:
        target = resumed_target(resumed)
        args = {**explicit, "output": output, "resume": resumed.url, "run_dir": resumed.url}
    else:
        run_id, run = run_location(workload, output, explicit.get("run_id") or "")
        target = Target(run_id, run, 0, False)
        args = {**explicit, "output": output, "run_id": run_id, "run_dir": run.url}
    program = Program(kind=MODULE, target=builtin(workload).module, args=tuple(to_argv(args)))
    job = Job(name=workload, program=program, nodes=req.nodes, time=req.time)
    return settings, job, target, tuple(sorted(node_paths(args, target.run.url).items()))
