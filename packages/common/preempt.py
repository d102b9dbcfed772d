"""SIGTERM -> finish the current step, checkpoint, exit with ExitCode.PREEMPTED.

A GCP spot VM sends SIGTERM about 30 s before it stops, and torchrun forwards it to every worker.
The handler only sets a flag. The ranks agree on it (`Dist.max_of`, so every rank stops at the
same step even if the signal reached only some of them) about once a PREEMPT_POLL_INTERVAL_S,
not after every step: the agreement is a blocking round trip through every rank
(benchmarks/preempt_poll.py measures it).
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

# Seconds of training between two agreements on the flag. A SIGTERM is acted on within this, plus the
# step in progress, plus the checkpoint: well inside a spot VM's ~30 s notice.
PREEMPT_POLL_INTERVAL_S = 1.0
# However short the steps, the flag is agreed on at least every this many steps.
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


class PreemptionPoll:
    """Call it after every step: True on every rank, at the same step, once any rank got SIGTERM.

    It agrees on the flag only every k steps, k chosen so that k steps take about
    PREEMPT_POLL_INTERVAL_S (1 <= k <= PREEMPT_POLL_MAX_STEPS). Each agreement carries every
    rank's seconds per step since the previous one, and k is worked out from their maximum, so
    every rank computes the same k and polls at the same steps: a rank that polled alone would wait
    in a collective its peers never join. The first agreement is after the first step; k follows the
    step time as it changes (an evaluation makes that interval's steps look slow, so the next is
    shorter)."""

    def __init__(
        self,
        d: Any,
        watch: PreemptionWatch,
        interval_s: float = PREEMPT_POLL_INTERVAL_S,
        max_steps: int = PREEMPT_POLL_MAX_STEPS,
    ) -> None:
        self.d, self.watch = d, watch
        self.interval_s, self.max_steps = interval_s, max_steps
        self.next_step: int | None = None  # the first call polls
        self.last: tuple[int, float] | None = None  # (step, time) of the previous agreement

    def __call__(self, step: int) -> bool:
        if self.next_step is not None and step < self.next_step:
            return False
        now = time.perf_counter()
        per_step = (now - self.last[1]) / max(1, step - self.last[0]) if self.last else 0.0
        flag, slowest = self.d.max_of(1.0 if self.watch.requested else 0.0, per_step)
        every = 1 if slowest <= 0 else max(1, min(self.max_steps, int(self.interval_s / slowest)))
        self.next_step, self.last = step + every, (step, now)
        return flag > 0
