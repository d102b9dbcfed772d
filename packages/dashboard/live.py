"""A run as it trains, as server-sent events: new metrics rows, events, and changes of its status and
checkpoints, until it ends. (Node logs have their own stream, /api/v1/runs/{id}/logs?follow=1, which
is dtrain.control.logs.follow_logs, as `dtrain logs -f` uses it.)

The server polls the run's files (through dtrain.control.runs, as every other read) every POLL_S and
sends only what is new, reading only the bytes after what it sent, so a page holds one connection
however many charts it draws. Each message carries the cursors after it as its SSE id; a browser that
reconnects sends the last one back (Last-Event-ID) and continues where it stopped.

    event: metrics   data: {"rows": [...], "lines": N, "skipped": {"count", "lines"}, "reset": bool}
    event: events    data: the same shape, from events.jsonl
    event: run       data: run_detail(): summary, status, config, checkpoints (when any of it changed)
    event: end       data: {"status": ...}: the run has ended and everything it wrote was sent
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from starlette.concurrency import run_in_threadpool

from dtrain.common.metrics import EVENTS, METRICS
from dtrain.common.storage import is_remote
from dtrain.control import runs

LOCAL_POLL_S = 1.0  # a line is on the page about a second after it is written
REMOTE_POLL_S = 2.0  # a bucket: one request per file per poll (the bytes after the cursor)


@dataclasses.dataclass
class Cursors:
    """Lines (and their bytes) of metrics.jsonl and events.jsonl already sent."""

    metrics: int = 0
    metrics_offset: int = 0
    events: int = 0
    events_offset: int = 0

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> Cursors | None:
        try:
            d = json.loads(text)
            return cls(**{f.name: int(d[f.name]) for f in dataclasses.fields(cls)})
        except (ValueError, KeyError, TypeError):
            return None


def message(event: str, data: Any, cursors: Cursors | None = None) -> bytes:
    head = f"id: {cursors.encode()}\n" if cursors is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data)}\n\n".encode()


async def stream(output: str, run_id: str, cursors: Cursors, is_disconnected: Any) -> AsyncIterator[bytes]:
    """Server-sent events for run `run_id` from `cursors` on."""
    poll = REMOTE_POLL_S if is_remote(output) else LOCAL_POLL_S
    run = await run_in_threadpool(runs.open_run, output, run_id)
    last_status: Any = None
    yield b": connected\n\n"  # lets the client (and a proxy) see the stream open at once
    while not await is_disconnected():
        # The status first: whatever the run wrote before it ended is in the files read after it.
        status = await run_in_threadpool(runs.read_status, run)
        metrics = await run_in_threadpool(runs.read_jsonl, run, METRICS, cursors.metrics, cursors.metrics_offset)
        cursors.metrics, cursors.metrics_offset = metrics.lines, metrics.offset
        if metrics.rows or metrics.reset or metrics.skipped:
            yield message("metrics", metrics.as_dict(), cursors)
        events = await run_in_threadpool(runs.read_jsonl, run, EVENTS, cursors.events, cursors.events_offset)
        cursors.events, cursors.events_offset = events.lines, events.offset
        if events.rows or events.reset or events.skipped:
            yield message("events", events.as_dict(), cursors)
        # Checkpoints and the status change with an event or at the end; the table row with both.
        if status != last_status or events.rows:
            last_status = status
            yield message("run", await run_in_threadpool(runs.run_detail, output, run_id), cursors)
        if status["state"] in runs.DONE_STATES:
            yield message("end", {"status": status["state"]}, cursors)
            return
        await asyncio.sleep(poll)


async def follow_logs(output: str, run_id: str, node: str | None, skip: int) -> AsyncIterator[bytes]:
    """A run's node logs as server-sent `logs` events, from dtrain.control.logs.follow_logs (what
    `dtrain logs -f` prints), then `end` once it has ended. follow_logs blocks between polls, so it runs
    in a thread; a client that goes away stops it through its Handle. The first `skip` lines (those
    the client has) are not sent."""
    from dtrain.control.events import Handle
    from dtrain.control.logs import follow_logs as follow

    handle = Handle()
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    def put(kind: str, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server stopped
            loop.call_soon_threadsafe(queue.put_nowait, (kind, item))

    def worker() -> None:
        try:
            for line in follow(output, run_id, node=node, handle=handle):
                put("line", line)
        except Exception as e:  # noqa: BLE001 - reported to the client as the stream's last event
            put("error", str(e))
        finally:
            put("done", None)

    threading.Thread(target=worker, name=f"logs-{run_id}", daemon=True).start()
    sent = 0
    try:
        yield b": connected\n\n"
        while True:
            kind, item = await queue.get()
            batch = []
            while kind == "line":
                sent += 1
                if sent > skip:
                    batch.append(dataclasses.asdict(item))
                if queue.empty():
                    break
                kind, item = queue.get_nowait()
            if batch:
                yield message("logs", {"lines": batch})
            if kind == "error":
                yield message("error", {"detail": item})
                return
            if kind == "done":
                yield message("end", {})
                return
    finally:
        handle.terminate()  # follow_logs returns at its next poll
