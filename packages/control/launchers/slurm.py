"""A Slurm cluster (dtrain's own, or the user's through its login node): an allocation, then the same
torchrun (or command) on each of its nodes through `srun`, followed until it ends (dtrain.control.slurm).

prepare: Slurm's view of the partition and the nodes it gives; sync: the job's files where its nodes
read them; execute: the batch step on every node (dtrain.common.slurmstep); stop: scancel with SIGTERM,
then Slurm's KillWait; collect: the job's state, exit code and each node's log.
"""

from __future__ import annotations

from dtrain.control.events import Events, Handle
from dtrain.control.launch_result import LaunchResult
from dtrain.control.launchers import Plan


class OnSlurm:
    name = "slurm"
    over_ssh = True  # the login node and the nodes are reached over SSH

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        from dtrain.control.slurm.programs import run_program

        return run_program(plan, events=events, handle=handle)


LAUNCHER = OnSlurm()
