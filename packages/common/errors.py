"""Exit codes and the one user-facing error type, shared by the CLI and the workloads.

This module imports nothing heavy: the CLI uses it without torch installed.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes. Workloads and the CLI use the same values, so a launcher can
    tell "resume me" (PREEMPTED) from "I failed" (FAILURE) from "fix your input" (USAGE)."""

    OK = 0
    FAILURE = 1  # runtime failure: a crash, a dead peer, a lost node
    USAGE = 2  # bad flags, config, data or paths: fix the input and run again
    PREEMPTED = 3  # SIGTERM received, a checkpoint was saved: safe to resume
    HUNG = 4  # no progress for the hang timeout: the node agent stopped the job (retried like a failure)
    INTERRUPTED = 130  # Ctrl-C


# How a program that dtrain asked to stop (SIGTERM: a cancel, a preemption, a time limit) may end when it did
# stop as asked: 0 (it finished), PREEMPTED (it checkpointed), 1 (torchrun reports its SIGTERM'd workers as a
# failure), 128 + SIGTERM or -SIGTERM (it died of the signal). Such a run is safe to resume: it ends PREEMPTED.
STOPPED_AS_ASKED = frozenset({0, int(ExitCode.FAILURE), int(ExitCode.PREEMPTED), 128 + 15, -15})


def stopped_as_asked(code: int) -> bool:
    """Whether a program asked to stop (SIGTERM) ended as one that stopped: its run ends PREEMPTED."""
    return code in STOPPED_AS_ASKED


def stop_outcome(code: int, asked: bool) -> int:
    """A program's exit code as the job's, by whether dtrain (or the cloud, through dtrain) asked it to stop:
    PREEMPTED only for a stop that was asked for and obeyed. A program that exits PREEMPTED unasked has
    FAILED: "preempted, safe to resume" would be said of a run that nobody stopped."""
    if asked and stopped_as_asked(code):
        return int(ExitCode.PREEMPTED)
    if code == ExitCode.PREEMPTED:
        return int(ExitCode.FAILURE)
    return code


class UserError(Exception):
    """A mistake the user can fix. Printed as one line (what was wrong, what to do), no traceback.

    `exit_code` is USAGE by default; a few runtime conditions the user must act on
    (an unreachable bucket, say) use FAILURE.
    """

    def __init__(self, message: str, *, exit_code: ExitCode = ExitCode.USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Preempted(Exception):
    """Raised after the checkpoint for a SIGTERM has been written; maps to ExitCode.PREEMPTED."""
