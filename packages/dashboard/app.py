"""The dashboard's FastAPI app: one app for the pages (/), the JSON API (/api/v1, OpenAPI at /docs)
and the static chart script (/static), behind one access guard (auth.py)."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from dtrain.common.errors import UserError
from dtrain.control import launchers
from dtrain.control.cluster import Cluster
from dtrain.control.events import Events, Handle
from dtrain.control.runs import BadRunId, NoLogs, NoSuchRun
from dtrain.dashboard.auth import Guard

HERE = Path(__file__).parent
NODE_STATES_TTL_S = 5.0  # a Cluster page and /api/v1/nodes share one reading of the nodes this long


@dataclasses.dataclass
class Dashboard:
    """What the app serves: runs under `output`, and the nodes of `cluster` (this machine when no
    --cluster was given)."""

    output: str
    cluster: Cluster
    cluster_named: bool = False
    config_path: Path | None = None  # --config: what a job submitted through the API is resolved with
    token: str | None = None
    port: int = 0
    events: Events = dataclasses.field(default_factory=Events)
    ssh: Any = None  # one SSH session to the cluster's nodes, opened on first use, closed at shutdown
    _nodes: tuple[float, Any] | None = None
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    evals: Evals = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.evals = Evals(self)

    def node_states(self) -> Any:
        """The nodes' states, read at most every NODE_STATES_TTL_S (each reading takes a second)."""
        from dtrain.control.nodestate import node_states

        with self._lock:
            if self._nodes is not None and time.monotonic() - self._nodes[0] < NODE_STATES_TTL_S:
                return self._nodes[1]
            if self.ssh is None and launchers.has(self.cluster, launchers.Feature.SSH):
                from dtrain.control.nodes import ssh_to

                self.ssh = ssh_to(self.cluster, False)
            states = node_states(self.cluster, self.ssh)
            self._nodes = (time.monotonic(), states)
            return states

    def close(self) -> None:
        self.evals.stop()
        if self.ssh is not None:
            self.ssh.close()
            self.ssh = None


class Evals:
    """Evaluations started from the dashboard (POST /evals), each run in a thread through
    dtrain.control.evals, as `dtrain eval` runs them; a stop at shutdown ends them (recorded failed)."""

    def __init__(self, dash: Dashboard) -> None:
        self.dash = dash
        self._running: dict[str, tuple[str, Handle, threading.Thread]] = {}  # eval id -> run id, handle, thread
        self._lock = threading.Lock()

    def start(self, run_id: str, **request: Any) -> str:
        from dtrain.control import evals

        cluster = self.dash.cluster.name if self.dash.cluster_named else ""
        plan = evals.plan_eval(evals.EvalRequest(run=run_id, output=self.dash.output, cluster=cluster, **request))
        handle = Handle()

        def work() -> None:
            try:
                evals.run_eval(plan, events=self.dash.events, handle=handle)
            except UserError as e:  # recorded in eval/<id>.json by run_eval
                self.dash.events.warning(f"evaluation {plan.eval_id} of {run_id}: {e}")

        thread = threading.Thread(target=work, name=f"eval-{plan.eval_id}", daemon=True)
        with self._lock:
            self._running[plan.eval_id] = (run_id, handle, thread)
        thread.start()
        return plan.eval_id

    def read(self, eval_id: str, run: str | None) -> dict[str, Any]:
        from dtrain.control import evals, runs
        from dtrain.evaluate.records import eval_name

        eval_name(eval_id)  # a well-formed id, before it is looked for anywhere
        with self._lock:
            started = self._running.get(eval_id)
        if run is None and started is not None:
            run = started[0]
        if run is not None:
            return evals.read_eval(self.dash.output, runs.open_run(self.dash.output, run).url, eval_id)
        for row in runs.runs_table(self.dash.output):  # one the dashboard did not start: find its run
            try:
                return evals.read_eval(self.dash.output, row["url"], eval_id)
            except UserError:
                continue
        raise UserError(f"no evaluation {eval_id} under {self.dash.output}")

    def stop(self) -> None:
        with self._lock:
            running = list(self._running.values())
        for _run, handle, _thread in running:
            handle.terminate()
        for _run, _handle, thread in running:
            thread.join(timeout=60)


# UserError subclasses -> HTTP status; any other UserError is the request's fault (400).
STATUS_OF = {BadRunId: 400, NoSuchRun: 404, NoLogs: 404}


def status_of(e: UserError) -> int:
    return next((code for kind, code in STATUS_OF.items() if isinstance(e, kind)), 400)


def create_app(dash: Dashboard) -> Any:
    """The ASGI app: the FastAPI app inside the access guard and the access log."""
    from fastapi_offline import FastAPIOffline

    from dtrain.dashboard import api, pages

    # FastAPIOffline: FastAPI whose /docs page loads Swagger UI from files installed with it, not a CDN.
    app = FastAPIOffline(
        title="dtrain dashboard",
        description="Runs, their metrics, events and logs, and the cluster's nodes; the same control layer as the CLI.",
        version="1",
        openapi_url="/api/v1/openapi.json",
        docs_url="/docs",
        redoc_url=None,
        static_url="/static/docs",
    )
    app.state.dash = dash
    app.include_router(api.router, prefix="/api/v1")
    app.include_router(pages.router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(UserError)
    async def user_error(request: Request, e: UserError) -> Response:
        code = status_of(e)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": str(e)}, status_code=code)
        return pages.error_page(request, code, str(e))

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, e: ValueError) -> Response:  # a bad query value (sort=...)
        if request.url.path.startswith("/api/"):
            return JSONResponse({"detail": str(e)}, status_code=400)
        return PlainTextResponse(str(e), status_code=400)

    return AccessLog(Guard(app, token=dash.token, port=dash.port), dash.events)


class AccessLog:
    """One `request` event per request when its response starts: method, path, status, time to the
    first byte. The path only: a query string may hold the token."""

    def __init__(self, app: Any, events: Events) -> None:
        self.app = app
        self.events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def logged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                ms = (time.perf_counter() - start) * 1000
                self.events.emit(
                    "request",
                    f"{scope['method']} {scope['path']} {message['status']} {ms:.0f} ms",
                    method=scope["method"],
                    path=scope["path"],
                    status=message["status"],
                    ms=round(ms, 1),
                )
            await send(message)

        await self.app(scope, receive, logged)
