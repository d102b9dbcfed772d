"""A cluster's VMs as Compute Engine sees them now (`node_states`: status, spot, preempted, uptime, IPs),
and the zones of a region that hold them (`cluster_zones`). What `dtrain status`, `down` and the cluster
service read."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterable
from typing import Any

from dtrain.control.gcp.client import Gcp, short_name
from dtrain.control.gcp.labels import label_filter, labelled

PREEMPTED_OPERATION = "compute.instances.preempted"
DOWN_STATUSES = ("STOPPING", "STOPPED", "TERMINATED", "SUSPENDING", "SUSPENDED")


@dataclasses.dataclass(frozen=True)
class NodeState:
    """One VM of a cluster as Compute Engine sees it now. `status` is the instance status
    (PROVISIONING, STAGING, RUNNING, STOPPING, TERMINATED, ...) or MISSING for an expected node that
    is gone (a spot VM whose termination action is DELETE)."""

    name: str
    zone: str
    status: str
    machine_type: str = ""
    gpus: int = 0
    accelerator: str = ""
    spot: bool = False
    preempted: bool = False
    preempted_at: str | None = None
    created: str = ""
    last_start: str | None = None
    uptime_s: float | None = None  # running: since its last start (or its creation); else None
    last_stop: str | None = None
    # Seconds it ran since its last start (its creation when Compute has no lastStartTimestamp): up to
    # now while it runs, up to its last stop once stopped. What `dtrain status` prices as node-hours.
    run_s: float = 0.0
    internal_ip: str = ""
    external_ip: str = ""


def node_states(
    gcp: Gcp,
    zone: str,
    cluster_name: str,
    *,
    expected: Iterable[str] = (),
    now: dt.datetime | None = None,
) -> list[NodeState]:
    """The cluster's VMs in `zone` (label dtrain-cluster=<name>), by name. Names in `expected` that
    are not found come back as MISSING.

    A node is `preempted` when it is a spot/preemptible VM, it is not running, and Compute Engine
    recorded a `compute.instances.preempted` operation for it after its last start: the documented
    way to tell a preemption from a stop (the zone's operations, filtered by operationType).
    """
    now = now or dt.datetime.now(dt.timezone.utc)
    with gcp.errors(f"listing the VMs of cluster {cluster_name} in {zone}"):
        found = [
            inst
            for inst in gcp.compute("InstancesClient").list(
                request={"project": gcp.project, "zone": zone, "filter": label_filter(cluster_name)},
                **gcp.rpc(),
            )
            if labelled(inst, cluster_name)
        ]
    spot = {inst.name for inst in found if _is_spot(inst)}
    missing = sorted(set(expected) - {inst.name for inst in found})
    preemptions = _preemptions(gcp, zone) if spot or missing else {}

    states = []
    for inst in found:
        nic = inst.network_interfaces[0] if inst.network_interfaces else None
        external = ""
        if nic is not None and nic.access_configs:
            external = nic.access_configs[0].nat_i_p or ""
        last_start = inst.last_start_timestamp or None
        preempted_at = preemptions.get(inst.name)
        preempted = (
            inst.name in spot
            and inst.status in DOWN_STATUSES
            and preempted_at is not None
            and (last_start is None or _time(preempted_at) >= _time(last_start))
        )
        started = last_start or inst.creation_timestamp or None
        last_stop = inst.last_stop_timestamp or None
        uptime = None
        if inst.status == "RUNNING" and started:
            uptime = max(0.0, (now - _time(started)).total_seconds())
        run_s = uptime or 0.0
        if inst.status not in ("RUNNING", "STAGING", "PROVISIONING") and started and last_stop:
            run_s = max(0.0, (_time(last_stop) - _time(started)).total_seconds())
        accs = list(inst.guest_accelerators)
        states.append(
            NodeState(
                name=inst.name,
                zone=zone,
                status=inst.status,
                machine_type=short_name(inst.machine_type),
                gpus=sum(a.accelerator_count for a in accs),
                accelerator=short_name(accs[0].accelerator_type) if accs else "",
                spot=inst.name in spot,
                preempted=preempted,
                preempted_at=preempted_at if preempted else None,
                created=inst.creation_timestamp,
                last_start=last_start,
                uptime_s=uptime,
                last_stop=last_stop,
                run_s=run_s,
                internal_ip=nic.network_i_p if nic is not None else "",
                external_ip=external,
            )
        )
    for name in missing:
        at = preemptions.get(name)
        states.append(NodeState(name=name, zone=zone, status="MISSING", preempted=at is not None, preempted_at=at))
    return sorted(states, key=lambda s: s.name)


def cluster_zones(gcp: Gcp, region: str, cluster_name: str) -> list[str]:
    """The zones of `region` that hold VMs labelled with the cluster, by name (one aggregated listing):
    where a cluster is when neither its record nor its table names a zone."""
    zones = set()
    with gcp.errors(f"looking for the VMs of cluster {cluster_name} in {region}"):
        pages = gcp.compute("InstancesClient").aggregated_list(
            request={"project": gcp.project, "filter": label_filter(cluster_name)}, **gcp.rpc()
        )
        for scope, scoped in pages:
            zone = short_name(scope)
            if zone.startswith(f"{region}-") and any(labelled(i, cluster_name) for i in scoped.instances):
                zones.add(zone)
    return sorted(zones)


def _is_spot(inst: Any) -> bool:
    sched = inst.scheduling
    return sched.provisioning_model == "SPOT" or bool(sched.preemptible)


def _preemptions(gcp: Gcp, zone: str) -> dict[str, str]:
    """instance name -> time of its latest preemption in `zone`, from the zone's operations."""
    latest: dict[str, str] = {}
    with gcp.errors(f"listing preemptions in {zone}"):
        ops = gcp.compute("ZoneOperationsClient").list(
            request={"project": gcp.project, "zone": zone, "filter": f'operationType = "{PREEMPTED_OPERATION}"'},
            **gcp.rpc(),
        )
        for op in ops:
            if op.operation_type != PREEMPTED_OPERATION or "/instances/" not in op.target_link:
                continue
            at = op.end_time or op.start_time or op.insert_time
            name = short_name(op.target_link)
            if at and (name not in latest or _time(at) > _time(latest[name])):
                latest[name] = at
    return latest


def _time(text: str) -> dt.datetime:
    """An RFC 3339 timestamp as Compute writes it ("2024-05-01T10:00:00.123-07:00")."""
    t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)
