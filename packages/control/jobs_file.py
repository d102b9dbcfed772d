"""From `dtrain train`'s arguments to one Job and its launch settings: the command line over a [jobs.NAME]
table over a resumed run's saved job. Flags win; a table's values come next; then the defaults."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.program import Job, job_name, parse_command_line

# dtrain train's options that are settings ([run] keys), and the ones that shape the job or the launch.
SETTING_OPTIONS = {
    "cluster": "run.cluster",
    "nproc": "run.nproc",
    "output": "run.output",
    "resume": "run.resume",
    "run_id": "run.run_id",
    "max_restarts": "run.max_restarts",
    "hang_timeout": "run.hang_timeout",
    "startup_timeout": "run.startup_timeout",
}
LAUNCH_OPTIONS = ("image", "accept_new_host_keys", "oversubscribe")


def program_request(
    argv: Sequence[str], config_path: Path | None, *, submit: bool = False, tty: bool = False, debug: bool = False
) -> tuple[Any, dict[str, Any]]:
    """(a launch.LaunchRequest, the launch-only options) for `dtrain train ARGV` or `dtrain submit ARGV`:
    resolve_job's job and flags, with its launch options put where the request takes them."""
    from dtrain.control.launch import LaunchRequest

    job, flags, launch = resolve_job(argv, config_path, submit=submit)
    request = LaunchRequest(
        job=job,
        flags=flags,
        config_path=config_path,
        image=launch.get("image") or "",
        accept_new_host_keys=bool(launch.get("accept_new_host_keys")),
        oversubscribe=bool(launch.get("oversubscribe")),
        tty=tty,
        debug=debug,
    )
    return request, launch


def resolve_job(
    argv: Sequence[str], config_path: Path | None, *, submit: bool = False
) -> tuple[Job, dict[str, Any], dict[str, Any]]:
    """(the job, settings flags for load_settings, launch-only options) for `dtrain train ARGV`, or with
    `submit` for `dtrain submit ARGV` (its own options, program.SUBMIT_OPTIONS, among the launch options)."""
    from dtrain.control.program import SUBMIT_OPTIONS, Parsed, Program
    from dtrain.control.settings import load_settings
    from dtrain.control.workloads import WORKLOADS

    extra = SUBMIT_OPTIONS if submit else []
    parsed: Parsed = parse_command_line(argv, extra)
    o = parsed.options
    flags = {key: o.get(dest) for dest, key in SETTING_OPTIONS.items()}
    launch = {k: o.get(k) for k in (*LAUNCH_OPTIONS, *(opt.dest for opt in extra))}
    settings = load_settings(config_path, {})  # the file's [jobs] tables, and the file checked as a whole
    workdir = Path(o["workdir"]).resolve() if o.get("workdir") else Path.cwd().resolve()
    if parsed.program is not None:
        p: Program = parsed.program
        name = job_name(p.target if p.target else p.args[0])
        job = Job(name=name, program=p, workdir=workdir)
    elif parsed.name:
        if parsed.name in WORKLOADS:  # reached only through the group's routing; kept for safety
            raise UserError(f"{parsed.name} is a built-in: dtrain train {parsed.name} --help lists its options")
        table = settings.jobs.get(parsed.name)
        if table is None:
            known = ", ".join(sorted([*settings.jobs, *WORKLOADS]))
            where = settings.file or "dtrain.toml (none here)"
            raise UserError(
                f"no job {parsed.name!r}: not a [jobs.{parsed.name}] table in {where} nor a built-in (known: {known}); "
                f"a script must end in .py, and a command goes after --: dtrain train -- {parsed.name} ..."
            )
        job = with_args(table.job, parsed.extra, f"[jobs.{parsed.name}]")  # the command line's follow the table's
        if o.get("workdir"):
            job = dataclasses.replace(job, workdir=workdir)
        for dest, value in (("cluster", table.cluster), ("nproc", table.nproc), ("max_restarts", table.max_restarts)):
            if flags[SETTING_OPTIONS[dest]] is None and value not in (None, ""):
                flags[SETTING_OPTIONS[dest]] = value
        if not launch["image"] and table.image:
            launch["image"] = table.image
    else:
        job = resumed_job(o.get("resume") or "", flags, config_path)
        job = with_args(job, parsed.extra, f"run {o.get('resume')}")  # --resume RUN -- ARGS: the run's, then these
    if o.get("setup"):
        job = dataclasses.replace(job, setup=(*job.setup, *o["setup"]))
    if o.get("env"):
        job = dataclasses.replace(job, env={**job.env, **o["env"]})
    if o.get("code_limit") is not None:
        job = dataclasses.replace(job, code_limit_mb=o["code_limit"])
    if o.get("checkpoint_dir"):
        job = dataclasses.replace(job, checkpoint_dir=o["checkpoint_dir"])
    if o.get("nodes") is not None:
        job = dataclasses.replace(job, nodes=o["nodes"])
    if o.get("time"):
        job = dataclasses.replace(job, time=o["time"])
    return job, flags, launch


def with_args(job: Job, args: Sequence[str], what: str) -> Job:
    """`job` with `args` added at the end of its program's line: a job table's program with the command line's
    arguments, a resumed run's with those after `--resume RUN --` (for an argparse-style program, an option
    given again takes its new value)."""
    if not args:
        return job
    prog = job.program
    if prog.kind == "shell":
        raise UserError(f"{what} runs a shell line: put its arguments in that line")
    return dataclasses.replace(job, program=dataclasses.replace(prog, args=(*prog.args, *args)))


def resumed_job(resume: str, flags: dict[str, Any], config_path: Path | None) -> Job:
    """`dtrain train --resume RUN` with no program: the job the run saved in its config.json."""
    from dtrain.common.rundir import locate, read_json
    from dtrain.control.program import Program
    from dtrain.control.settings import load_settings

    settings = load_settings(config_path, flags)
    run = locate(settings.run.output, resume)
    cfg = read_json(run, "config.json") or {}
    saved = cfg.get("job")
    if cfg.get("kind") != "program" or not isinstance(saved, dict):
        what = cfg.get("workload") or "?"
        raise UserError(f"run {run.url} is a built-in {what} run: resume it with dtrain train {what} --resume {resume}")
    # The run's own processes per node unless --nproc says otherwise: the default (2 on CPU, one per GPU)
    # may differ from what it started with, and another world size trains differently from its checkpoint.
    # And on the cluster it ran on, unless --cluster (or the settings) name another: a run is moved on purpose.
    if flags.get("run.cluster") is None and settings.source("run.cluster") == "default" and cfg.get("cluster"):
        flags["run.cluster"] = cfg["cluster"]
    world, nodes = cfg.get("world_size"), cfg.get("nodes")
    if flags.get("run.nproc") is None and isinstance(world, int) and isinstance(nodes, int) and world > 0 < nodes:
        flags["run.nproc"] = world // nodes
    return Job(
        name=str(saved["name"]),
        program=Program.from_json(saved["program"]),
        workdir=Path(saved["workdir"]) if saved.get("workdir") else None,
        setup=tuple(saved.get("setup") or ()),
        env=dict(saved.get("env") or {}),
        nodes=int(saved.get("nodes") or 0),
        checkpoint_dir=str(saved.get("checkpoint_dir") or ""),
        code_limit_mb=int(saved.get("code_limit_mb") or 0),
    )
