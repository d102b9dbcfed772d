"""The REST API, /api/v1: runs (with their stragglers), their metrics, events, logs and hung ranks'
stacks; the cluster's nodes and GPUs; evals; the cluster's Slurm jobs (list, submit, cancel). Each
endpoint is one call into dtrain.control, as the CLI makes it.

Errors are {"detail": "..."}: 400 for a bad run id, value or request (a cluster without Slurm, an unknown
setting), 404 for an unknown run (or one without node logs), 401 without the token on a non-local bind."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from dtrain.common.errors import UserError
from dtrain.control import runs
from dtrain.dashboard import live, table
from dtrain.dashboard.app import Dashboard

router = APIRouter(tags=["dtrain"])
SSE_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def _dash(request: Request) -> Dashboard:
    return request.app.state.dash


@router.get("/runs", summary="Runs under the output location, filtered and sorted")
def list_runs(request: Request, query: Annotated[table.Query, Depends(table.query)]) -> dict[str, Any]:
    dash = _dash(request)
    return {"output": dash.output, "runs": table.select(runs.runs_table(dash.output), query)}


@router.get("/runs/{run_id}", summary="One run: its table row, config, status and checkpoints")
def run(request: Request, run_id: str) -> dict[str, Any]:
    """`summary` is the run's row of GET /runs. Its `stragglers` are the ranks the launcher finds much
    slower than the others now ({"<node> rank <r>": times the others' median step}; {} when none or
    when the run is not running): shown, never stopped. They come from the run's `straggler` events."""
    return runs.run_detail(_dash(request).output, run_id)


@router.get("/runs/{run_id}/metrics", summary="A run's metrics rows (those after a step, or after a line)")
def metrics(
    request: Request,
    run_id: str,
    since: Annotated[int | None, Query(description="only rows with a step above this")] = None,
    after_line: Annotated[int, Query(ge=0, description="only rows after this line (the last answer's `lines`)")] = 0,
) -> dict[str, Any]:
    """Each row is a line of metrics.jsonl plus its line number; `skipped` counts and numbers the
    lines that are not JSON (they are left out, never fatal)."""
    return runs.read_metrics(_dash(request).output, run_id, since=since, after_line=after_line).as_dict()


@router.get("/runs/{run_id}/events", summary="A run's events (started, checkpoint, preempted, ...)")
def events(request: Request, run_id: str, after_line: Annotated[int, Query(ge=0)] = 0) -> dict[str, Any]:
    return runs.read_events(_dash(request).output, run_id, after_line=after_line).as_dict()


@router.get("/runs/{run_id}/hangs", summary="The Python stacks of a run's ranks that hung")
def hangs(request: Request, run_id: str) -> dict[str, Any]:
    """{"hangs": [{"name": "<node>-rank<r>.txt", "text", "bytes"}]}: what the launcher saved into the run
    (hangs/) when it found a rank making no progress; the run's `hang` event names the one that hung."""
    return {"hangs": runs.hang_stacks(runs.open_run(_dash(request).output, run_id))}


@router.get("/runs/{run_id}/checkpoints", summary="A run's checkpoints, oldest first")
def checkpoints(request: Request, run_id: str) -> dict[str, Any]:
    return {"checkpoints": runs.checkpoints(runs.open_run(_dash(request).output, run_id))}


@router.get("/runs/{run_id}/logs", summary="A cluster run's node logs; follow=1 streams new lines")
async def logs(
    request: Request,
    run_id: str,
    node: str | None = None,
    tail: Annotated[int, Query(ge=0, description="the last N lines (0: all)")] = 500,
    follow: bool = False,
) -> Any:
    """Without follow: {"lines": [{"stamp", "node", "text"}]}, the last `tail` in time order. With
    follow=1: server-sent events, `logs` ({"lines": [...]}, starting with the last `tail`) as the
    nodes write them, then `end` once the run has ended and every node's log says its job ended."""
    output = _dash(request).output
    if not follow:
        lines = await run_in_threadpool(runs.run_logs, output, run_id, node)
        return {"lines": [dataclasses.asdict(ln) for ln in (lines[-tail:] if tail else lines)]}
    await run_in_threadpool(runs.open_run, output, run_id)  # a bad or unknown id is refused before streaming
    try:
        skip = max(0, len(await run_in_threadpool(runs.run_logs, output, run_id, node)) - tail) if tail else 0
    except runs.NoLogs:
        skip = 0  # none yet: they may come (a cluster run that is starting)
    return StreamingResponse(
        live.follow_logs(output, run_id, node, skip), media_type="text/event-stream", headers=SSE_HEADERS
    )


@router.get("/runs/{run_id}/stream", summary="Server-sent events of a run as it trains (what the run page uses)")
async def stream(
    request: Request,
    run_id: str,
    metrics_line: Annotated[int, Query(ge=0)] = 0,
    events_line: Annotated[int, Query(ge=0)] = 0,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    """New metrics rows, events and status changes (see dtrain.dashboard.live), from the lines the
    page already has; a reconnecting browser's Last-Event-ID carries on from where it stopped."""
    output = _dash(request).output
    await run_in_threadpool(runs.open_run, output, run_id)  # a bad or unknown id is refused before streaming
    cursors = (last_event_id and live.Cursors.decode(last_event_id)) or live.Cursors(metrics_line, 0, events_line, 0)
    return StreamingResponse(
        live.stream(output, run_id, cursors, request.is_disconnected),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )


# ---------------------------------------------------------------------------------------------
# the cluster


@router.get("/nodes", summary="The cluster's nodes: reachable, GPUs, CPU and memory")
def nodes(request: Request) -> dict[str, Any]:
    dash = _dash(request)
    return {"cluster": dash.cluster.name, "nodes": [s.as_dict() for s in dash.node_states()]}


@router.get("/gpus", summary="Every node's GPUs as nvidia-smi reports them (what `dtrain gpus --json` prints)")
def gpus(request: Request) -> dict[str, Any]:
    from dtrain.control.nodes import gpus as node_gpus

    dash = _dash(request)
    found = node_gpus(dash.cluster)
    return {
        "cluster": dash.cluster.name,
        "gpus": {n: r if isinstance(r, str) else [dataclasses.asdict(g) for g in r] for n, r in found.items()},
    }


# ---------------------------------------------------------------------------------------------
# evals (`dtrain eval`) and the Slurm job queue (`dtrain submit`, `jobs`, `cancel`)


class EvalBody(BaseModel):
    """What `dtrain eval` takes, as JSON."""

    run: str
    checkpoint: int | None = None
    prompts: list[str] = []
    max_new_tokens: int = 0


@router.post("/evals", summary="Start an evaluation of a run (what `dtrain eval` does)", status_code=202)
def start_eval(request: Request, body: EvalBody) -> dict[str, Any]:
    """Checked at once (the run, its checkpoint, its workload), then run in the background on the
    dashboard's machine or cluster; its record is eval/<id>.json under the run."""
    run_id = runs.open_run(_dash(request).output, body.run).url.rstrip("/").rsplit("/", 1)[-1]
    eval_id = _dash(request).evals.start(
        run_id, checkpoint=body.checkpoint, prompts=tuple(body.prompts), max_new_tokens=body.max_new_tokens
    )
    return {"id": eval_id, "run": run_id, "state": "pending", "url": f"/api/v1/evals/{eval_id}?run={run_id}"}


@router.get("/evals/{eval_id}", summary="An evaluation's state and result")
def read_eval(
    request: Request,
    eval_id: str,
    run: Annotated[str | None, Query(description="the run it evaluates (found by search when left out)")] = None,
) -> dict[str, Any]:
    return _dash(request).evals.read(eval_id, run)


class JobBody(BaseModel):
    """What `dtrain submit <workload>` takes, as JSON: `settings` are dotted keys as in dtrain.toml
    ({"mnist.epochs": 3, "run.output": "gs://b/runs"}), the same ones the command's flags set."""

    workload: str
    settings: dict[str, Any] = {}
    nodes: int = 0  # 0: the cluster's default
    name: str = ""


@router.get("/jobs", summary="The jobs dtrain submitted to the cluster's Slurm (what `dtrain jobs --json` prints)")
def list_jobs(
    request: Request, all_jobs: Annotated[bool, Query(alias="all", description="ended ones too")] = False
) -> dict[str, Any]:
    from dtrain.control.slurm.joblist import list_jobs as slurm_jobs

    dash = _dash(request)
    return {"cluster": dash.cluster.name, "jobs": [r.as_dict() for r in slurm_jobs(dash.cluster, all_jobs=all_jobs)]}


@router.post("/jobs", summary="Queue a workload as a Slurm job (what `dtrain submit` does)", status_code=201)
def submit_job(request: Request, body: JobBody) -> dict[str, Any]:
    """Checked and queued at once; the answer has the job id and where its run goes."""
    from dtrain.control.events import Events, Handle
    from dtrain.control.launch import LaunchRequest, submit
    from dtrain.control.settings import schema
    from dtrain.control.workloads import workload_class

    dash = _dash(request)
    workload_class(body.workload)  # an unknown one is settings' own one-line error
    known = {k for k, v in schema().items() if v.section in ("run", body.workload)}
    if unknown := sorted(set(body.settings) - known):
        raise UserError(f"unknown setting {unknown[0]!r} for {body.workload} (known: {', '.join(sorted(known))})")
    if body.nodes < 0:
        raise UserError(f"nodes must be 0 (the cluster's default) or more, not {body.nodes}")
    flags = {**body.settings, "run.cluster": dash.cluster.name if dash.cluster_named else None}
    req = LaunchRequest(workload=body.workload, flags=flags, config_path=dash.config_path, nodes=body.nodes)
    r = submit(req, name=body.name, events=Events(), handle=Handle())
    return dataclasses.asdict(r)


@router.delete("/jobs/{job_id}", summary="Cancel a queued or running job (its ranks checkpoint and stop)")
def cancel_job(request: Request, job_id: str) -> dict[str, Any]:
    from dtrain.control.events import Events, Handle
    from dtrain.control.slurm.cancel import cancel

    if not job_id.isdigit():
        raise UserError(f"bad job id {job_id!r}: Slurm's job ids are numbers")
    r = cancel(_dash(request).cluster, job_id, events=Events(), handle=Handle())
    out = dataclasses.asdict(r)
    out["state"] = r.state.state if r.state else "UNKNOWN"
    return out
