"""This machine: torchrun on localhost (or the command itself), no SSH, nothing to sync.

prepare: the process count (one per GPU, or 2 on CPU, bounded by cores); sync: the project's requirements
(dtrain.common.deps) — the code runs where it is; execute/stop: one process session, signalled as a whole,
SIGKILL after the grace period (dtrain.control.userjob.supervise, dtrain.control.local.run_local), and a
hung rank found by the launcher itself (dtrain.control.hangwatch: no node agent here); collect: the exit code
reconciled with the run's status.json.
"""

from __future__ import annotations

from dtrain.control.events import Events, Handle
from dtrain.control.launch import LaunchResult
from dtrain.control.launchers import Plan


class Here:
    name = "local"
    over_ssh = False

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        if plan.image:
            from dtrain.common.errors import UserError

            raise UserError(
                "--image runs the job in containers on a cluster's nodes: add --cluster NAME (a hosts or gcp "
                "cluster); on this machine use `docker compose --profile cpu up` or docker run (see compose.yaml)"
            )
        if plan.builtin is not None:
            return _builtin(plan, events=events, handle=handle)
        from dtrain.control.userjob import run_program_here

        code = run_program_here(plan, events=events, handle=handle)
        return LaunchResult(plan.job.name, plan.target.run_id, plan.target.run.url, code, "")


def _builtin(plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
    """A built-in example: its module under torchrun with its flags, the run directory passed down."""
    from dtrain.control.local import plan_local, run_local

    _req, r = plan.builtin
    local = plan_local(
        plan.job.builtin,
        r.settings.explicit(plan.job.builtin),
        module=plan.job.program.target,
        nproc=plan.nproc,
        max_restarts=plan.max_restarts,
        output=r.settings.run.output,
        resumed=r.resumed,
        oversubscribe=plan.oversubscribe,
        tty=plan.tty,
        debug=plan.debug,
        hang_timeout=plan.hang_timeout,
    )
    verb = "resuming" if local.resuming else "starting"
    events.emit(
        "launch",
        f"{verb} {plan.job.builtin} run {local.run_id} on this machine: {local.nproc} process(es) x "
        f"{local.threads} thread(s)",
        run_id=local.run_id,
        workload=plan.job.builtin,
        nodes=1,
        nproc=local.nproc,
    )
    code = run_local(local, handle=handle, events=events)
    return LaunchResult(plan.job.builtin, local.run_id, local.run.url, code, "")


LAUNCHER = Here()
