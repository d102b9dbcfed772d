"""`dtrain up`, `dtrain down`, `dtrain status`, `dtrain preflight`: the life of a cluster dtrain makes.
Each parses its options and calls the cluster's backend (dtrain.control.backends), which does the work."""

import json
from typing import Annotated, Any

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.common.errors import ExitCode

NextZone = Annotated[
    bool,
    typer.Option("--next-zone", help="on ZONE_RESOURCE_POOL_EXHAUSTED, try the next zone that offers the GPU"),
]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="do not ask before creating or deleting")]


def _backend(cluster: str | None, verb: str) -> tuple[Any, Any]:
    from dtrain.control.backends import provisioning
    from dtrain.control.settings import cluster_config

    cfg = cluster_config(console.state.config_path, cluster)
    return cfg, provisioning(cfg, verb)


def _confirm(yes: bool) -> Any:
    return (lambda _question: True) if yes else (lambda question: typer.confirm(question, default=False))


def preflight_cmd(cluster: o.Cluster = None) -> None:
    """Check quota and zone capacity for a gcp cluster, in seconds, before anything is created."""
    cfg, backend = _backend(cluster, "up/down/status/preflight")
    with console.operation() as (events, _handle):
        backend.preflight(cfg, events=events)
    console.out.print("[green]preflight passed[/]")


def up(
    cluster: o.Cluster = None,
    yes: Yes = False,
    next_zone: NextZone = False,
    ready_timeout: Annotated[
        int | None, typer.Option("--ready-timeout", help="seconds to wait for the nodes", show_default=False)
    ] = None,
) -> None:
    """Create (or update) a gcp cluster with Terraform, and wait until every node is ready."""
    cfg, backend = _backend(cluster, "up/down/status/preflight")
    with console.operation() as (events, handle):
        result = backend.up(
            cfg, events=events, handle=handle, confirm=_confirm(yes), next_zone=next_zone, ready_timeout=ready_timeout
        )
    name = cfg.name
    console.out.print(
        f"[green]cluster {name} is ready[/]: {len(result.record['nodes'])} nodes. Next: "
        f"dtrain train mnist --cluster {name}   (dtrain down --cluster {name} when done)"
    )


def down(
    cluster: o.Cluster = None,
    yes: Yes = False,
    keep: Annotated[bool, typer.Option("--keep", help="list what the sweep finds, delete nothing")] = False,
    delete_data: Annotated[
        bool, typer.Option("--delete-data", help="also delete the checkpoint bucket and everything in it")
    ] = False,
    force_unlock: Annotated[
        str | None, typer.Option("--force-unlock", help="release a stale Terraform state lock ID first")
    ] = None,
) -> None:
    """Destroy a gcp cluster, then sweep for anything still labelled with its name."""
    cfg, backend = _backend(cluster, "up/down/status/preflight")
    with console.operation() as (events, handle):
        result = backend.down(
            cfg,
            events=events,
            handle=handle,
            confirm=_confirm(yes),
            keep=keep,
            delete_data=delete_data,
            force_unlock=force_unlock,
        )
    if not result.clean:
        console.state.exit_code = int(ExitCode.FAILURE)
    kept_note = (
        ""
        if result.data_deleted
        else f"; checkpoints kept in gs://{result.bucket} (dtrain down --delete-data removes them)"
    )
    console.out.print(f"[green]cluster {cfg.name} is down[/]{kept_note}")


def status(cluster: o.Cluster = None, json_out: o.Json = False) -> None:
    """The cluster's nodes as the Compute API sees them now, their uptime and the cost so far."""
    cfg, backend = _backend(cluster, "up/down/status/preflight")
    st = backend.status(cfg)
    if json_out:
        print(json.dumps(st.as_dict()))
        return
    if not st.nodes:
        up_hint = "the record says it is up: its VMs are gone (run dtrain down)" if st.recorded else "it is down"
        where = st.zone or f"any zone of {st.region}"
        console.out.print(f"cluster {st.cluster}: no instances in {where} ({up_hint})")
        return
    from rich.table import Table

    table = Table(title=f"cluster {st.cluster} ({st.project}, {st.zone})", title_justify="left")
    for col in ("node", "state", "machine", "GPUs", "spot", "uptime", "node-hours", "$/hour", "$ so far"):
        table.add_column(col)
    for r in st.nodes:
        style = {"RUNNING": "green", "PREEMPTED": "red", "STOPPED": "dim", "MISSING": "red"}.get(r.state, "yellow")
        table.add_row(
            r.name,
            f"[{style}]{r.state}[/]",
            r.machine_type,
            str(r.gpus),
            "yes" if r.spot else "no",
            _duration(r.uptime_s),
            f"{r.node_hours:.2f}",
            f"{r.usd_per_hour:.3f}",
            f"{r.usd_so_far:.2f}",
        )
    console.out.print(table)
    console.out.print(
        f"cost so far ${st.usd_so_far:.2f} (each node's hours since its last start, to now or to its stop); "
        f"now ${st.usd_per_hour:.2f}/hour"
    )
    console.out.print(f"[dim]{st.note}[/]")
    if any(r.state == "RUNNING" for r in st.nodes[:1]):  # the service runs on the master
        _service(cfg, backend)


def _service(cfg: Any, backend: Any) -> None:
    """The cluster service's section (docs/service.md), when the nodes can be reached."""
    import contextlib

    from dtrain.cli.jobs_cmd import print_service

    with contextlib.suppress(Exception):
        print_service(backend.cluster(cfg))


def _duration(seconds: int) -> str:
    if seconds <= 0:
        return "-"
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"
