"""Queued jobs on a cluster with Slurm: `dtrain submit <workload>` (or a user's program: `dtrain submit
train.py ...`, -m module, a [jobs.NAME] table, -- command), `dtrain jobs`, `dtrain cancel JOB`,
`dtrain logs JOB [-f]` (dispatched here from cli/runs_cmd.py), and `dtrain slurm setup`. The work is
dtrain.control.slurm."""

import json
from typing import Annotated, Any

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.cli.train_cmd import PROGRAM_ARGV, SubmitGroup

submit_app = typer.Typer(
    cls=SubmitGroup,
    help=(
        "Queue a job on a Slurm cluster: prints the job id and returns at once. Your own script (dtrain submit "
        "train.py [ARGS] --cluster NAME), a module (-m pkg.train), a [jobs.NAME] table, any command once per node "
        "(dtrain submit --cluster NAME -- CMD ...), or a built-in example below (its own options: dtrain submit "
        "mnist --help). "
        "The options below are dtrain's wherever they stand; any other argument, and everything after --, is the "
        "program's (docs/slurm.md)."
    ),
    no_args_is_help=True,
)
slurm_app = typer.Typer(help="Slurm on dtrain's own clusters.", no_args_is_help=True)

Job = Annotated[str, typer.Argument(help="the Slurm job id `dtrain submit` printed")]
SUBMIT_ONLY = {
    "nodes": (
        Annotated[
            int | None,
            typer.Option("--nodes", min=1, help="nodes for the job (default: all of dtrain's own cluster; 1 on a "
                         "Slurm cluster, or its table's nodes)", show_default=False),
        ],
        None,
    ),
    "name": (
        Annotated[
            str | None, typer.Option("--name", help="the job's name (default: the workload)", show_default=False)
        ],
        None,
    ),
}  # fmt: skip


def _cluster(name: str | None) -> Any:
    from dtrain.control.settings import load_cluster

    return load_cluster(console.state.config_path, name)


def _submit(workload: str, flags: dict[str, Any], given: dict[str, Any]) -> None:
    from dtrain.control.events import Events
    from dtrain.control.launch import LaunchRequest, submit
    from dtrain.control.slurm.spec import check_time

    request = LaunchRequest(
        workload=workload,
        flags=flags,
        config_path=console.state.config_path,
        image=given["image"] or "",
        accept_new_host_keys=given["accept_new_host_keys"],
        oversubscribe=given["oversubscribe"],
        debug=console.state.debug,
        time=check_time(given["time"], "--time") if given["time"] else "",
        nodes=given["nodes"] or 0,
    )
    # stdout carries the job id alone (for scripts): what submit reports goes to stderr.
    events = Events(lambda ev: console.err.print(ev.message, markup=False, highlight=False) if ev.message else None)
    with console.operation() as (_terminal, handle):
        r = submit(request, name=given["name"] or "", events=events, handle=handle)
    _queued(r)


def _queued(r: Any) -> None:
    """The job id alone on stdout (for scripts); what was queued, on stderr."""
    print(r.job_id, flush=True)
    verb = "resumes" if r.resuming else "runs"
    console.err.print(
        f"job {r.job_id} ({r.name}) queued on cluster {r.cluster}, partition {r.partition}, {r.nodes} node(s): it "
        f"{verb} {r.workload} run {r.run_id} ({r.url}). Next: dtrain jobs --cluster {r.cluster}; "
        f"dtrain logs {r.job_id} -f --cluster {r.cluster}",
        highlight=False,
        markup=False,
    )


def register_all() -> None:
    """One `dtrain submit NAME` per workload. cli/main.py calls it only when `submit` is on the command line,
    as it does train_cmd.register_all for `train`: `dtrain --help` need not read every workload's settings."""
    from dtrain.cli.train_cmd import workload_command
    from dtrain.control.workloads import WORKLOADS

    if any(c.name in WORKLOADS for c in submit_app.registered_commands):
        return
    for name in WORKLOADS:
        submit_app.command(name)(workload_command(name, _submit, SUBMIT_ONLY))


@submit_app.command(
    "program",
    hidden=True,
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
)
def submit_program(ctx: typer.Context) -> None:
    """Queue a script, module, job table or command (see `dtrain submit --help`)."""
    from dtrain.control.events import Events
    from dtrain.control.jobs_file import program_request
    from dtrain.control.launch import submit as control_submit

    argv = ctx.meta.get(PROGRAM_ARGV, list(ctx.args))
    if argv and argv[0] in ("-h", "--help"):
        console.out.print(submit_app.info.help, highlight=False)
        return
    request, launch = program_request(argv, console.state.config_path, submit=True, debug=console.state.debug)
    events = Events(lambda ev: console.err.print(ev.message, markup=False, highlight=False) if ev.message else None)
    with console.operation() as (_terminal, handle):
        r = control_submit(request, name=launch.get("name") or "", events=events, handle=handle)
    _queued(r)


def jobs(
    cluster: o.Cluster = None,
    as_json: o.Json = False,
    all_jobs: Annotated[bool, typer.Option("--all", help="every job dtrain submitted there, ended ones too")] = False,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
) -> None:
    """The jobs dtrain submitted to a Slurm cluster: queued and running ones, and those of the last day."""
    from dtrain.control.slurm.joblist import list_jobs

    c = _cluster(cluster)
    rows = [r.as_dict() for r in list_jobs(c, all_jobs=all_jobs, accept_new_host_keys=accept_new_host_keys)]
    for r in rows:
        r.setdefault("stragglers", "")  # "h1 rank 1 (2.3x)": ranks much slower than the others ("" for none)
    if as_json:
        print(json.dumps(rows))
        return
    if not rows:
        console.out.print(f"no jobs on cluster {c.name}" + ("" if all_jobs else " (--all: ended ones too)"))
        print_service(c, accept_new_host_keys)
        return
    import shutil

    table, hidden = jobs_table(rows, c.name, shutil.get_terminal_size((80, 24)).columns)
    console.out.print(table)
    if hidden:
        console.out.print(f"[dim]not shown at this width: {', '.join(hidden)} (a wider terminal, or --json)[/]")
    if "$ est." not in hidden and any(r["usd"] is not None for r in rows):
        from dtrain.control.gcp.prices import PRICES_AS_OF, PRICES_REGION, PRICES_SOURCE

        console.out.print(
            f"[dim]$ est.: node-hours (Slurm's elapsed x nodes) at dtrain's price table: {PRICES_REGION} list "
            f"prices as of {PRICES_AS_OF} ({PRICES_SOURCE}), Spot at 60% off; your bill may differ[/]"
        )
    print_service(c, accept_new_host_keys)


def print_service(cluster: Any, accept_new_host_keys: bool = False) -> None:
    """The cluster service's lines (preemptions, restarts, waiting for capacity, autostop), if it runs there."""
    from dtrain.control.service_state import service_state

    state = service_state(cluster, accept_new_host_keys=accept_new_host_keys)
    if not state or not state.get("lines"):
        return
    console.out.print("service:", highlight=False)
    for line in state["lines"]:
        console.out.print(f"  {line}", highlight=False, markup=False)


# `dtrain jobs`' columns in the order shown, and the order they are given up when the terminal is too narrow
# for all (as squeue's and `sky status`' default views keep a few): job, state and run always stay. Stragglers
# come first of the rest, and only when a job has one; where even they do not fit, its state says "straggler".
JOB_COLUMNS = ("job", "name", "workload", "state", "stragglers", "nodes", "submitted", "started", "duration",
               "node-hours", "$ est.", "run", "restarts", "last metric")  # fmt: skip
KEPT = ("job", "state", "run")
BY_PRIORITY = ("stragglers", "duration", "last metric", "nodes", "name", "restarts", "started", "workload", "$ est.",
               "node-hours", "submitted")  # fmt: skip
STRAGGLER_MARK = " (straggler)"  # a job's state when the stragglers column does not fit


def _cells(r: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Each column's (plain text, rich markup) for one job."""
    state = r["state"] + (f" ({r['reason']})" if r["reason"] and r["state"] == "PENDING" else "")
    state += f" (exit {r['exit_code']})" if r["exit_code"] not in (None, 0) else ""
    if r.get("time_limit"):  # requeued at its time limit to continue its run: "continuing (time limit, 2)"
        state = f"{r['time_limit']}" + (f" ({state})" if r["state"] not in ("COMPLETED", "RUNNING") else "")
    colour = _colour(r["state"])
    if r["stalled"]:  # running, but its metrics have not advanced for the cluster's stall_after
        state, colour = f"stalled since {r['stalled_since'].replace('T', ' ')} ({state})", "red"
    plain = {
        "job": r["job_id"], "name": r["name"], "workload": r["workload"], "state": state, "nodes": str(r["nodes"]),
        "submitted": _short_time(r["submitted"]), "started": _short_time(r["started"]),
        "duration": r["duration"] or "-",
        "node-hours": f"{r['node_hours']:.2f}", "$ est.": "-" if r["usd"] is None else f"{r['usd']:.2f}",
        "run": r["run_id"], "restarts": str(r["restarts"]), "last metric": _metric(r["last_metric"]),
        "stragglers": r.get("stragglers") or "-",
    }  # fmt: skip
    colours = {"state": colour, "stragglers": "yellow"}
    return {k: (v, f"[{colours[k]}]{console.escape(v)}[/]" if k in colours else console.escape(v))
            for k, v in plain.items()}  # fmt: skip


def _short_time(text: str) -> str:
    """ "2026-11-25T16:02:11" as "11-25 16:02" (--json has the full time); "-" for none."""
    if len(text) >= 16 and text[4] == "-" and text[10] == "T":
        return f"{text[5:10]} {text[11:16]}"
    return text or "-"


def jobs_table(rows: list[dict[str, Any]], cluster: str, width: int) -> tuple[Any, list[str]]:
    """The table for `width` columns of terminal, and the names of the columns left out to fit."""
    from rich.table import Table

    cells = [_cells(r) for r in rows]

    def cost(col: str) -> int:  # its widest cell or header, its padding (1 each side) and a border
        return max(len(col), *(len(c[col][0]) for c in cells)) + 3

    slow = [c for c in cells if c["stragglers"][0] != "-"]
    candidates = [col for col in BY_PRIORITY if col != "stragglers" or slow]  # no column of dashes
    if slow and 1 + sum(cost(col) for col in (*KEPT, "stragglers")) > width:
        candidates.remove("stragglers")
        for c in slow:
            plain, styled = c["state"]
            c["state"] = (plain + STRAGGLER_MARK, styled + f"[yellow]{STRAGGLER_MARK}[/]")
    used = 1 + sum(cost(col) for col in KEPT)
    shown = set(KEPT)
    for col in candidates:
        if used + cost(col) <= width:
            shown.add(col)
            used += cost(col)
    table = Table(title=f"jobs on cluster {cluster}", title_justify="left")
    columns = [col for col in JOB_COLUMNS if col in shown]
    for col in columns:
        table.add_column(col, no_wrap=col != "last metric")
    for c in cells:
        table.add_row(*(c[col][1] for col in columns))
    return table, [col for col in JOB_COLUMNS if col not in shown and (col != "stragglers" or slow)]


def _colour(state: str) -> str:
    return {"RUNNING": "cyan", "PENDING": "yellow", "COMPLETED": "green", "CANCELLED": "yellow"}.get(state, "red")


def _metric(m: dict[str, Any]) -> str:
    if not m:
        return "-"
    for key in ("eval_accuracy", "eval_loss", "loss"):
        if isinstance(m.get(key), (int, float)):
            return f"{key} {m[key]:.4g} (step {m.get('step', '?')})"
    return f"step {m.get('step', '?')}"


def cancel(job: Job, cluster: o.Cluster = None, accept_new_host_keys: o.AcceptNewHostKeys = False) -> None:
    """Cancel a job: its ranks get SIGTERM, save a checkpoint and stop; the run and its checkpoints are kept."""
    from dtrain.control.slurm.cancel import cancel as cancel_job

    c = _cluster(cluster)
    with console.operation() as (events, handle):
        r = cancel_job(c, job, events=events, handle=handle, accept_new_host_keys=accept_new_host_keys)
    state = r.state.state if r.state else "UNKNOWN"
    if r.eval_id:
        console.out.print(
            f"job {r.job_id} {state} (was {r.was}); evaluation {r.eval_id} of run {r.run_id} stopped ({r.url})",
            highlight=False,
        )
        return
    kept = f"its last checkpoint {r.checkpoint} is kept" if r.checkpoint else "it had no checkpoint yet"
    console.out.print(f"job {r.job_id} {state} (was {r.was}); run {r.run_id}: {kept} ({r.url})", highlight=False)


def logs(job: str, cluster: str | None, follow: bool) -> None:
    """A job's logs: every node's lines, prefixed with its name; with `follow`, live until the job ends."""
    from dtrain.control.slurm import joblogs as control

    c = _cluster(cluster)
    if not follow:
        for line in control.job_logs(c, job):
            console.out.print(f"[{line.node}] {line.text}", markup=False, highlight=False, soft_wrap=True)
        return
    with console.operation() as (events, handle):
        r = control.follow_logs(c, job, events=events, handle=handle)
    if r.state is not None and not r.stopped:
        code = f" (exit {r.state.exit_code})" if r.state.exit_code is not None else ""
        console.err.print(f"job {job} {r.state.state}{code}", highlight=False)


@slurm_app.command("setup")
def setup(cluster: o.Cluster = None, accept_new_host_keys: o.AcceptNewHostKeys = False) -> None:
    """Install and start Slurm (munge, slurmctld on the master, slurmd on every node) on a hosts cluster with
    slurm = true, or again on a gcp cluster (`dtrain up` does it); run it again after changing the nodes."""
    from dtrain.control.slurm.setup import setup as control_setup

    c = _cluster(cluster)
    with console.operation() as (events, handle):
        r = control_setup(c, events=events, handle=handle, accept_new_host_keys=accept_new_host_keys)
    console.out.print(
        f"[green]Slurm is up on cluster {r.cluster}[/]: {len(r.nodes)} node(s) in {r.seconds:.1f} s. Next: "
        f"dtrain submit mnist --cluster {r.cluster}",
        highlight=False,
    )


__all__ = ["submit_app", "slurm_app", "jobs", "cancel", "logs", "setup"]
