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

from dtrain.common.config import DEFAULT_OUTPUT
from dtrain.common.errors import ExitCode, UserError
from dtrain.common.storage import is_remote
from dtrain.control.events import Events, Handle


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
class LaunchResult:
    workload: str
    run_id: str
    url: str  # the run's directory or gs:// URL
    exit_code: int
    cluster: str  # "" for this machine

    @property
    def ok(self) -> bool:
        return self.exit_code == ExitCode.OK


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
    from dtrain.control.settings import builtin

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


def resume_ref(result: LaunchResult) -> str:
    """What `--resume` takes to find this run again from the folder the command ran in: its id where it sits
    under the default output (./runs), else its location (relative to that folder where it is below it, else
    absolute, or its gs:// URL). An id alone is looked for under the default output only, so a run given
    `--output` must be named by its place."""
    url, run_id = result.url, result.run_id
    if is_remote(url):
        return url
    here, path = Path.cwd().resolve(), Path(url).resolve()
    if path == here / DEFAULT_OUTPUT / run_id:
        return run_id
    return f"./{path.relative_to(here)}" if path.is_relative_to(here) else str(path)


def next_step(result: LaunchResult, program: bool = False) -> str:
    """What to tell the user after the job ended: where the run is, or how to continue it (a line that works
    as printed, from the folder it was printed in)."""
    w, r = result.workload, result.run_id
    if not r:  # no run was made (--show-example): none to point at
        return "" if result.exit_code in (ExitCode.OK, ExitCode.USAGE) else f"{w} failed (exit {result.exit_code})"
    if result.exit_code == ExitCode.USAGE:
        return ""
    resume = (
        f"dtrain train --resume {resume_ref(result)}" if program else f"dtrain train {w} --resume {resume_ref(result)}"
    )
    if program:  # a user's program
        if result.exit_code == ExitCode.OK:
            return f"run {r} completed: {result.url}"
        how = {ExitCode.PREEMPTED: "stopped", ExitCode.INTERRUPTED: "interrupted"}.get(result.exit_code, "failed")
        return f"run {r} {how} (exit {result.exit_code}): `{resume}` continues it from its checkpoint directory"
    if result.exit_code == ExitCode.OK:
        # its checkpoints: checkpoints/ where they were written in place, ckpt/ where they were copied there
        return f"run {r} completed: {result.url} (config.json, metrics.jsonl, its checkpoints, final/)"
    if result.exit_code == ExitCode.PREEMPTED:
        return f"run {r} stopped after a checkpoint: resume with `{resume}`"
    if result.exit_code == ExitCode.INTERRUPTED:
        return f"run {r} interrupted: `{resume}` continues from its last checkpoint"
    return (
        f"run {r} failed (exit {result.exit_code}); logs above. `{resume}` continues from its last complete checkpoint"
    )
