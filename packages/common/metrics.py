"""Rank-0 reporting: metrics.jsonl, TensorBoard events when tensorboard is installed, and the
console (a rich progress bar and a few summary lines). On other ranks every method does nothing,
so training code calls them without `if rank == 0`."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from typing import Any

from dtrain.common import env as envmod
from dtrain.common.storage import Store

# Read by the SSH launcher (cli/remote.py). STX, since \x1e would be a line break to str.splitlines.
PROGRESS_PREFIX = "\x02dtrain-progress "
PROGRESS_EVERY_S = 0.5


class Reporter:
    def __init__(
        self, *, enabled: bool, store: Store | None = None, tb_dir: str | None = None, resume: bool = False
    ) -> None:
        self.enabled = enabled
        self.store = store
        self._lines: list[str] = []
        self._tb = None
        self._progress = None
        self._task = None
        self._t0 = time.monotonic()
        self._events: dict[str, Any] | None = None
        self._last_event = 0.0
        if not enabled:
            return
        from rich.console import Console

        self.console = Console(force_terminal=envmod.console_is_terminal(), highlight=False, soft_wrap=True)
        if store is not None and resume:
            with contextlib.suppress(FileNotFoundError):
                self._lines = store.read_bytes("metrics.jsonl").decode().splitlines()
        if tb_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                pass
            else:
                self._tb = SummaryWriter(log_dir=tb_dir)

    def rewind(self, step: int) -> None:
        """Drop metrics lines past `step`: a resumed run replays those steps and logs them again."""
        self._lines = [ln for ln in self._lines if ln.strip() and json.loads(ln).get("step", 0) <= step]

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
        """One metrics line (rank 0). Lines are kept in memory and flushed by `flush()`."""
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time(), 3), **{k: _plain(v) for k, v in values.items()}}
        self._lines.append(json.dumps(row))
        if self._tb is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)

    def event(self, step: int, kind: str, message: str, **fields: Any) -> None:
        """Something that happened to the run rather than a measurement (its precision changed on a
        resume, say): a metrics line {"step", "time", "event": kind, "message", ...} and a console line."""
        self.log(step, event=kind, message=message, **fields)
        self.info(f"step {step}: {message}")

    def flush(self) -> None:
        """Write metrics.jsonl in full (a small file; one atomic write works for gs:// too)."""
        if self.enabled and self.store is not None:
            self.store.write_bytes("metrics.jsonl", ("\n".join(self._lines) + "\n").encode())
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self.flush()
        if self._tb is not None:
            self._tb.close()


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
