"""Commands on a cluster's nodes: `dtrain doctor`, `dtrain gpus`, `dtrain exec`, `dtrain ssh`
(the work is dtrain.control.nodes)."""

import dataclasses
import json
import os
import subprocess
import sys
from typing import Annotated, Any

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.common.errors import ExitCode


def _cluster(name: str | None) -> Any:
    from dtrain.control.settings import load_cluster

    return load_cluster(console.state.config_path, name)


def gpus(
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of a table")] = False,
) -> None:
    """Query every node's GPUs with nvidia-smi: model, memory, utilisation, temperature, driver."""
    from dtrain.control.nodes import gpus as node_gpus

    results = node_gpus(_cluster(cluster), accept_new_host_keys=accept_new_host_keys)
    if as_json:
        out = {n: r if isinstance(r, str) else [dataclasses.asdict(g) for g in r] for n, r in results.items()}
        console.out.print_json(json.dumps(out))
        return
    from rich.table import Table

    t = Table("node", "gpu", "model", "memory used / total", "util", "temp", "driver")
    for node, r in results.items():
        if isinstance(r, str):
            t.add_row(node, "-", r, "", "", "", "")
            continue
        for g in r:
            t.add_row(node, g.index, g.name, f"{g.used_mib} / {g.total_mib} MiB", f"{g.util}%", f"{g.temp} C", g.driver)
    console.out.print(t)


def exec_(
    node: Annotated[str, typer.Argument(help="node name, or 'all' for every node")],
    command: Annotated[list[str], typer.Argument(help="the command and its arguments (after --)")],
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
) -> None:
    """Run one command on a node (or on every node, output prefixed), e.g. `dtrain exec n1 -- nvidia-smi`."""
    from dtrain.control.nodes import exec_all, terminal_argv

    c = _cluster(cluster)
    if node != "all":
        with terminal_argv(c, node, command, accept_new_host_keys=accept_new_host_keys) as argv:
            console.state.exit_code = subprocess.run(argv, check=False).returncode
        return
    codes = 0
    for name, p in exec_all(c, command, accept_new_host_keys=accept_new_host_keys).items():
        for text in (p.stdout + p.stderr).decode(errors="replace").splitlines():
            console.out.print(f"[{name}] {text}", markup=False, highlight=False, soft_wrap=True)
        codes = codes or p.returncode
    console.state.exit_code = codes


def ssh_(
    node: Annotated[str, typer.Argument(help="node name (default: the master)")] = "",
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
) -> None:
    """Open a shell on a node, with the cluster's user, key and host-key checking."""
    from dtrain.control.nodes import terminal_argv

    with terminal_argv(_cluster(cluster), node, None, accept_new_host_keys=accept_new_host_keys) as argv:
        sys.stdout.flush()
        os.execvp(argv[0], argv)


def doctor(
    cluster: o.Cluster = None,
    accept_new_host_keys: o.AcceptNewHostKeys = False,
    mib: Annotated[float, typer.Option("--mib", help="all-reduce size in MiB")] = 64.0,
) -> None:
    """Check a cluster before spending money: SSH, versions, ports between every pair of nodes,
    a short all-reduce (nccl on GPU, gloo on CPU) with its bandwidth, disk and GPU memory free."""
    from rich.table import Table

    from dtrain.control.nodes import doctor as run_doctor

    c = _cluster(cluster)
    with console.operation() as (events, handle):
        checks = run_doctor(c, mib=mib, events=events, handle=handle, accept_new_host_keys=accept_new_host_keys)
    t = Table("node", "check", "", "detail", "what to do")
    for ch in checks:
        t.add_row(ch.node, ch.check, "[green]ok[/]" if ch.ok else "[red]FAIL[/]", ch.detail, ch.fix)
    console.out.print(t)
    failed = [ch for ch in checks if not ch.ok]
    if failed:
        console.error(
            f"{len(failed)} check(s) failed: first: node {failed[0].node}, {failed[0].check}: {failed[0].detail}"
        )
        console.state.exit_code = int(ExitCode.FAILURE)
