"""Rank-0 reporting: metrics.jsonl, events.jsonl, TensorBoard, experiment trackers (dtrain.common.trackers),
and the console (a rich progress bar and
a few summary lines). On other ranks every method does nothing, so training code calls them without
`if rank == 0`.

Both JSONL files grow as the run goes; they are never rewritten (but once, on a resume, to drop the
lines of the steps it replays). A local run appends each line as it is logged. A run in a bucket
appends in chunks (Store.append_bytes: a server-side compose, no rewrite), from a background thread,
at least every FLUSH_EVERY_S, so a reader is never more than that behind. TensorBoard's event files
are written on this machine and, for a run in a bucket, copied up on the same schedule (its writer
appends to open files, which an object store cannot do).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.common import env as envmod
from dtrain.common import runrecord
from dtrain.common.errors import Preempted
from dtrain.common.storage import Store, is_remote

if TYPE_CHECKING:
    from dtrain.common.trackers import Trackers

# Read by the SSH launcher (dtrain.control.remote). STX, since \x1e would be a line break to str.splitlines.
PROGRESS_PREFIX = "\x02dtrain-progress "
PROGRESS_EVERY_S = 0.5
# A run in a bucket: its new metrics lines (and TensorBoard files) go up at least this often.
FLUSH_EVERY_S = 10.0
TB_CLOSE_S = 10.0  # the most the run waits for TensorBoard's writer to close (close())
METRICS = "metrics.jsonl"
EVENTS = runrecord.EVENTS


class Reporter:
    def __init__(
        self,
        *,
        enabled: bool,
        store: Store | None = None,
        tb_dir: str | None = None,
        tb_sync: Store | None = None,
        resume: bool = False,
        trackers: Trackers | None = None,
    ) -> None:
        """`tb_dir`: where TensorBoard writes (local); `tb_sync`: where its files are copied to (the run's
        tensorboard/ in a bucket), None when tb_dir is already in the run."""
        self.enabled = enabled
        self.store = store
        self._pending: list[str] = []  # metrics lines logged and not yet in the store
        self._lock = threading.Lock()  # the pending lines
        self._io = threading.Lock()  # one write to the store at a time, in order
        self._tb = None
        self._tb_dir = tb_dir
        self._tb_sync = tb_sync
        self._tb_sizes: dict[str, int] = {}
        self.trackers = trackers
        self._progress = None
        self._task = None
        self._t0 = time.monotonic()
        self._events: dict[str, Any] | None = None
        self._last_event = 0.0
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(force_terminal=envmod.console_is_terminal(), highlight=False, soft_wrap=True)
        if tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self._tb = SummaryWriter(log_dir=tb_dir)
        if store is not None and (is_remote(store.url) or tb_sync is not None):
            self._flusher = threading.Thread(target=self._flush_periodically, name="metrics-flush", daemon=True)
            self._flusher.start()

    def rewind(self, step: int) -> None:
        """Drop metrics lines past `step`: a resumed run replays those steps and logs them again. The
        one rewrite of metrics.jsonl in a run's life."""
        if not self.enabled or self.store is None:
            return
        try:
            text = self.store.read_bytes(METRICS).decode(errors="replace")
        except FileNotFoundError:
            return
        kept = [ln for ln in text.splitlines() if (row := _row(ln)) is not None and row.get("step", 0) <= step]
        with self._io:
            self.store.write_bytes(METRICS, "".join(ln + "\n" for ln in kept).encode())

    def info(self, message: str) -> None:
        if self.enabled:
            if self._progress is not None:
                self._progress.console.print(message, highlight=False)
            else:
                self.console.print(message, highlight=False)

    def start_progress(self, total: int, completed: int, description: str) -> None:
        if self.enabled and envmod.progress_events():
            self._events = {"total": total, "completed": completed, "description": description, "status": ""}
            self._emit(force=True)
            return
        if not self.enabled or not self.console.is_terminal:
            return
        self._progress = progress_bar(self.console)
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=completed, status="")

    def advance(self, step: int, status: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=step, status=status)
        if self._events is not None:
            self._events.update(completed=step, status=status)
            self._emit(force=step >= self._events["total"])

    def _emit(self, force: bool = False) -> None:
        """One progress line for the launcher, at most every PROGRESS_EVERY_S."""
        now = time.monotonic()
        if force or now - self._last_event >= PROGRESS_EVERY_S:
            self._last_event = now
            print(PROGRESS_PREFIX + json.dumps(self._events), flush=True)

    def log(self, step: int, **values: Any) -> None:
        """One metrics line (rank 0): in the file at once for a local run, within FLUSH_EVERY_S for one
        in a bucket."""
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time(), 3), **{k: _plain(v) for k, v in values.items()}}
        with self._lock:
            self._pending.append(json.dumps(row))
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
        if self.trackers is not None:
            self.trackers.log(step, values)
        if self.store is not None and not is_remote(self.store.url):
            self._write_pending()

    def event(self, step: int | None, kind: str, message: str, **fields: Any) -> None:
        """Something that happened to the run rather than a measurement (started, resumed, a checkpoint
        saved, preempted, failed, completed; its precision changed on a resume): one line of
        events.jsonl {"time", "step", "event", "message", ...}, written at once, and a console line.
        Safe from any thread (the checkpoint writer reports its commits)."""
        if not self.enabled:
            return
        if kind not in ("checkpoint", "started"):  # the console says those already
            self.info(f"step {step}: {message}" if step is not None else message)
        if self.store is not None:
            with self._io:
                record_event(self.store, step, kind, message, **fields)

    def _write_pending(self) -> None:
        with self._io:
            with self._lock:
                lines, self._pending = self._pending, []
            if lines and self.store is not None:
                try:
                    self.store.append_bytes(METRICS, "".join(ln + "\n" for ln in lines).encode())
                except BaseException:
                    with self._lock:  # not lost: they go with the next write
                        self._pending[:0] = lines
                    raise

    def flush(self) -> None:
        """Everything logged so far into the store (a checkpoint calls this first)."""
        if not self.enabled:
            return
        self._write_pending()
        if self._tb is not None:
            self._tb.flush()
            self._sync_tensorboard()

    def _sync_tensorboard(self) -> None:
        """Copy TensorBoard's files that grew since the last copy (whole: they are small)."""
        if self._tb_sync is None or self._tb_dir is None:
            return
        for path in sorted(Path(self._tb_dir).rglob("*")):
            if not path.is_file():
                continue
            size = path.stat().st_size
            rel = path.relative_to(self._tb_dir).as_posix()
            if self._tb_sizes.get(rel) != size:
                with self._io:
                    self._tb_sync.write_bytes(rel, path.read_bytes())
                self._tb_sizes[rel] = size

    def _flush_periodically(self) -> None:
        while not self._stop.wait(FLUSH_EVERY_S):
            # A failed upload is retried at the next tick; close() reports what is still failing.
            with contextlib.suppress(Exception):
                self.flush()

    def close(self) -> None:
        """Called from a `finally:`: an exception on its way out tells the trackers how the run ended."""
        if self.trackers is not None:
            ending = sys.exc_info()[1]
            self.trackers.close("completed" if ending is None else "failed" if _failure(ending) else "stopped")
            self.trackers = None
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=FLUSH_EVERY_S + 60)
            self._flusher = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._tb is not None:
            # TensorBoard's writer joins its own thread on close, and that join has been seen to wait forever
            # after a Ctrl-C reached the process mid-close (tests/dashboard/test_pages.py, in CI: the rank then
            # made no progress until the hang watch stopped it). Its event files are a copy of metrics.jsonl:
            # bounded, so a stuck writer costs its last events, never the run's end.
            closer = threading.Thread(target=self._tb.close, name="tensorboard-close", daemon=True)
            closer.start()
            closer.join(TB_CLOSE_S)
            if closer.is_alive():
                self.info(f"tensorboard: its writer did not close within {TB_CLOSE_S:.0f} s; its last events may be "
                          "missing (metrics.jsonl has them all)")  # fmt: skip
        self.flush()


def record_event(run: Store, step: int | None, kind: str, message: str, **fields: Any) -> None:
    """Append one line to the run's events.jsonl. Best effort: an event must never fail the run it
    describes."""
    runrecord.append_events(run, [runrecord.event_row(kind, message, step, **fields)])


def _failure(e: BaseException) -> bool:
    """An exception that ends a run as failed, not stopped (preempted, interrupted): the trackers' end state."""
    return not isinstance(e, (Preempted, KeyboardInterrupt))


def _row(line: str) -> dict[str, Any] | None:
    """A JSONL line as an object, or None for a blank or corrupt line."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def progress_bar(console: Any) -> Any:
    """The training progress bar (a rich Progress, not started): rank 0's own, or the SSH launcher's
    drawn from rank 0's progress lines."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    return round(v, 6) if isinstance(v, float) else v


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
