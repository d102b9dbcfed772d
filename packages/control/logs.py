"""Following a cluster run's node logs as they grow (`dtrain logs RUN -f`, the dashboard's
`/runs/{id}/logs?follow=1`). The launcher appends each node's lines to the run's logs/<node>.log every
few seconds (dtrain.control.remote.LogFiles) and ends each launch with a JOB_ENDED line per node."""

from __future__ import annotations

import time
from collections.abc import Iterator

from dtrain.common.rundir import locate, read_json
from dtrain.control.events import Handle
from dtrain.control.remote import JOB_ENDED
from dtrain.control.runs import LogLine

FOLLOW_POLL_S = 1.0
RUNNING_STATES = ("running",)


def follow_logs(
    output: str, ref: str, *, node: str | None = None, handle: Handle, poll_s: float = FOLLOW_POLL_S
) -> Iterator[LogLine]:
    """Every node's lines, as they arrive, until the run has ended and every node's log says its job
    ended (or the caller stops). Lines of one poll come in time order."""
    store = locate(output, ref)
    offsets: dict[str, int] = {}
    last: dict[str, str] = {}  # node -> its last line, to see JOB_ENDED
    while True:
        batch: list[LogLine] = []
        for name in sorted(n for n in store.list("logs") if n.endswith(".log")):
            who = name.rsplit("/", 1)[-1][: -len(".log")]
            if node is not None and who != node:
                continue
            try:
                data = store.read_bytes(name, start=offsets.get(name, 0))
            except FileNotFoundError:
                continue
            end = data.rfind(b"\n") + 1  # whole lines only
            offsets[name] = offsets.get(name, 0) + end
            for raw in data[:end].decode(errors="replace").splitlines():
                stamp, _, text = raw.partition(" ")
                batch.append(LogLine(stamp, who, text))
                last[who] = text
        yield from sorted(batch, key=lambda ln: ln.stamp)
        if handle.stopped:
            return
        state = (read_json(store, "status.json") or {}).get("state", "running")  # not written yet: starting
        if state not in RUNNING_STATES and all(t.startswith(JOB_ENDED) for t in last.values()):
            return
        time.sleep(poll_s)
