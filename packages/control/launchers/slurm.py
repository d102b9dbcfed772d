"""A Slurm cluster (dtrain's own, or the user's through its login node): an allocation, then the same
torchrun (or command) on each of its nodes through `srun`, followed until it ends (dtrain.control.slurm).

prepare: Slurm's view of the partition and the nodes it gives; sync: the job's files where its nodes
read them; execute: the batch step on every node (dtrain.common.slurmstep); stop: scancel with SIGTERM,
then Slurm's KillWait; collect: the job's state, exit code and each node's log.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.control.events import Events, Handle
from dtrain.control.launch_result import LaunchResult
from dtrain.control.launchers import Feature, Plan

if TYPE_CHECKING:
    from dtrain.control.cluster import Cluster


class OnSlurm:
    name = "slurm"
    place = "cluster {name!r}"

    def features(self, cluster: Cluster) -> frozenset[Feature]:
        """Every node reached over SSH (the login node, and the nodes too where dtrain set Slurm up: only then
        does doctor check each node), a queue with time limits, containers."""
        own = {Feature.NODE_CHECKS} if cluster.slurm is not None and cluster.slurm.managed else set()
        common = {Feature.SSH, Feature.GPU_QUERY, Feature.EVAL, Feature.QUEUE, Feature.TIME_LIMIT, Feature.CONTAINERS}
        return frozenset(common | own)

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        from dtrain.control.slurm.programs import run_program

        return run_program(plan, events=events, handle=handle)


LAUNCHER = OnSlurm()
