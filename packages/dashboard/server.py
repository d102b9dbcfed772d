"""Serving the dashboard: check the runs location, bind the port, run uvicorn until the caller's Handle
asks to stop. Like every long operation of dtrain's, it reports through Events and installs no signal
handler (the CLI owns those)."""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control import runs
from dtrain.control.cluster import Cluster
from dtrain.control.events import Events, Handle, Stop
from dtrain.dashboard import auth
from dtrain.dashboard.app import Dashboard, create_app

# Open streams (a run page's live updates) are closed this long after a stop request.
SERVER_SHUTDOWN_S = 2


def serve(
    output: str,
    cluster: Cluster,
    *,
    cluster_named: bool,
    config_path: Path | None = None,
    host: str,
    port: int,
    events: Events,
    handle: Handle,
    new_token: bool = False,
) -> None:
    """Serve the dashboard for the runs under `output` and the nodes of `cluster` on host:port until
    `handle` is stopped. A bind to anything but a loopback address requires the token (auth.py)."""
    import uvicorn

    token = None
    if not auth.is_loopback(host):
        token, made = auth.load_or_create_token(renew=new_token)
        if made:
            events.emit("token", f"made the dashboard's access token (shown this once; kept in {auth.token_path()})")
    found = _check_output(output)
    sock = bind(host, port)
    port = sock.getsockname()[1]
    dash = Dashboard(
        output, cluster, cluster_named=cluster_named, config_path=config_path, token=token, port=port, events=events
    )
    server = _server(
        uvicorn.Config(
            create_app(dash),
            log_level="warning",
            access_log=False,  # AccessLog in app.py logs paths without their query (a ?token= link)
            lifespan="off",
            server_header=False,
            timeout_graceful_shutdown=SERVER_SHUTDOWN_S,
        )
    )

    def on_stop(stop: Stop) -> None:
        server.should_exit = True
        if stop >= Stop.KILL:
            server.force_exit = True

    url = f"http://{_url_host(host)}:{port}/"
    events.info(f"dashboard: {url} for {found} run(s) under {output} (API: {url}api/v1, docs: {url}docs)")
    if token is not None:
        if made:
            events.emit("login", f"open {url}?token={token} to sign in; scripts send Authorization: Bearer TOKEN")
        else:
            events.info(f"sign in with {url}?token=<the token in {auth.token_path()}>, or pass --new-token")
    unsubscribe = handle.subscribe(on_stop)
    try:
        if not handle.stopped:
            server.run(sockets=[sock])
    finally:
        unsubscribe()
        sock.close()
        dash.close()


def _check_output(output: str) -> int:
    """The number of runs under `output`; reading them first also fails early on a location that
    cannot be read (a bucket without credentials) and fills the runs table's memory."""
    try:
        return len(runs.runs_table(output))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a storage library's own error: one line, not a traceback
        raise UserError(
            f"cannot list the runs under {output}: {type(e).__name__}: {e}", exit_code=ExitCode.FAILURE
        ) from None


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or one line saying why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UserError(
            f"cannot serve on host {host!r}: {e.strerror}; pass --host with an address of this machine"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # SO_REUSEADDR lets a restarted dashboard bind while old connections linger in TIME_WAIT; on
        # Linux it never lets two servers listen on one port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is already in use (another dashboard?): pass --port N") from None
        if e.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"{host} is not an address of this machine: pass --host with one of its own") from None
        if e.errno == errno.EACCES:
            raise UserError(f"no permission to listen on port {port}: pass --port 1024 or above") from None
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _server(config: Any) -> Any:
    """uvicorn's Server without its signal handlers: the caller's Handle stops it."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)
