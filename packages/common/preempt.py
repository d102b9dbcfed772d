"""SIGTERM -> finish the current step, checkpoint, exit with ExitCode.PREEMPTED.

A GCP spot VM sends SIGTERM about 30 s before it stops, and torchrun forwards it to every worker.
The handler only sets a flag. The ranks agree on it (so every rank stops at the same step even if the
signal reached only some of them) about once a PREEMPT_POLL_INTERVAL_S of wall time, not after every
step: a blocking agreement is a round trip through every rank (benchmarks/preempt_poll.py measures
it). The agreement runs in the background, on a gloo group of its own, so that its cadence is set by
the clock and not by a number of steps chosen from step times that can change (docs/preemption.md).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

# Seconds of wall time between two agreements on the flag. A SIGTERM is acted on within about this,
# plus the steps in progress (see PreemptionPoll), plus the checkpoint: well inside a spot VM's ~30 s notice.
PREEMPT_POLL_INTERVAL_S = 1.0


class PreemptionWatch:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._previous: object = None

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


def stop_bound_s(interval_s: float, step_s: float) -> float:
    """The longest a stop can take from SIGTERM to the loop's exit, with steps of at most `step_s`, for ranks
    in step with each other (a collective every step, as DDP's): the signal waits for the next agreement to be
    posted (the interval), which carries the step the rank last polled (the step in progress is one more); the
    ranks stop one step after the highest step in it (and a rank may be a step behind the highest)."""
    return interval_s + 3 * step_s


class PreemptionPoll:
    """Call it after every step: True on every rank, at the same step, once any rank got SIGTERM.

    Why not a blocking agreement every k steps: k would be sized from the step times measured so far, and if
    steps then slow down (checkpoint back-pressure, a slow upload) a stop waits k of the slower steps, past a
    spot VM's notice. Here a thread of each rank posts an all-reduce of (flag, the rank's last polled step) on
    a gloo group that nothing else uses, waits for it, sleeps PREEMPT_POLL_INTERVAL_S and posts again: the n-th
    post of every rank meets the n-th of the others, and as the posts complete together the threads stay in
    time with each other. When one completes with the flag set, every rank has the same (flag, highest step M)
    and stops after step M + 1, the same step everywhere.

    No rank can be past step M + 1 when it learns of the stop: a rank whose post, made when it had polled step
    c (c <= M), has no answer yet when it polls step c + 1 waits for it there. That wait cannot deadlock with
    the training's own collectives, because the peers' posts come from their threads, not from their training
    loops; and it is short, since the threads post at about the same moment. Stop latency: stop_bound_s().
    `close()` is collective: call it on every rank at the end of training (run_workload does). A closing rank's
    thread goes on posting, at once and marked "closing", until a post finds every rank closing: its posts meet
    those of a peer still training (which may be waiting for exactly that in its last poll), and all threads end
    after the same post, so none is left waiting in one. (An earlier close agreed on the count of posts over the
    main group first: a peer waiting in its last poll for a post the closing rank's thread would never make
    could not get there, and both timed out.)"""

    def __init__(self, d: Any, watch: PreemptionWatch, interval_s: float = PREEMPT_POLL_INTERVAL_S) -> None:
        self.d, self.watch, self.interval_s = d, watch, interval_s
        self.posts = 0  # agreements this rank has posted
        self.stop_at: int | None = None  # the step every rank stops after, once agreed
        self._step = 0  # the last step polled
        self._pending: int | None = None  # the step polled when the post in flight was made
        self._error: BaseException | None = None
        self._closing = False
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._group: Any = None
        if d.backend is not None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=d.timeout)

    def __call__(self, step: int) -> bool:
        if self._group is None:
            return self.watch.requested
        with self._cond:
            self._step = step
            while self._pending is not None and step > self._pending and self._error is None:
                self._cond.wait()
            if self._error is not None:
                raise RuntimeError(f"the ranks' agreement on a stop failed: {self._error}") from self._error
            if self._thread is None:
                self._thread = threading.Thread(target=self._agree, name="dtrain-preempt-poll", daemon=True)
                self._thread.start()
            return self.stop_at is not None and step >= self.stop_at

    def _post(self, flag: float, step: int, closing: bool) -> tuple[Any, Any]:
        """An all-reduce (MAX) of (flag, step, -1 if closing else 0): the third is -1 only if every rank closes."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([flag, float(step), -1.0 if closing else 0.0], dtype=torch.float64)
        self.posts += 1
        return dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group, async_op=True), t

    def _agree(self) -> None:
        while True:
            with self._cond:
                closing = self._closing
                self._pending = self._step
                # a closing rank has trained its last step: a SIGTERM now asks it for nothing
                flag = 1.0 if self.watch.requested and not closing else 0.0
                handle, t = self._post(flag, self._step, closing)
            try:
                handle.wait()
            except BaseException as e:  # noqa: BLE001 - a peer is gone: the training loop says so
                with self._cond:
                    self._error, self._pending = e, None
                    self._cond.notify_all()
                return
            flag, highest, all_closing = t.tolist()
            with self._cond:
                if flag > 0:
                    self.stop_at = int(highest) + 1
                self._pending = None
                self._cond.notify_all()
                if self.stop_at is not None or all_closing < 0:
                    return  # every rank got the same answer: none posts again
            if not self._wake.is_set():
                self._wake.wait(self.interval_s)

    def close(self) -> None:
        """Meet every peer's posts, so none is left waiting in one: this rank's thread (started here if it never
        was) posts "closing" at once until a post finds every rank closing, then ends. Collective."""
        if self._group is None:
            return
        with self._cond:
            self._closing = True
            if self._thread is None and self._error is None:
                self._thread = threading.Thread(target=self._agree, name="dtrain-preempt-poll", daemon=True)
                self._thread.start()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
