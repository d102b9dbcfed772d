"""This machine: torchrun on localhost (or the command itself), no SSH, nothing to sync.

prepare: the process count (one per GPU, or 2 on CPU, bounded by cores); sync: the project's requirements
(dtrain.common.deps) — the code runs where it is (a built-in's is dtrain's own); execute/stop: one process
session, signalled as a whole, SIGKILL after the grace period (dtrain.control.userjob.supervise), and a hung
rank found by the launcher itself (dtrain.control.hangwatch: no node agent here); collect: the exit code, and
the run's status.json.
"""

from __future__ import annotations

from dtrain.control.events import Events, Handle
from dtrain.control.launch_result import LaunchResult
from dtrain.control.launchers import Feature, Plan


class Here:
    name = "local"
    place = "this machine"

    def features(self, cluster: object) -> frozenset[Feature]:
        return frozenset({Feature.LOCAL, Feature.GPU_QUERY, Feature.EVAL})

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        from dtrain.control.userjob import run_program_here

        code = run_program_here(plan, events=events, handle=handle)
        return LaunchResult(plan.job.name, plan.target.run_id, plan.target.run.url, code, "")


LAUNCHER = Here()
