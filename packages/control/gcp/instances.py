"""Start, stop and delete a cluster's VMs through the Compute API: what the cluster service does to
recover a preempted node and to autostop, and what `dtrain submit`/`up` do to a stopped cluster.

    start(gcp, zone, "demo-worker-0")          # waits for the operation; NoCapacity when the zone is out
    stop(gcp, zone, "demo-worker-0")
    start_cluster(gcp, zone, "demo", ["demo-master", "demo-worker-0"], events=..., handle=...)

Operations are waited for on the endpoint `gcp` talks to (ZoneOperations.wait), never through the
ExtendedOperation's own poller, which would ask Google whatever the endpoint (see sweep._start_delete).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.events import Events, Handle
from dtrain.control.gcp.client import Gcp
from dtrain.control.gcp.errors import api_error, is_stockout

OPERATION_TIMEOUT_S = 300.0
OPERATION_POLL_S = 1.0
RUNNING = ("RUNNING", "PROVISIONING", "STAGING")
STOPPED = ("TERMINATED", "STOPPED", "SUSPENDED")


class NoCapacity(Exception):
    """The zone has no capacity for the VM now: try again later."""

    def __init__(self, zone: str, message: str) -> None:
        super().__init__(message)
        self.zone = zone


class OperationFailed(Exception):
    """An instance operation ended with an error other than a stockout."""


def _call(gcp: Gcp, verb: str, zone: str, name: str) -> None:
    """instances.<verb> and wait for its operation. NoCapacity, OperationFailed, or the client's error."""
    client = gcp.compute("InstancesClient")
    try:
        op = getattr(client, verb)(project=gcp.project, zone=zone, instance=name, **gcp.rpc())
    except Exception as e:  # noqa: BLE001 - a stockout may come back on the request itself
        if is_stockout(message=str(e)):
            raise NoCapacity(zone, _one_line(str(e))) from e
        raise
    _wait(gcp, zone, op)


def _wait(gcp: Gcp, zone: str, op: Any) -> None:
    ops = gcp.compute("ZoneOperationsClient")
    deadline = time.monotonic() + OPERATION_TIMEOUT_S
    while getattr(op.status, "name", op.status) != "DONE":
        if time.monotonic() > deadline:
            raise OperationFailed(f"operation {op.name} still running after {OPERATION_TIMEOUT_S:.0f} s")
        started = time.monotonic()
        op = ops.wait(project=gcp.project, zone=zone, operation=op.name, timeout=60.0, retry=gcp.rpc()["retry"])
        if getattr(op.status, "name", op.status) != "DONE":
            time.sleep(max(0.0, OPERATION_POLL_S - (time.monotonic() - started)))
    errors = list(op.error.errors) if getattr(op, "error", None) else []
    if errors:
        first = errors[0]
        if is_stockout(first.code, first.message):
            raise NoCapacity(zone, _one_line(first.message))
        raise OperationFailed(f"{first.code}: {_one_line(first.message)}" if first.code else first.message)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def start(gcp: Gcp, zone: str, name: str) -> None:
    """Start a stopped VM and wait until Compute says it runs (not that it has booted)."""
    _call(gcp, "start", zone, name)


def stop(gcp: Gcp, zone: str, name: str) -> None:
    _call(gcp, "stop", zone, name)


def delete(gcp: Gcp, zone: str, name: str) -> None:
    _call(gcp, "delete", zone, name)


def describe(gcp: Gcp, exc: BaseException) -> str:
    """One line for any error `start`/`stop`/`delete` raised."""
    if isinstance(exc, (NoCapacity, OperationFailed)):
        return str(exc)
    mapped = api_error(exc, project=gcp.project, doing="", endpoint=gcp.endpoint)
    return str(mapped) if mapped is not None else f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------------------------------
# a whole cluster

START_ATTEMPTS = 6  # per node, for `dtrain submit`/`up` on a stopped cluster (the service never gives up)
START_BACKOFF_S = 10.0


@dataclasses.dataclass(frozen=True)
class Started:
    started: tuple[str, ...]  # the nodes this call started (the others were running already)


def start_cluster(
    gcp: Gcp,
    zone: str,
    cluster_name: str,
    names: Iterable[str],
    *,
    events: Events,
    handle: Handle,
    backoff_s: float = START_BACKOFF_S,
) -> Started:
    """Start the cluster's stopped VMs, the master (the first of `names`) first: the workers' slurmd
    registers with the master's slurmctld. A zone without capacity is tried again, START_ATTEMPTS times
    per node with a growing pause, then one line that says so. Returns once Compute says each runs; the
    caller waits for the nodes to answer (lifecycle.wait_ready)."""
    from dtrain.control.gcp.vmstates import node_states

    names = list(names)
    states = {s.name: s for s in node_states(gcp, zone, cluster_name, expected=names)}
    missing = [n for n in names if states[n].status == "MISSING"]
    if missing:
        raise UserError(
            f"cluster {cluster_name}: {', '.join(missing)} no longer exist (deleted, e.g. by autostop_action = "
            f'"delete"): run dtrain up --cluster {cluster_name} to make them again'
        )
    started = []
    for name in names:
        if states[name].status in RUNNING:
            continue
        for attempt in range(1, START_ATTEMPTS + 1):
            if handle.stopped:
                raise UserError("interrupted while starting the cluster", exit_code=ExitCode.INTERRUPTED)
            events.emit("stage", f"starting {name} in {zone}")
            try:
                start(gcp, zone, name)
                break
            except NoCapacity as e:
                if attempt == START_ATTEMPTS:
                    raise UserError(
                        f"{name}: no capacity in {zone} after {attempt} tries ({e}): try again later, or set "
                        f"another zone and run dtrain up --cluster {cluster_name}",
                        exit_code=ExitCode.FAILURE,
                    ) from e
                pause = backoff_s * 2 ** (attempt - 1)
                events.warning(f"{name}: waiting for capacity in {zone} ({e}); trying again in {pause:.0f} s")
                time.sleep(pause)
            except OperationFailed as e:
                if "STOPPING" in str(e) or attempt == START_ATTEMPTS:
                    raise UserError(f"{name}: could not start it: {e}", exit_code=ExitCode.FAILURE) from e
                time.sleep(backoff_s)
            except Exception as e:  # noqa: BLE001
                raise UserError(f"{name}: could not start it: {describe(gcp, e)}", exit_code=ExitCode.FAILURE) from e
        started.append(name)
        events.check(f"started {name}", True)
    return Started(tuple(started))
