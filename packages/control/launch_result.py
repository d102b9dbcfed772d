"""What running a job gives back (`LaunchResult`: the run, the exit code), whichever launcher ran it, and
what to tell the user after it ended (`next_step`: where the run is, or how to continue it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dtrain.common.config import DEFAULT_OUTPUT
from dtrain.common.errors import ExitCode
from dtrain.common.storage import is_remote


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    workload: str
    run_id: str
    url: str  # the run's directory or gs:// URL
    exit_code: int
    cluster: str  # "" for this machine

    @property
    def ok(self) -> bool:
        return self.exit_code == ExitCode.OK


def resume_ref(result: LaunchResult) -> str:
    """What `--resume` takes to find this run again from the folder the command ran in: its id where it sits
    under the default output (./runs), else its location (relative to that folder where it is below it, else
    absolute, or its gs:// URL). An id alone is looked for under the default output only, so a run given
    `--output` must be named by its place."""
    url, run_id = result.url, result.run_id
    if is_remote(url):
        return url
    here, path = Path.cwd().resolve(), Path(url).resolve()
    if path == here / DEFAULT_OUTPUT / run_id:
        return run_id
    return f"./{path.relative_to(here)}" if path.is_relative_to(here) else str(path)


def next_step(result: LaunchResult, program: bool = False) -> str:
    """What to tell the user after the job ended: where the run is, or how to continue it (a line that works
    as printed, from the folder it was printed in)."""
    w, r = result.workload, result.run_id
    if not r:  # no run was made (--show-example): none to point at
        return "" if result.exit_code in (ExitCode.OK, ExitCode.USAGE) else f"{w} failed (exit {result.exit_code})"
    if result.exit_code == ExitCode.USAGE:
        return ""
    resume = (
        f"dtrain train --resume {resume_ref(result)}" if program else f"dtrain train {w} --resume {resume_ref(result)}"
    )
    if program:  # a user's program
        if result.exit_code == ExitCode.OK:
            return f"run {r} completed: {result.url}"
        how = {ExitCode.PREEMPTED: "stopped", ExitCode.INTERRUPTED: "interrupted"}.get(result.exit_code, "failed")
        return f"run {r} {how} (exit {result.exit_code}): `{resume}` continues it from its checkpoint directory"
    if result.exit_code == ExitCode.OK:
        # its checkpoints: checkpoints/ where they were written in place, ckpt/ where they were copied there
        return f"run {r} completed: {result.url} (config.json, metrics.jsonl, its checkpoints, final/)"
    if result.exit_code == ExitCode.PREEMPTED:
        return f"run {r} stopped after a checkpoint: resume with `{resume}`"
    if result.exit_code == ExitCode.INTERRUPTED:
        return f"run {r} interrupted: `{resume}` continues from its last checkpoint"
    return (
        f"run {r} failed (exit {result.exit_code}); logs above. `{resume}` continues from its last complete checkpoint"
    )
