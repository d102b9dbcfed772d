"""`dtrain dashboard`: the web dashboard and REST API (the work is dtrain.dashboard.server)."""

from typing import Annotated

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.common.errors import UserError

DEFAULT_PORT = 8765


def dashboard(
    output: o.Output = None,
    cluster: o.Cluster = None,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="port to serve on (0: any free one)")] = (
        DEFAULT_PORT
    ),
    host: Annotated[
        str,
        typer.Option("--host", help="address to bind; anything but a loopback address requires the access token"),
    ] = "127.0.0.1",
    new_token: Annotated[
        bool, typer.Option("--new-token", help="replace the access token (signs out every browser)")
    ] = False,
) -> None:
    """Serve a web dashboard of runs (live curves, events, logs, checkpoints), the cluster's nodes and
    GPUs, and the same as JSON under /api/v1 (OpenAPI page at /docs). Stop it with Ctrl-C."""
    try:
        from dtrain.dashboard import server
    except ImportError as e:
        raise UserError(
            f"dtrain dashboard needs its extra ({e.name} is missing): pip install 'dtrain[dashboard]'"
        ) from None
    from dtrain.control.settings import load_cluster, load_settings

    settings = load_settings(console.state.config_path, {"run.output": output, "run.cluster": cluster})
    nodes = load_cluster(console.state.config_path, cluster)
    with console.operation() as (events, handle):
        server.serve(
            settings.run.output,
            nodes,
            cluster_named=bool(settings.launch.cluster),
            config_path=console.state.config_path,
            host=host,
            port=port,
            events=events,
            handle=handle,
            new_token=new_token,
        )
