"""Every node of a hosts or gcp cluster, over SSH: the node agent (dtrain.common.nodeagent) on each.

prepare: connect (strict host keys), each node's interpreter, torch, cores and GPUs, the rendezvous port
reachable from every worker; sync: dtrain's node-side code to the run, the user's working directory
(only what changed: dtrain.common.codesync) and its requirements (once per node per content hash:
dtrain.common.deps); execute: torchrun with a c10d rendezvous on the master, or the command once per node;
stop: INT/TERM/KILL down each node's agent, which also creates the stop file; collect: each node's exit
code and last lines, logs/<node>.log in the run, the last copy of the checkpoint directory.
(dtrain.control.remote holds the steps a built-in and a user's program share; remote_program the rest.)
"""

from __future__ import annotations

from dtrain.control.events import Events, Handle
from dtrain.control.launch import LaunchResult
from dtrain.control.launchers import Plan


class OverSSH:
    name = "ssh"
    over_ssh = True

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        if plan.builtin is None:
            from dtrain.control.remote_program import launch_program_cluster

            code = launch_program_cluster(plan, events=events, handle=handle)
            return LaunchResult(plan.job.name, plan.target.run_id, plan.target.run.url, code, plan.cluster.name)
        from dtrain.control.remote import launch_cluster

        _req, r = plan.builtin
        workload = plan.job.builtin
        code, run, run_id = launch_cluster(
            workload,
            r.settings.explicit(workload),
            module=plan.job.program.target,
            cluster=plan.cluster,
            nproc=plan.nproc,
            max_restarts=plan.max_restarts,
            hang_timeout=plan.hang_timeout,
            output=r.output,
            resumed=r.resumed,
            accept_new_host_keys=plan.accept_new_host_keys,
            events=events,
            handle=handle,
            image=plan.image,
            oversubscribe=plan.oversubscribe,
            debug=plan.debug,
        )
        return LaunchResult(workload, run_id, run.url, code, plan.cluster.name)


LAUNCHER = OverSSH()
