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
import time
from types import FrameType
from typing import Any

# Seconds of wall time between two agreements on the flag. A SIGTERM is acted on within about this,
# plus the steps in progress (see PreemptionPoll), plus the checkpoint: well inside a spot VM's ~30 s notice.
PREEMPT_POLL_INTERVAL_S = 1.0
# Ranks post an agreement at the latest this many steps after the previous one's highest step (sooner
# when the interval has passed), which keeps ranks that share no collective within that many steps.
PREEMPT_POLL_MAX_STEPS = 100


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
    """The longest a stop can take from SIGTERM to the loop's exit, with steps of at most `step_s`:
    the signal waits for the next agreement to be posted (the interval, then the step in progress),
    that agreement completes once every rank has posted it (the slowest rank's interval and step),
    and the ranks stop one step after the highest step in it (that step, and the next)."""
    return interval_s + 3 * step_s


class PreemptionPoll:
    """Call it after every step: True on every rank, at the same step, once any rank got SIGTERM.

    Why not a blocking agreement every k steps: k would be sized from the step times measured so far,
    and if steps then slow down (checkpoint back-pressure, a slow upload) a stop waits k of the slower
    steps, past a spot VM's notice. Here each rank posts a non-blocking all-reduce of (flag, its step)
    on a gloo group that nothing else uses, once PREEMPT_POLL_INTERVAL_S of its own wall time has passed
    since its previous one, and never a second before the first has completed: so the n-th post of
    every rank meets the n-th of the others, whatever step each posts it at. The training thread never
    waits on it, except in one case below. When one completes with the flag set, every rank has the same
    (flag, highest step M) and stops after step M + 1, the same step everywhere.

    That is safe because no rank can be past step M + 1 when it learns of the stop: a rank that posted at
    step c (c <= M) and still has no answer at step c + 1 waits for it there, before deciding that step.
    Ranks in step with each other (DDP's gradient all-reduce) post within a step of each other, so that
    wait is short and rare. Stop latency: stop_bound_s(). Ranks that share no collective per step could
    drift apart, and the slower would then have to catch up before the stop; so each rank also posts,
    at the latest, at a step every rank computes alike: the previous agreement's highest step plus k,
    k sized from the slowest seconds per step in it (about an interval's worth, 1 <= k <=
    PREEMPT_POLL_MAX_STEPS). `close()` is collective: call it on every rank
    at the end of training (run_workload does), so no rank leaves a post its peers never meet."""

    def __init__(
        self,
        d: Any,
        watch: PreemptionWatch,
        interval_s: float = PREEMPT_POLL_INTERVAL_S,
        max_steps: int = PREEMPT_POLL_MAX_STEPS,
    ) -> None:
        self.d, self.watch, self.interval_s, self.max_steps = d, watch, interval_s, max_steps
        self.due_step = 1  # every rank posts at this step if its clock has not made it post sooner
        self.posts = 0  # agreements this rank has posted
        self.stop_at: int | None = None  # the step every rank stops after, once agreed
        self._work: Any = None  # the posted agreement: (handle, tensor, step posted at)
        self._posted: tuple[int, float] | None = None  # (step, time.perf_counter()) of the last post
        self._group: Any = None
        if d.backend is not None:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo", timeout=d.timeout)

    def __call__(self, step: int) -> bool:
        if self._group is None:
            return self.watch.requested
        if self._work is not None:
            handle, _, posted_step = self._work
            if step > posted_step or handle.is_completed():
                self._collect()
        if self.stop_at is not None:
            return step >= self.stop_at
        if self._work is not None:
            return False
        now = time.perf_counter()
        if step >= self.due_step or self._posted is None or now - self._posted[1] >= self.interval_s:
            per_step = (now - self._posted[1]) / max(1, step - self._posted[0]) if self._posted else 0.0
            self._post(step, 1.0 if self.watch.requested else 0.0, per_step)
            self._posted = (step, now)
        return False

    def _post(self, step: int, flag: float, per_step: float = 0.0) -> None:
        import torch
        import torch.distributed as dist

        t = torch.tensor([flag, float(step), per_step], dtype=torch.float64)
        self._work = (dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group, async_op=True), t, step)
        self.posts += 1

    def _collect(self) -> None:
        handle, t, _ = self._work
        handle.wait()
        self._work = None
        flag, highest, slowest = t.tolist()
        if flag > 0:
            self.stop_at = int(highest) + 1
        every = 1 if slowest <= 0 else max(1, min(self.max_steps, int(self.interval_s / slowest)))
        self.due_step = int(highest) + every

    def close(self) -> None:
        """Meet every peer's posts, so none is left waiting in one: the ranks agree (blocking, on the
        main group) on the most posts any made, each posts up to that, then waits for its posts.
        Collective. A rank may hold a post its peers have not met yet, so it must not wait for that
        one before the agreement."""
        if self._group is None:
            return
        (most,) = self.d.max_of(float(self.posts))
        pending = [self._work] if self._work is not None else []
        while self.posts < int(most):
            self._post(-1, 0.0)
            pending.append(self._work)
        for handle, _, _ in pending:
            handle.wait()
        self._work = None
