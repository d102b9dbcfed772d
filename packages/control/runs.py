"""Runs as data: the runs under an output location with their status and best metric, and a run's
per-node logs. No torch: these work on a CLI-only install."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError
from dtrain.common.metrics import EVENTS, METRICS
from dtrain.common.rundir import LATEST, STEP_RE, complete_meta, locate, read_json
from dtrain.common.rundir import checkpoints as run_checkpoints
from dtrain.common.storage import LocalStore, Store, is_remote, open_store

# Terminal states: a run in one of them changes only if it is resumed, which rewrites status.json.
DONE_STATES = frozenset({"completed", "preempted", "failed", "interrupted", "stopped"})
# What `dtrain runs` shows of a row (runs_table's rows hold more).
LIST_KEYS = (
    "run_id",
    "workload",
    "status",
    "started",
    "step",
    "best_metric",
    "best_value",
    "world_size",
    "url",
    "error",
    "stragglers",
    "peak_memory",
)
SERIES_POINTS = 120  # samples a node's curve keeps in `dtrain runs --json` and on the run page (evenly spaced)
# A run id is one path segment: what run_location makes, or a name a person gave a directory.
RUN_ID_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
HANG_STACK_CHARS = 200_000  # of a hung rank's stacks a page shows (faulthandler's are a few KiB a thread)
REMOTE_READERS = 16  # parallel reads of a bucket's runs: each is an HTTP round trip


class BadRunId(UserError):
    """A run id that is not one plain path segment (`..`, a slash, an encoded one)."""


class NoSuchRun(UserError):
    """No run of that id under the output location."""


def list_runs(output: str, *, resources: bool = False) -> list[dict[str, Any]]:
    """Every run directory directly under `output` (local or gs://), newest first. `resources`: each row also has
    its nodes' resource curves (dtrain.common.resources.read_series, at most SERIES_POINTS samples a node), read
    from each run's resources/ (what `dtrain runs --json` shows; the table reads none)."""
    rows = [{k: row[k] for k in LIST_KEYS} for row in runs_table(output)]
    if resources:
        from dtrain.common.resources import read_series, series_peaks

        root = open_store(output)

        def series(run_id: str) -> dict[str, Any]:
            return read_series(root.child(run_id), points=SERIES_POINTS)

        ids = [row["run_id"] for row in rows]
        if is_remote(root.url) and len(ids) > 1:  # a listing and a read a node for each run: HTTP round trips
            with concurrent.futures.ThreadPoolExecutor(REMOTE_READERS) as pool:
                found = list(pool.map(series, ids))
        else:
            found = [series(i) for i in ids]
        for row, curves in zip(rows, found, strict=True):
            row["resources"] = curves
            row["peak_memory"] = row["peak_memory"] or series_peaks(curves)  # a running job's, so far
    return rows


def runs_table(output: str) -> list[dict[str, Any]]:
    """Every run under `output` (local or gs://), newest first, with what a table of runs shows:
    status, workload, start, duration, newest checkpoint and metrics step, best metric, world size,
    hosts. A run that has ended is summarised once per process and then answered from memory until
    its status.json changes, so a long-lived caller (the dashboard) lists 1,000 runs quickly."""
    root = open_store(output)
    names = _run_names(root)
    if is_remote(root.url) and len(names) > 1:
        with concurrent.futures.ThreadPoolExecutor(REMOTE_READERS) as pool:
            rows = list(pool.map(lambda n: _summary(root, n), names))
    else:
        rows = [_summary(root, n) for n in names]
    return rows


def _run_names(root: Store) -> list[str]:
    """The run directories directly under `root`, newest id first."""
    if isinstance(root, LocalStore):
        # One directory read instead of Store.list's walk over every checkpoint and log of every run.
        try:
            entries = list(os.scandir(root.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = {e.name for e in entries if e.is_dir() and os.path.isfile(os.path.join(e.path, "config.json"))}
    else:
        names = {p.split("/", 1)[0] for p in root.list("") if p.endswith("/config.json") and p.count("/") == 1}
    return sorted(names, reverse=True)


@dataclasses.dataclass
class _Cached:
    status: bytes
    row: dict[str, Any]


_summaries: dict[str, _Cached] = {}
_summaries_lock = threading.Lock()


def _summary(root: Store, name: str) -> dict[str, Any]:
    run = root.child(name)
    try:
        status_bytes = run.read_bytes("status.json")
    except FileNotFoundError:
        status_bytes = b""
    with _summaries_lock:
        cached = _summaries.get(run.url)
    if cached is not None and cached.status == status_bytes and cached.row["status"] in DONE_STATES:
        return dict(cached.row)
    status = _json_or_empty(status_bytes)
    cfg = read_json(run, "config.json") or {}
    steps = [int(m.group(1)) for p in run_checkpoints(run).list("") if (m := STEP_RE.match(p.split("/")[0]))]
    metrics = read_jsonl(run, METRICS)
    metric, value = best_metric(metrics.rows)
    created, updated = cfg.get("created"), status.get("updated")
    state = _status(status)
    end = updated if state in DONE_STATES and updated else time.time()
    peers = status.get("peers") or []
    row = {
        "run_id": name,
        "workload": cfg.get("workload"),
        "status": state,
        "started": _utc(created),
        "created": created,
        "updated": updated,
        "duration_s": round(end - created, 1) if isinstance(created, (int, float)) else None,
        "step": max(steps) if steps else None,
        "last_step": max((r["step"] for r in metrics.rows if isinstance(r.get("step"), int)), default=None),
        "best_metric": metric,
        "best_value": value,
        "world_size": cfg.get("world_size"),
        # config.json does not name the cluster a run was launched on; its hosts are what is known.
        "hosts": sorted({p["host"] for p in peers if isinstance(p, dict) and p.get("host")}),
        "url": run.url,
        "exit_code": status.get("exit_code"),
        "error": status.get("error"),
        "skipped_metric_lines": len(metrics.skipped),
        "stragglers": current_stragglers(run, state),
        # Each rank's, recorded when the job ended (dtrain.common.runrecord.record_peaks); a running job's are in
        # its resources/ rows (list_runs(resources=True), run_detail).
        "peak_memory": status.get("peak_memory") or {},
    }
    with _summaries_lock:
        _summaries[run.url] = _Cached(status_bytes, row)
    return dict(row)


def _utc(stamp: Any) -> str | None:
    if not isinstance(stamp, (int, float)):
        return None
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def _json_or_empty(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data) if data else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


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


BEST_LABELS = {"eval_accuracy": "acc", "eval_loss": "eval loss"}


def best_label(row: dict[str, Any]) -> str:
    """A runs-table row's best metric as people read it ("acc 0.9123"), or "-": the CLI and the dashboard."""
    if row.get("best_value") is None:
        return "-"
    name = row.get("best_metric") or ""
    return f"{BEST_LABELS.get(name, name)} {row['best_value']:.4f}"


def best_metric(rows: list[dict[str, Any]]) -> tuple[str | None, float | None]:
    """The best eval_accuracy (or lowest eval_loss) of a run's metrics rows."""
    acc = [r["eval_accuracy"] for r in rows if isinstance(r.get("eval_accuracy"), (int, float))]
    if acc:
        return "eval_accuracy", max(acc)
    loss = [r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), (int, float))]
    return ("eval_loss", min(loss)) if loss else (None, None)


# ---------------------------------------------------------------------------------------------
# stragglers: the ranks the launcher found much slower than the others (events.jsonl's "straggler" rows)

# Rows after which an earlier straggler no longer holds: a new attempt starts measuring afresh (a restart
# after a hang, a resume), and its launcher reports a straggler again only if there still is one.
STRAGGLERS_CLEARED_BY = frozenset({"started", "hang"})


@dataclasses.dataclass
class _EventsSeen:
    lines: int
    offset: int
    stragglers: dict[str, float]


_stragglers_seen: dict[str, _EventsSeen] = {}
_stragglers_lock = threading.Lock()


def current_stragglers(run: Store, state: str | None = None) -> dict[str, float]:
    """The run's stragglers now, {"<node> rank <r>": times slower than the others' median step}, from the
    last "straggler" row of its events.jsonl ({} in a later one: none any more); {} unless the run is
    running (`state`, if the caller has read it). Each run's events are read from where the last call
    stopped (read_jsonl's cursor), so a dashboard asking every second reads only what was appended."""
    if (state if state is not None else read_status(run)["state"]) != "running":
        return {}
    with _stragglers_lock:
        seen = _stragglers_seen.get(run.url) or _EventsSeen(0, 0, {})
    page = read_jsonl(run, EVENTS, seen.lines, seen.offset)
    found = {} if page.reset else seen.stragglers
    for row in page.rows:
        if row.get("event") == "straggler":
            found = _straggler_ratios(row.get("stragglers"))
        elif row.get("event") in STRAGGLERS_CLEARED_BY:
            found = {}
    with _stragglers_lock:
        _stragglers_seen[run.url] = _EventsSeen(page.lines, page.offset, found)
    return dict(found)


def _straggler_ratios(value: Any) -> dict[str, float]:
    """A straggler row's {"<node> rank <r>": ratio}, keeping only well-formed entries (a row is data a
    launcher wrote, never trusted to be whole)."""
    if not isinstance(value, dict):
        return {}
    out = {}
    for name, ratio in value.items():
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 0:
            out[str(name)] = round(float(ratio), 2)
    return out


def stragglers_label(stragglers: dict[str, float]) -> str:
    """Stragglers as people read them, slowest first: "h1 rank 1 (2.3x), h0 rank 3 (1.6x)"; "" for none.
    The pages write them so (static/run.js too), with one decimal as the launcher's message has it."""
    ranked = sorted(stragglers.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{name} ({ratio:.1f}x)" for name, ratio in ranked)


# ---------------------------------------------------------------------------------------------
# one run: its files, read as they grow


def open_run(output: str, run_id: str) -> Store:
    """The directory of run `run_id` directly under `output`. The id must be one plain path segment:
    a service hands this what a URL said, and nothing outside `output` may be reached through it."""
    if not RUN_ID_OK.match(run_id) or ".." in run_id:
        raise BadRunId(f"bad run id {run_id!r}: a run id is one name like mnist-20250101-120000-ab12")
    run = open_store(output).child(run_id)
    if not run.exists("config.json"):
        raise NoSuchRun(f"no run {run_id!r} under {output} (`dtrain runs` lists them)")
    return run


@dataclasses.dataclass
class JsonLines:
    """The complete lines of a .jsonl file after a cursor: `rows` (objects, each with its 1-based line
    number as "line"), `lines` and `offset` (complete lines and their bytes in the file: the cursor for
    the next read), `skipped` (line numbers that are not a JSON object), `reset` (the file no longer
    continues from the cursor, as when a resumed run rewrites metrics.jsonl: `rows` start again from
    line 1)."""

    rows: list[dict[str, Any]]
    lines: int
    offset: int
    skipped: list[int]
    reset: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "lines": self.lines,
            "skipped": {"count": len(self.skipped), "lines": self.skipped},
            "reset": self.reset,
        }


def read_jsonl(run: Store, name: str, after_line: int = 0, offset: int = 0) -> JsonLines:
    """A .jsonl file of a run (metrics.jsonl, events.jsonl) from line `after_line` + 1 on; with `offset`
    (that line's byte offset, from the last read) only the bytes after it are read, which for a run in
    a bucket is what makes following a long file cheap. A file that does not exist yet reads as empty.
    A final line without its newline is being written: it is left for the next read. A line that is
    not a JSON object is skipped and reported, never fatal."""
    reset = False
    if offset > 0:
        # One byte before the cursor: a newline there says the file still continues the one we read.
        data = _read(run, name, offset - 1)
        if data and data[:1] == b"\n":
            return _parse(data[1:], after_line, offset, reset=False)
        if data:
            reset = True  # rewritten (a resume drops the lines of the steps it replays)
        else:
            return JsonLines([], after_line, offset, [])  # nothing new (or shorter: noticed once it grows)
    data = _read(run, name, 0)
    page = _parse(data, 0, 0, reset=reset)
    if not reset and after_line:
        if after_line > page.lines:
            page.reset = True
        else:
            page.rows = [r for r in page.rows if r["line"] > after_line]
            page.skipped = [n for n in page.skipped if n > after_line]
    return page


def _read(run: Store, name: str, start: int) -> bytes:
    try:
        return run.read_bytes(name, start=start)
    except FileNotFoundError:
        return b""


def _parse(data: bytes, first_line: int, offset: int, *, reset: bool) -> JsonLines:
    """Complete lines of `data`, numbered after `first_line`; `offset` is where `data` starts."""
    end = data.rfind(b"\n") + 1
    lines = data[:end].decode(errors="replace").split("\n")[:-1]
    rows, skipped = [], []
    for number, line in enumerate(lines, first_line + 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if isinstance(row, dict):
            rows.append({**row, "line": number})
        else:
            skipped.append(number)
    return JsonLines(rows, first_line + len(lines), offset + end, skipped, reset)


def read_metrics(
    output: str, run_id: str, *, since: int | None = None, after_line: int = 0, offset: int = 0
) -> JsonLines:
    """A run's metrics rows: those after line `after_line` (at byte `offset`, if known), and of them
    those with a step above `since` (a client that knows only the last step it has seen)."""
    page = read_jsonl(open_run(output, run_id), METRICS, after_line, offset)
    if since is not None:
        page.rows = [r for r in page.rows if isinstance(r.get("step"), int) and r["step"] > since]
    return page


def read_events(output: str, run_id: str, after_line: int = 0, offset: int = 0) -> JsonLines:
    """A run's events.jsonl rows (started, checkpoint, resumed, preempted, failed, completed, ...)."""
    return read_jsonl(open_run(output, run_id), EVENTS, after_line, offset)


def read_status(run: Store) -> dict[str, Any]:
    """A run's status.json, its state as the runs table shows it ("stopped": a run on this machine whose
    process is gone without recording an end)."""
    status = read_json(run, "status.json") or {}
    return {**status, "state": _status(status)}


def checkpoints(run: Store) -> list[dict[str, Any]]:
    """A run's checkpoint steps, oldest first: step, name, whether it is complete (its meta.json lists
    every file with its size), its creation time and total size, and which one LATEST names."""
    store = run_checkpoints(run)  # written in place, or the copies of the nodes' checkpoint directories
    files = store.list("")
    names = sorted({p.split("/")[0] for p in files if p.count("/") >= 1 and STEP_RE.match(p.split("/")[0])})
    try:
        latest = store.read_bytes(LATEST).decode().strip()
    except FileNotFoundError:
        latest = None
    out = []
    for name in names:
        meta = complete_meta(store, name)
        out.append(
            {
                "step": int(name.split("-")[1]),
                "name": name,
                "complete": meta is not None,
                "created": (meta or {}).get("created"),
                "bytes": sum(f["size"] for f in meta["files"].values()) if meta else None,
                "latest": name == latest,
            }
        )
    return out


def hang_stacks(run: Store) -> list[dict[str, Any]]:
    """The Python stacks of the ranks found hung, as the launcher saved them into the run
    (hangs/<node>-rank<r>.txt), by name: [{"name", "text", "bytes"}], each text cut at HANG_STACK_CHARS."""
    out = []
    names = [p for p in run.list("hangs") if p.startswith("hangs/") and p.endswith(".txt") and p.count("/") == 1]
    for path in sorted(names):
        try:
            data = run.read_bytes(path)
        except FileNotFoundError:
            continue
        out.append({"name": path.split("/", 1)[1], "text": data.decode(errors="replace")[:HANG_STACK_CHARS],
                    "bytes": len(data)})  # fmt: skip
    return out


def run_summary(output: str, run_id: str) -> dict[str, Any]:
    """Run `run_id`'s row of the runs table."""
    open_run(output, run_id)
    return _summary(open_store(output), run_id)


def run_detail(output: str, run_id: str) -> dict[str, Any]:
    """Everything about one run but its metrics, events and logs (read those as they grow): its table
    row, config.json, status.json, checkpoints, its nodes' resource curves and each rank's peak memory (status.json's
    once the job has ended, its resources/ rows' so far while it runs)."""
    from dtrain.common.resources import read_series, series_peaks

    run = open_run(output, run_id)
    status = read_json(run, "status.json") or {}
    series = read_series(run, points=SERIES_POINTS)
    return {
        "run_id": run_id,
        "summary": _summary(open_store(output), run_id),
        "config": read_json(run, "config.json") or {},
        "status": status,
        "checkpoints": checkpoints(run),
        "resources": series,
        "peak_memory": status.get("peak_memory") or series_peaks(series),
        "url": run.url,
    }


@dataclasses.dataclass(frozen=True)
class LogLine:
    stamp: str  # ISO 8601, UTC, as the launcher wrote it
    node: str
    text: str


class NoLogs(UserError):
    """A run without node logs: it ran on this machine, or its launcher has not written any yet."""


def node_logs(output: str, ref: str, node: str | None = None) -> tuple[str, list[LogLine]]:
    """A cluster run's per-node log lines in time order (run id under `output`, or its directory or
    URL); `node` keeps one node's. Returns the run id and the lines."""
    store = locate(output, ref)
    return store.url.rstrip("/").rsplit("/", 1)[-1], read_node_logs(store, node)


def run_logs(output: str, run_id: str, node: str | None = None) -> list[LogLine]:
    """Run `run_id`'s node log lines (one plain run id under `output`, as a service is asked for it)."""
    return read_node_logs(open_run(output, run_id), node)


def read_node_logs(store: Store, node: str | None = None) -> list[LogLine]:
    """The lines of a run directory's logs/<node>.log files (or, if it has none, of the launcher's
    local staging copies on this machine), in time order."""
    from dtrain.control.remote import logs_cache_dir

    run_id = store.url.rstrip("/").rsplit("/", 1)[-1]
    names = [f for f in store.list("logs") if f.endswith(".log")]
    files = {Path(f).stem: store.read_bytes(f).decode(errors="replace") for f in names}
    if not files:
        cache = logs_cache_dir(run_id)
        files = {p.stem: p.read_text(errors="replace") for p in sorted(cache.glob("*.log"))}
    if not files:
        raise NoLogs(f"run {store.url} has no node logs (only runs launched on a cluster keep them, under logs/)")
    if node is not None and node not in files:
        raise NoLogs(f"run {run_id} has no log for node {node!r} (nodes: {', '.join(sorted(files))})")
    entries = []
    for name, text in files.items():
        if node is not None and name != node:
            continue
        for i, line in enumerate(text.splitlines()):
            stamp, _, rest = line.partition(" ")
            entries.append((stamp, name, i, rest))
    return [LogLine(stamp, name, rest) for stamp, name, _i, rest in sorted(entries)]
