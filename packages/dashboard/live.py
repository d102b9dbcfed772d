"""A run as it trains, as server-sent events: new metrics rows, events, node log lines and changes of
its status and checkpoints, until it ends.

The server polls the run's files (through dtrain.control.runs, as every other read) every POLL_S and
sends only what is new, so a page holds one connection however many charts it draws. Each message
carries the cursors after it as its SSE id; a browser that reconnects sends the last one back
(Last-Event-ID) and continues where it stopped, without duplicates or gaps.

    event: metrics   data: {"rows": [...], "lines": N, "skipped": {"count", "lines"}, "reset": bool}
    event: events    data: the same shape, from events.jsonl
    event: logs      data: {"lines": [{"stamp", "node", "text", "line"}, ...]}
    event: run       data: run_detail(): summary, status, config, checkpoints (when any of it changed)
    event: end       data: {"status": ...}: the run has ended and everything it wrote was sent
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool

from dtrain.common.storage import is_remote
from dtrain.control import runs

LOCAL_POLL_S = 1.0  # a line is on the page about a second after it is written
REMOTE_POLL_S = 2.0  # each poll of a gs:// run downloads its .jsonl files
# After a cluster run ends, its launcher still uploads the last log lines (every 10 s while it runs).
LOGS_GRACE_S = 12.0
PARTS = frozenset({"metrics", "events", "logs", "run"})


@dataclasses.dataclass
class Cursors:
    """Lines already sent: of metrics.jsonl, events.jsonl and each node's log."""

    metrics: int = 0
    events: int = 0
    logs: dict[str, int] = dataclasses.field(default_factory=dict)

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> Cursors | None:
        try:
            d = json.loads(text)
            c = cls(int(d["metrics"]), int(d["events"]), {str(k): int(v) for k, v in d["logs"].items()})
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return c


def message(event: str, data: Any, cursors: Cursors) -> bytes:
    return f"id: {cursors.encode()}\nevent: {event}\ndata: {json.dumps(data)}\n\n".encode()


async def stream(
    output: str, run_id: str, cursors: Cursors, parts: frozenset[str], is_disconnected: Any
) -> AsyncIterator[bytes]:
    """Server-sent events for run `run_id` from `cursors` on, of the kinds in `parts`."""
    poll = REMOTE_POLL_S if is_remote(output) else LOCAL_POLL_S
    last_run: Any = None
    ended_at: float | None = None
    has_logs = False
    loop = asyncio.get_running_loop()
    yield b": connected\n\n"  # lets the client (and a proxy) see the stream open at once
    while not await is_disconnected():
        # The status first: whatever the run wrote before it ended is on disk by the reads below.
        summary = await run_in_threadpool(runs.run_summary, output, run_id)
        if "metrics" in parts:
            page = await run_in_threadpool(runs.read_metrics, output, run_id, after_line=cursors.metrics)
            if page.rows or page.reset or page.lines != cursors.metrics:
                cursors.metrics = page.lines
                yield message("metrics", page.as_dict(), cursors)
        if "events" in parts:
            page = await run_in_threadpool(runs.read_events, output, run_id, after_line=cursors.events)
            if page.rows or page.reset or page.lines != cursors.events:
                cursors.events = page.lines
                yield message("events", page.as_dict(), cursors)
        if "logs" in parts:
            lines = await run_in_threadpool(_new_logs, output, run_id, cursors.logs)
            if lines is not None:
                has_logs = True
            if lines:
                for ln in lines:
                    cursors.logs[ln.node] = max(cursors.logs.get(ln.node, 0), ln.line)
                yield message("logs", {"lines": [dataclasses.asdict(ln) for ln in lines]}, cursors)
        if "run" in parts and _changed(last_run, summary):
            detail = await run_in_threadpool(runs.run_detail, output, run_id)
            last_run = summary
            yield message("run", detail, cursors)
        if summary["status"] in runs.DONE_STATES:
            ended_at = ended_at or loop.time()
            if not (has_logs and "logs" in parts) or loop.time() - ended_at >= LOGS_GRACE_S:
                yield message("end", {"status": summary["status"]}, cursors)
                return
        await asyncio.sleep(poll)


def _new_logs(output: str, run_id: str, after: dict[str, int]) -> list[runs.LogLine] | None:
    """New log lines, or None for a run without node logs (yet)."""
    try:
        return runs.run_logs(output, run_id, after=after)
    except runs.NoLogs:
        return None


def _changed(before: dict[str, Any] | None, now: dict[str, Any]) -> bool:
    keys = ("status", "step", "updated", "exit_code", "error")
    return before is None or any(before.get(k) != now.get(k) for k in keys)
