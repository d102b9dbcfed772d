"""Runs as data: the runs under an output location with their status and best metric, and a run's
per-node logs. No torch: these work on a CLI-only install."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError
from dtrain.common.rundir import STEP_RE, locate, read_json
from dtrain.common.storage import Store, open_store


def list_runs(output: str) -> list[dict[str, Any]]:
    """Every run directory directly under `output` (local or gs://), newest first."""
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
        metric, value = _best_metric(run)
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


def _best_metric(run: Store) -> tuple[str | None, float | None]:
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


@dataclasses.dataclass(frozen=True)
class LogLine:
    stamp: str  # ISO 8601, UTC, as the launcher wrote it
    node: str
    text: str


def node_logs(output: str, ref: str, node: str | None = None) -> tuple[str, list[LogLine]]:
    """A cluster run's per-node log lines in time order (run id under `output`, or its directory or
    URL); `node` keeps one node's. Returns the run id and the lines."""
    from dtrain.control.remote import logs_cache_dir

    store = locate(output, ref)
    run_id = store.url.rstrip("/").rsplit("/", 1)[-1]
    names = [f for f in store.list("logs") if f.endswith(".log")]
    files = {Path(f).stem: store.read_bytes(f).decode(errors="replace") for f in names}
    if not files:
        cache = logs_cache_dir(run_id)
        files = {p.stem: p.read_text(errors="replace") for p in sorted(cache.glob("*.log"))}
    if not files:
        raise UserError(f"run {store.url} has no node logs (only runs launched on a cluster keep them, under logs/)")
    if node is not None and node not in files:
        raise UserError(f"run {run_id} has no log for node {node!r} (nodes: {', '.join(sorted(files))})")
    entries = []
    for name, text in files.items():
        if node is not None and name != node:
            continue
        for i, line in enumerate(text.splitlines()):
            stamp, _, rest = line.partition(" ")
            entries.append((stamp, name, i, rest))
    return run_id, [LogLine(stamp, name, rest) for stamp, name, _i, rest in sorted(entries)]
