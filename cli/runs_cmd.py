"""`dtrain runs`: the runs under --output with their status and best metric."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

from dtrain.cli import console
from dtrain.cli import options as o


def runs(output: o.Output = None, as_json: o.Json = False) -> None:
    """List runs (newest first) with their status and best metric."""
    from dtrain.cli.settings import load_settings

    settings = load_settings(console.state.config_path, {"run.output": output})
    rows = list_runs(settings.run.output)
    if as_json:
        console.out.print_json(json.dumps(rows))
        return
    if not rows:
        console.out.print(f"no runs under {settings.run.output}")
        return
    from rich.table import Table

    table = Table(title=f"runs in {settings.run.output}")
    for col in ("run", "status", "started (UTC)", "step", "best", "world"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        short = {"eval_accuracy": "acc", "eval_loss": "loss"}.get(r["best_metric"], r["best_metric"])
        best = f"{short} {r['best_value']:.4f}" if r["best_value"] is not None else "-"
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


def list_runs(output: str) -> list[dict[str, Any]]:
    """Every run directory directly under `output` (local or gs://), newest first."""
    from dtrain.common.checkpoint import STEP_RE
    from dtrain.common.rundir import read_json
    from dtrain.common.storage import open_store

    root = open_store(output)
    names = sorted(
        {p.split("/", 1)[0] for p in root.list("") if p.endswith("/config.json") and p.count("/") == 1}, reverse=True
    )
    rows = []
    for name in names:
        run = root.child(name)
        cfg = read_json(run, "config.json") or {}
        status = read_json(run, "status.json") or {}
        steps = [int(m.group(1)) for p in run.list("checkpoints") if (m := STEP_RE.match(p.split("/")[1]))]
        metric, value = _best_metric(run, status)
        created = cfg.get("created")
        rows.append(
            {
                "run_id": name,
                "workload": cfg.get("workload"),
                "status": _status(status),
                "started": datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
                if created
                else None,
                "step": max(steps) if steps else None,
                "best_metric": metric,
                "best_value": value,
                "world_size": cfg.get("world_size"),
                "url": run.url,
                "error": status.get("error"),
            }
        )
    return rows


def _status(status: dict[str, Any]) -> str:
    state = status.get("state", "unknown")
    if state == "running" and status.get("pid") and status.get("host") == os.uname().nodename:
        try:
            os.kill(int(status["pid"]), 0)
        except ProcessLookupError:
            return "stopped"  # its process is gone without recording an end
        except PermissionError:
            pass
    return state


def _best_metric(run: Any, status: dict[str, Any]) -> tuple[str | None, float | None]:
    """The best eval_accuracy (or lowest eval_loss) in metrics.jsonl."""
    try:
        lines = run.read_bytes("metrics.jsonl").decode().splitlines()
    except FileNotFoundError:
        return None, None
    rows = [json.loads(ln) for ln in lines if ln.strip()]
    acc = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    if acc:
        return "eval_accuracy", max(acc)
    loss = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return ("eval_loss", min(loss)) if loss else (None, None)
