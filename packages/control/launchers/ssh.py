"""Every node of a hosts or gcp cluster, over SSH: the node agent (dtrain.common.nodeagent) on each.

prepare: connect (strict host keys), each node's interpreter, torch, cores and GPUs, the rendezvous port
reachable from every worker; sync: dtrain's node-side code to the run, the user's working directory
(only what changed: dtrain.common.codesync) and its requirements (once per node per content hash:
dtrain.common.deps); execute: torchrun with a c10d rendezvous on the master, or the command once per node;
stop: INT/TERM/KILL down each node's agent, which also creates the stop file; collect: each node's exit
code and last lines, logs/<node>.log in the run, the last copy of the checkpoint directory.
A built-in is started as a user's program is (its module under torchrun, no working directory to sync).
(dtrain.control.remote holds the node steps; remote_program the launch.)
"""

from __future__ import annotations

from dtrain.control.events import Events, Handle
from dtrain.control.launch_result import LaunchResult
from dtrain.control.launchers import Feature, Plan


class OverSSH:
    name = "ssh"
    place = "cluster {name!r}"

    def features(self, cluster: object) -> frozenset[Feature]:
        return frozenset({Feature.SSH, Feature.NODE_CHECKS, Feature.GPU_QUERY, Feature.EVAL, Feature.CONTAINERS})

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        from dtrain.control.remote_program import launch_program_cluster

        code = launch_program_cluster(plan, events=events, handle=handle)
        return LaunchResult(plan.job.name, plan.target.run_id, plan.target.run.url, code, plan.cluster.name)


LAUNCHER = OverSSH()
