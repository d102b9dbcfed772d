"""The dashboard's pages, rendered here from Jinja2 templates (autoescaped). Each page's data comes
from the same dtrain.control calls as the API; the charts are drawn in the browser by
static/charts.js from the rows embedded in the page, and the run page keeps them current through
/api/v1/runs/{id}/stream (live.py)."""

from __future__ import annotations

import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.templating import Jinja2Templates

from dtrain.common.errors import UserError
from dtrain.control import launchers, runs
from dtrain.dashboard import table
from dtrain.dashboard.app import HERE, Dashboard

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=HERE / "templates")
LOG_TAIL = 200  # lines of node logs a run page starts with (then it follows them)
COMPARE_MAX = 8  # runs one compare page overlays (colours stay distinguishable)


def _dash(request: Request) -> Dashboard:
    return request.app.state.dash


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def _when(stamp: float | None) -> str:
    if not isinstance(stamp, (int, float)):
        return "-"
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _best(row: dict[str, Any]) -> str:
    from dtrain.control.runs import best_label

    return best_label(row)


def _stragglers(stragglers: dict[str, float] | None) -> str:
    return runs.stragglers_label(stragglers or {}) or "none"


def _mib(n: Any) -> str:
    return f"{n / 2**20:,.0f} MiB" if isinstance(n, (int, float)) else "-"


templates.env.filters.update(duration=_duration, when=_when, best=_best, stragglers=_stragglers, mib=_mib)

CURVE_W, CURVE_H = 480, 120  # one node's resource chart (SVG user units)


def _polyline(times: list[float], values: list[Any], top: float, t0: float, span: float) -> str:
    """SVG points for `values` over `times`, 0..top mapped onto the chart's height (gaps skipped)."""
    pts = []
    for t, v in zip(times, values, strict=False):
        if isinstance(v, (int, float)) and top > 0:
            x = (t - t0) / span * CURVE_W if span > 0 else 0.0
            y = CURVE_H - min(max(v / top, 0.0), 1.0) * CURVE_H
            pts.append(f"{x:.1f},{y:.1f}")
    return " ".join(pts)


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() else (1 << 30, rank)


def resource_curves(series: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each node's resource curves (dtrain.common.resources.read_series) as the run page draws them: inline SVG
    polylines, CPU % and memory used (of the node's total) on one 0-100 % scale, and each GPU's utilisation and
    memory where NVML reported them; no script needed."""
    out = []
    for node, s in series.items():
        times = s.get("time") or []
        if not times:
            continue
        t0, span = times[0], times[-1] - times[0]
        mem_total = s.get("mem_total") or max((v for v in s.get("mem_used") or [] if isinstance(v, int)), default=0)
        curve = {
            "node": node,
            "samples": len(times),
            "span_s": span,
            "cpu": _polyline(times, s.get("cpu_pct") or [], 100.0, t0, span),
            "mem": _polyline(times, s.get("mem_used") or [], float(mem_total or 0), t0, span),
            "cpu_now": (s.get("cpu_pct") or [None])[-1],
            "mem_now": (s.get("mem_used") or [None])[-1],
            "mem_total": mem_total,
            "gpus": [],
        }
        totals = s.get("gpu_mem_total") or []
        for i, util in enumerate(s.get("gpu_util_pct") or []):
            mem = (s.get("gpu_mem_used") or [[]])[i] if i < len(s.get("gpu_mem_used") or []) else []
            total = totals[i] if i < len(totals) and totals[i] else 0
            curve["gpus"].append({"index": i, "util": _polyline(times, util, 100.0, t0, span),
                                  "mem": _polyline(times, mem, float(total), t0, span)})  # fmt: skip
        out.append(curve)
    return out


def render(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    dash = _dash(request)
    base = {"output": dash.output, "cluster_name": dash.cluster.name if dash.cluster_named else None}
    return templates.TemplateResponse(request, name, {**base, **context}, status_code=status_code)


def error_page(request: Request, status_code: int, message: str) -> Response:
    return render(request, "error.html", status_code=status_code, status_code_=status_code, message=message)


@router.get("/", response_class=HTMLResponse)
def runs_page(request: Request, query: Annotated[table.Query, Depends(table.query)]) -> HTMLResponse:
    dash = _dash(request)
    every = runs.runs_table(dash.output)
    return render(
        request,
        "runs.html",
        query=query,
        rows=table.select(every, query),
        total=len(every),
        statuses=sorted({r["status"] for r in every}),
        workloads=sorted({r["workload"] for r in every if r["workload"]}),
        columns=list(table.SORT_KEYS),
        compare_max=COMPARE_MAX,
    )


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: str) -> HTMLResponse:
    output = _dash(request).output
    detail = runs.run_detail(output, run_id)
    metrics = runs.read_metrics(output, run_id)
    events = runs.read_events(output, run_id)
    live = {
        "run_id": run_id,
        "status": detail["summary"]["status"],
        "metrics": metrics.as_dict(),
        "events": events.as_dict(),
        "log_tail": LOG_TAIL,
    }
    return render(
        request,
        "run.html",
        run=detail,
        row=detail["summary"],
        live=live,
        events=events.rows,
        hangs=runs.hang_stacks(runs.open_run(output, run_id)),
        curves=resource_curves(detail["resources"]),
        peaks=sorted(detail["peak_memory"].items(), key=lambda kv: _rank_key(kv[0])),
        curve_size=(CURVE_W, CURVE_H),
        done=detail["summary"]["status"] in runs.DONE_STATES,
    )


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, run: Annotated[list[str] | None, Query()] = None) -> HTMLResponse:
    output = _dash(request).output
    chosen = list(dict.fromkeys(run or []))[:COMPARE_MAX]
    data = [
        {"run_id": r, "summary": runs.run_summary(output, r), "rows": runs.read_metrics(output, r).rows} for r in chosen
    ]
    return render(request, "compare.html", runs=data, every=runs.runs_table(output))


@router.get("/cluster", response_class=HTMLResponse)
def cluster_page(request: Request) -> HTMLResponse:
    dash = _dash(request)
    jobs, queue_error = [], ""
    queue = launchers.has(dash.cluster, launchers.Feature.QUEUE)
    if queue:
        from dtrain.control.slurm.joblist import list_jobs

        try:
            jobs = [r.as_dict() for r in list_jobs(dash.cluster)]
        except UserError as e:  # Slurm not answering: the page still shows the nodes
            queue_error = str(e)
    return render(
        request,
        "cluster.html",
        cluster=dash.cluster,
        named=dash.cluster_named,
        nodes=dash.node_states(),
        slurm=queue,
        jobs=jobs,
        queue_error=queue_error,
    )
