"""Start a workload where the settings say: on this machine, or on every node of a cluster.

    result = launch(LaunchRequest(workload="mnist", flags={"mnist.epochs": 3}), events=Events(), handle=Handle())

The request carries what the user gave (settings keys -> values; None: not given); the settings
are resolved here, once, with a resumed run's saved config beneath the file, environment and
flags. The cluster's backend decides how the job starts (its Cluster's `launcher`). Progress comes
as events, stopping goes through the handle, and the job's exit code comes back in the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.events import Events, Handle
from dtrain.control.launch_result import LaunchResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchRequest:
    workload: str
    flags: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # settings key -> value or None
    config_path: Path | None = None  # --config; None: ./dtrain.toml if there is one
    image: str = ""  # run in this Docker image on every node of the cluster (container mode)
    accept_new_host_keys: bool = False
    oversubscribe: bool = False  # allow more processes than cores (or GPUs)
    tty: bool = False  # the job's output goes to a terminal: rank 0 draws a live progress bar
    debug: bool = False  # keep torchrun's own logs
    time: str = ""  # a Slurm job's --time ("": the cluster table's); Slurm clusters only


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A request's settings resolved once: the cluster it goes to, where its run goes, the run it resumes."""

    settings: Any  # dtrain.control.settings.Settings, with a resumed run's config beneath the rest
    cluster: Any  # dtrain.control.cluster.Cluster
    output: str
    resumed: Any  # the resumed run's Store, or None


def resolve(req: LaunchRequest) -> Resolved:
    """Resolve the settings, the cluster (its backend) and the output, locate a --resume run and put its
    saved config beneath the file, environment and flags, and validate the workload's whole config."""
    from dtrain.common.rundir import locate, read_json
    from dtrain.control import backends, launchers
    from dtrain.control.settings import get_cluster, load_settings, run_output

    workload = req.workload
    settings = load_settings(req.config_path, req.flags)
    cfg = get_cluster(settings)
    cluster = backends.get(cfg.backend).cluster(cfg)
    output = run_output(settings, cluster)  # a gcp cluster's runs go to its bucket
    # The same refusals and container mode as a user's program's (--image, --time, a cluster that needs an image).
    cluster = launchers.job_cluster(cluster, image=req.image, time=req.time)
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
    return Resolved(settings, cluster, output, resumed)


def launch(req: LaunchRequest, *, events: Events, handle: Handle) -> LaunchResult:
    """Resolve the settings and run the built-in to its end, through its cluster's launcher like any program
    (its module under torchrun, with its flags); returns the job's exit code."""
    from dtrain.control import launchers

    r = resolve(req)  # the cluster as the job sees it (launchers.job_cluster)
    plan = builtin_plan(req, r)
    result = launchers.get(r.cluster.launcher).launch(plan, events=events, handle=handle)
    if getattr(r.settings.workload(req.workload), "show_example", False):
        # --show-example prints an example and exits before a run directory is made: no run to point at
        return dataclasses.replace(result, run_id="", url="")
    return result


def builtin_plan(req: LaunchRequest, r: Resolved) -> Any:
    """A built-in as a launchers.Plan, the shape of a user's program: its module under torchrun with its flags,
    its run placed as a program's (builtin_target). `dtrain train` and `dtrain submit` both start from it."""
    from dtrain.common.config import to_argv
    from dtrain.control import launchers
    from dtrain.control.program import MODULE, Job, Program
    from dtrain.control.remote import node_paths
    from dtrain.control.workloads import builtin

    target, args = builtin_target(req.workload, r)
    job = Job(
        name=req.workload,
        program=Program(kind=MODULE, target=builtin(req.workload).module, args=tuple(to_argv(args))),
        builtin=req.workload,
        time=req.time,
    )
    return launchers.Plan(
        job=job,
        target=target,
        cluster=r.cluster,
        nproc=r.settings.launch.nproc,
        max_restarts=r.settings.launch.max_restarts,
        hang_timeout=r.settings.launch.hang_timeout_s,
        startup_timeout=r.settings.launch.startup_timeout,
        image=req.image,
        accept_new_host_keys=req.accept_new_host_keys,
        oversubscribe=req.oversubscribe,
        tty=req.tty,
        debug=req.debug,
        mounts=tuple(sorted(node_paths(args, target.run.url).items())),
    )


def builtin_target(workload: str, r: Resolved) -> tuple[Any, dict[str, Any]]:
    """A built-in's run, placed as a program's is (dtrain.control.userjob.Target), and its module's flags: the
    settings given, and where the run lives (`--run-dir`; `--resume` when it continues one)."""
    from dtrain.common.rundir import read_json, run_location
    from dtrain.control.userjob import Target

    explicit = dict(r.settings.explicit(workload))
    if r.resumed is not None:
        run = r.resumed
        status = read_json(run, "status.json") or {}
        target = Target(run.url.rstrip("/").rsplit("/", 1)[-1], run, int(status.get("starts", 1)), True)
        return target, {**explicit, "output": r.output, "resume": run.url, "run_dir": run.url}
    run_id, run = run_location(workload, r.output, explicit.get("run_id") or "")
    return Target(run_id, run, 0, False), {**explicit, "output": r.output, "run_id": run_id, "run_dir": run.url}
