"""SIGTERM -> finish the current step, checkpoint, exit with ExitCode.PREEMPTED.

A GCP spot VM sends SIGTERM about 30 s before it stops, and torchrun forwards it to every worker.
The handler only sets a flag; the loop polls it after each step (`Dist.any`, so every rank stops
at the same step even if the signal reached only some of them).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


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
