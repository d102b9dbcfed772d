"""Process lifetimes, with no torch: a child that dies with its parent.

torchrun starts each worker in a session of its own, and dtrain starts torchrun in one too (so that a
terminal's Ctrl-C reaches dtrain alone, which forwards it once). Nothing then ties a child's life to
its parent's: a launcher killed with SIGKILL would leave its job running, holding cores, ports and
GPUs. Linux's PR_SET_PDEATHSIG has the kernel signal the child when its parent dies; set from a
`preexec_fn` it holds from before the child's program starts (before Python imports torch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits. False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig)) == 0
    return False


def dies_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `sig` when the process that starts it dies.

    The parent may die between fork and the prctl, after which the child has been reparented and
    would never get the signal: the child checks its parent is still the one that forked it, and
    exits at once if not."""
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig)
        if os.getppid() != parent:
            os._exit(128 + int(sig))

    return preexec
