"""The sweep `dtrain down` runs after `terraform destroy`: everything still labelled with (or, for what takes
no labels, named after) the cluster, found (`find_leftovers`) and deleted in dependency order
(`delete_leftovers`). dtrain.control.gcp.labels says how a cluster's resources are recognised."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import Any

from dtrain.control.gcp.client import REQUEST_TIMEOUT_S, Gcp, short_name
from dtrain.control.gcp.errors import api_error
from dtrain.control.gcp.labels import CLUSTER_LABEL, NETWORK_PREFIX, label_filter, labelled

# Bounds on waiting for one Compute operation (a delete): each `wait` call returns after at most
# about two minutes server-side; the deadline is ours.
OPERATION_TIMEOUT_S = 600.0
OPERATION_POLL_S = 1.0

# Deletion order: what uses a thing goes before it (a VM holds its disks and addresses; a Cloud
# Router's NAT holds its subnetwork; routers, firewalls and subnetworks hold their network).
# Buckets last, so a failed VM delete never costs checkpoints.
KIND_ORDER = ("instance", "disk", "address", "router", "firewall", "subnetwork", "network", "bucket")


@dataclasses.dataclass(frozen=True)
class Leftover:
    """A resource still there after `terraform destroy`. `location` is a zone, a region, "global"
    (firewalls, networks) or "" (buckets); `why` says how it was matched."""

    kind: str
    name: str
    location: str
    why: str

    def __str__(self) -> str:
        where = f" ({self.location})" if self.location else ""
        return f"{self.kind} {self.name}{where}"


@dataclasses.dataclass(frozen=True)
class DeleteResult:
    leftover: Leftover
    ok: bool
    message: str  # "deleted", "already gone", or the error line

    def __str__(self) -> str:
        return f"{self.leftover}: {self.message}"


def find_leftovers(gcp: Gcp, region: str, cluster_name: str, *, include_buckets: bool) -> list[Leftover]:
    """Everything of cluster `cluster_name` still in the project, in deletion order. Finds, never deletes.

    - instances, disks (zones of `region`), addresses (`region`): label dtrain-cluster=<name>;
    - networks (no labels in Compute v1): named `dtrain-<name>` (infra/'s name), or whose
      description says "dtrain cluster <name>" or "dtrain-cluster=<name>" as a whole word, so
      cluster `demo` never matches `dtrain-demo-2` ("dtrain cluster demo-2");
    - routers, firewalls and subnetworks (any region): those on one of those networks (they must go
      before the network can), plus firewalls and subnetworks whose description matches as above;
    - buckets labelled dtrain-cluster=<name>, only when `include_buckets` (they hold checkpoints).

    Zonal and regional resources are looked for in `region` only: a cluster of the same name in
    another region (another checkout, another dtrain.toml) is not this one.
    """
    found: list[Leftover] = []
    label = f"label {CLUSTER_LABEL}={cluster_name}"
    described = f"description names cluster {cluster_name}"
    in_region = re.compile(rf"^(zones/{re.escape(region)}-[a-z0-9]+|regions/{re.escape(region)})$")

    def aggregated(client: str, field: str, doing: str, by_label: bool) -> Iterator[tuple[str, Any]]:
        request = {"project": gcp.project}
        if by_label:
            request["filter"] = label_filter(cluster_name)
        with gcp.errors(doing):
            for scope, scoped in gcp.compute(client).aggregated_list(request=request, **gcp.rpc()):
                for res in getattr(scoped, field):
                    yield scope, res

    for scope, inst in aggregated("InstancesClient", "instances", "listing VMs", True):
        if in_region.match(scope) and labelled(inst, cluster_name):
            found.append(Leftover("instance", inst.name, short_name(scope), label))
    for scope, disk in aggregated("DisksClient", "disks", "listing disks", True):
        if in_region.match(scope) and labelled(disk, cluster_name):
            found.append(Leftover("disk", disk.name, short_name(scope), label))
    for scope, addr in aggregated("AddressesClient", "addresses", "listing addresses", True):
        if in_region.match(scope) and labelled(addr, cluster_name):
            found.append(Leftover("address", addr.name, short_name(scope), label))

    with gcp.errors("listing networks"):
        networks = {}
        for n in gcp.compute("NetworksClient").list(project=gcp.project, **gcp.rpc()):
            if n.name == f"{NETWORK_PREFIX}{cluster_name}":
                networks[n.name] = f"name {n.name}"
            elif _described(n.description, cluster_name):
                networks[n.name] = described
    for scope, router in aggregated("RoutersClient", "routers", "listing Cloud Routers", False):
        if why := _on_networks(router.network, networks):
            found.append(Leftover("router", router.name, short_name(scope), why))
    with gcp.errors("listing firewall rules"):
        for fw in gcp.compute("FirewallsClient").list(project=gcp.project, **gcp.rpc()):
            why = _on_networks(fw.network, networks) or (described if _described(fw.description, cluster_name) else "")
            if why:
                found.append(Leftover("firewall", fw.name, "global", why))
    for scope, sub in aggregated("SubnetworksClient", "subnetworks", "listing subnetworks", False):
        why = _on_networks(sub.network, networks) or (described if _described(sub.description, cluster_name) else "")
        if why:
            found.append(Leftover("subnetwork", sub.name, short_name(scope), why))
    found += [Leftover("network", name, "global", why) for name, why in sorted(networks.items())]

    if include_buckets:
        with gcp.errors("listing buckets"):
            for bucket in gcp.storage().list_buckets(project=gcp.project, timeout=REQUEST_TIMEOUT_S):
                if (bucket.labels or {}).get(CLUSTER_LABEL) == cluster_name:
                    found.append(Leftover("bucket", bucket.name, "", label))
    return sorted(found, key=lambda x: (KIND_ORDER.index(x.kind), x.location, x.name))


_MARK_RE = re.compile(r"(?:\bdtrain cluster |\bdtrain-cluster=)([A-Za-z0-9_.-]*[A-Za-z0-9_])")


def _described(description: str, cluster_name: str) -> bool:
    """Whether a label-less resource's description names this cluster ("dtrain cluster demo",
    "dtrain-cluster=demo"), the whole name: "dtrain cluster demo-2" is not cluster demo's."""
    return cluster_name in _MARK_RE.findall(description or "")


def _on_networks(network_url: str, networks: dict[str, str]) -> str:
    net = short_name(network_url)
    return f"on network {net}" if net in networks else ""


def delete_leftovers(
    gcp: Gcp,
    leftovers: Iterable[Leftover],
    *,
    timeout_s: float = OPERATION_TIMEOUT_S,
    on_result: Callable[[DeleteResult], None] | None = None,
) -> list[DeleteResult]:
    """Delete in dependency order (instances, disks, addresses, firewalls, subnetworks, networks,
    then buckets, emptied first). Within a kind the deletes are started together and then waited
    for. Every item gets a result (and `on_result` is called as each one ends); nothing raises
    halfway, so a failure never hides what was left. The results come back in deletion order."""
    results: list[DeleteResult] = []

    def done(item: Leftover, ok: bool, message: str) -> None:
        result = DeleteResult(item, ok, message)
        results.append(result)
        if on_result is not None:
            on_result(result)

    items = sorted(leftovers, key=lambda x: (KIND_ORDER.index(x.kind), x.location, x.name))
    for kind in KIND_ORDER:
        batch = [x for x in items if x.kind == kind]
        if kind == "bucket":
            for item in batch:
                ok, message = _delete_bucket(gcp, item)
                done(item, ok, message)
            continue
        started: list[tuple[Leftover, Any]] = []
        for item in batch:
            try:
                op = _start_delete(gcp, item)
            except _AlreadyGone:
                done(item, True, "already gone")
                continue
            except Exception as e:  # noqa: BLE001 - reported per item
                done(item, False, _describe_failure(gcp, e, item))
                continue
            started.append((item, op))
        deadline = time.monotonic() + timeout_s
        for item, op in started:
            try:
                _wait(gcp, item, op, deadline, timeout_s)
                done(item, True, "deleted")
            except Exception as e:  # noqa: BLE001 - reported per item
                done(item, False, _describe_failure(gcp, e, item))
    position = {id(item): i for i, item in enumerate(items)}
    return sorted(results, key=lambda r: position[id(r.leftover)])


class _AlreadyGone(Exception):
    pass


class _OperationFailed(Exception):
    pass


_DELETERS = {
    "instance": ("InstancesClient", "zone", "instance"),
    "disk": ("DisksClient", "zone", "disk"),
    "address": ("AddressesClient", "region", "address"),
    "router": ("RoutersClient", "region", "router"),
    "firewall": ("FirewallsClient", None, "firewall"),
    "subnetwork": ("SubnetworksClient", "region", "subnetwork"),
    "network": ("NetworksClient", None, "network"),
}


def _start_delete(gcp: Gcp, item: Leftover) -> Any:
    from google.api_core import exceptions as gexc

    client_name, scope_arg, name_arg = _DELETERS[item.kind]
    kwargs = {"project": gcp.project, name_arg: item.name, **gcp.rpc()}
    if scope_arg:
        kwargs[scope_arg] = item.location
    try:
        # The returned ExtendedOperation is not waited on with .result(): its poller is a client
        # the library builds without our client_options, so it would ask Google, not `endpoint`.
        return gcp.compute(client_name).delete(**kwargs)
    except gexc.NotFound:
        raise _AlreadyGone() from None


def _wait(gcp: Gcp, item: Leftover, op: Any, deadline: float, timeout_s: float) -> None:
    """Wait for a delete's operation on the endpoint we talk to, until DONE or `deadline`."""
    import requests
    from google.api_core import exceptions as gexc

    if item.kind in ("instance", "disk"):
        client, scope = gcp.compute("ZoneOperationsClient"), {"zone": item.location}
    elif item.kind in ("address", "subnetwork", "router"):
        client, scope = gcp.compute("RegionOperationsClient"), {"region": item.location}
    else:
        client, scope = gcp.compute("GlobalOperationsClient"), {}
    while not _op_done(op):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"still running after {timeout_s:.0f}s (operation {op.name})")
        started = time.monotonic()
        try:
            op = client.wait(
                project=gcp.project,
                operation=op.name,
                timeout=max(10.0, min(left, 130.0)),
                retry=gcp.rpc()["retry"],
                **scope,
            )
        except gexc.NotFound:
            break  # operations are kept for a while only
        except requests.Timeout:
            continue  # the deadline check above decides
        if not _op_done(op):
            # `wait` normally blocks server-side; pace the loop only when it came back at once.
            pause = OPERATION_POLL_S - (time.monotonic() - started)
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
    error = getattr(op, "error", None)
    errors = list(error.errors) if error else []
    if errors:
        first = errors[0]
        raise _OperationFailed(f"{first.code}: {first.message}" if first.code else first.message)


def _op_done(op: Any) -> bool:
    status = op.status
    return getattr(status, "name", status) == "DONE"


def _describe_failure(gcp: Gcp, exc: BaseException, item: Leftover) -> str:
    if isinstance(exc, (_OperationFailed, TimeoutError)):
        return f"not deleted: {exc}"
    mapped = api_error(exc, project=gcp.project, doing="", endpoint=gcp.endpoint)
    return f"not deleted: {mapped if mapped is not None else f'{type(exc).__name__}: {exc}'}"


def _delete_bucket(gcp: Gcp, item: Leftover) -> tuple[bool, str]:
    """Empty the bucket (every object version) and delete it."""
    from google.api_core import exceptions as gexc

    try:
        bucket = gcp.storage().bucket(item.name)
        removed = 0
        for blob in gcp.storage().list_blobs(item.name, versions=True, timeout=REQUEST_TIMEOUT_S):
            with suppress(gexc.NotFound):  # deleted meanwhile: fine
                blob.delete(timeout=REQUEST_TIMEOUT_S)
            removed += 1
        bucket.delete(timeout=REQUEST_TIMEOUT_S)
    except gexc.NotFound:
        return True, "already gone"
    except Exception as e:  # noqa: BLE001 - reported per item
        return False, _describe_failure(gcp, e, item)
    return True, f"deleted ({removed} objects)" if removed else "deleted"
