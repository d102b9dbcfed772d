"""`dtrain runs` and `dtrain logs`: runs under --output with their status and best metric, and a
cluster run's per-node logs."""

import json
from typing import Annotated

import typer

from dtrain.cli import console
from dtrain.cli import options as o


def _output(output: str | None) -> str:
    """--output, else the settings' (a gcp cluster named by run.cluster: its bucket, as `train` uses)."""
    from dtrain.control.settings import load_settings, run_output

    return run_output(load_settings(console.state.config_path, {"run.output": output}))


def runs(output: o.Output = None, as_json: o.Json = False) -> None:
    """List runs (newest first) with their status and best metric (--json: with each rank's peak memory and
    each node's CPU and memory curves)."""
    from dtrain.control.runs import best_label, list_runs

    where = _output(output)
    rows = list_runs(where, resources=as_json)
    if as_json:
        console.out.print_json(json.dumps(rows))
        return
    if not rows:
        console.out.print(f"no runs under {where}")
        return
    from rich.table import Table

    table = Table(title=f"runs in {where}")
    for col in ("run", "status", "started (UTC)", "step", "best", "world"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        best = best_label(r)
        table.add_row(
            r["run_id"],
            _styled(r["status"]),
            r["started"] or "-",
            str(r["step"] or "-"),
            best,
            str(r["world_size"] or "-"),
        )
    console.out.print(table)


def _styled(status: str) -> str:
    colour = {"completed": "green", "running": "cyan", "preempted": "yellow", "interrupted": "yellow"}.get(
        status, "red"
    )
    return f"[{colour}]{status}[/]"


def logs(
    run: Annotated[str, typer.Argument(help="run id under --output, or the run's directory / gs:// URL; or a job id")],
    output: o.Output = None,
    node: Annotated[str | None, typer.Option("--node", help="only this node's lines", show_default=False)] = None,
    cluster: o.Cluster = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new lines until the run or job ends")
    ] = False,
) -> None:
    """A cluster run's logs: every node's lines in time order, prefixed with the node's name; -f follows them
    live. A Slurm job's (`dtrain logs JOB --cluster NAME [-f]`) the same way."""
    if run.isdigit():  # a Slurm job id (run ids are <workload>-<time>-<hex>)
        from dtrain.cli import jobs_cmd

        return jobs_cmd.logs(run, cluster, follow)
    if follow:
        from dtrain.control.logs import follow_logs

        with console.operation() as (_events, handle):
            for line in follow_logs(_output(output), run, node=node, handle=handle):
                console.out.print(f"[{line.node}] {line.text}", markup=False, highlight=False, soft_wrap=True)
        return
    from dtrain.control.runs import node_logs

    _run_id, lines = node_logs(_output(output), run, node)
    for line in lines:
        console.out.print(f"[{line.node}] {line.text}", markup=False, highlight=False, soft_wrap=True)
