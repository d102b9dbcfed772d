"""Preflight, before `terraform apply`: the quotas a cluster draws on (GPUs, vCPUs, disks, addresses,
instances), the zones of the region that offer its accelerator, and the APIs the project must have enabled.
Reads only; nothing is created."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.gcp.client import Gcp, short_name
from dtrain.control.gcp.errors import QUOTA_PAGE

REGION_RE = re.compile(r"[a-z]+(?:-[a-z0-9]+)+")

# What every cluster needs enabled before anything is created (infra/: VMs and networks, the
# checkpoint bucket, the image repository, the nodes' service account and its grants). The project-level
# grants (infra/iam.tf's google_project_iam_member) read and write the project's IAM policy through the
# Resource Manager API, and preflight's testIamPermissions is a Resource Manager call too.
REQUIRED_SERVICES = (
    "compute.googleapis.com",
    "storage.googleapis.com",
    "artifactregistry.googleapis.com",
    "iam.googleapis.com",
    "cloudresourcemanager.googleapis.com",
)

# Accelerator type (as in --accelerator / the zone's acceleratorTypes) -> regional quota metric.
# The spot variant is the same metric with PREEMPTIBLE_ in front.
ACCELERATOR_QUOTA = {
    "nvidia-tesla-t4": "NVIDIA_T4_GPUS",
    "nvidia-l4": "NVIDIA_L4_GPUS",
    "nvidia-tesla-v100": "NVIDIA_V100_GPUS",
    "nvidia-tesla-p100": "NVIDIA_P100_GPUS",
    "nvidia-tesla-p4": "NVIDIA_P4_GPUS",
    "nvidia-tesla-a100": "NVIDIA_A100_GPUS",
    "nvidia-a100-80gb": "NVIDIA_A100_80GB_GPUS",
    "nvidia-h100-80gb": "NVIDIA_H100_GPUS",
    "nvidia-h100-mega-80gb": "NVIDIA_H100_MEGA_GPUS",
}

# Machine series whose vCPUs count against the regional CPUS quota. Every other series has a vCPU
# quota of its own, <SERIES>_CPUS (G2 machine types: G2_CPUS; N2: N2_CPUS). docs/decisions.md,
# "Preflight: the quotas a cluster draws on", cites Google's pages.
SHARED_CPU_QUOTA_SERIES = ("e2", "n1", "f1", "g1")
# pd-balanced (dtrain's boot disks) and pd-ssd count against SSD_TOTAL_GB; pd-standard against
# DISKS_TOTAL_GB (same decision).
DISK_QUOTA = {"pd-balanced": "SSD_TOTAL_GB", "pd-ssd": "SSD_TOTAL_GB", "pd-standard": "DISKS_TOTAL_GB"}


@dataclasses.dataclass(frozen=True)
class QuotaCheck:
    """One quota compared with what the cluster needs. `scope` is a region or "global"."""

    metric: str
    scope: str
    limit: float
    usage: float
    needed: int

    @property
    def ok(self) -> bool:
        return self.usage + self.needed <= self.limit

    def problem(self, project: str) -> str:
        where = f"in {self.scope}" if self.scope != "global" else "for all regions"
        return (
            f"request {self.metric} >= {_num(self.usage + self.needed)} {where} (limit {_num(self.limit)}, "
            f"in use {_num(self.usage)}, this cluster needs {self.needed}): {QUOTA_PAGE.format(project=project)}"
        )

    def describe(self) -> str:
        return f"{self.metric} ({self.scope}): {_num(self.usage)}/{_num(self.limit)} used, needs {self.needed}"


@dataclasses.dataclass
class PreflightReport:
    """What `preflight` checked and found. `zones` is where to try the cluster, best first."""

    project: str
    region: str
    zone: str
    accelerator: str | None
    quotas: list[QuotaCheck] = dataclasses.field(default_factory=list)
    zones: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    passed: list[str] = dataclasses.field(default_factory=list)  # other checks that passed, one line each
    config_problems: list[str] = dataclasses.field(default_factory=list)  # of `problems`: fixed in the config

    @property
    def ok(self) -> bool:
        return not self.problems

    def checked(self) -> list[str]:
        """One line per check, for display."""
        lines = [q.describe() for q in self.quotas]
        if self.accelerator:
            offered = ", ".join(self.zones) or "none"
            lines.append(f"{self.accelerator} offered in {self.region}: {offered}")
        return lines + self.passed + self.notes


def disabled_services(gcp: Gcp, services: Iterable[str]) -> list[str]:
    """Which of `services` are not enabled in the project, in their order: one Service Usage call
    (services.batchGet, at most 30 names; gcloud passes the project id as the parent too)."""
    wanted = list(services)
    names = [f"projects/{gcp.project}/services/{s}" for s in wanted]
    with gcp.errors("checking which APIs the project has enabled"):
        body = gcp.rest("serviceusage", "GET", f"/v1/projects/{gcp.project}/services:batchGet", params={"names": names})
    # The answer names the project by number: match on the service's own name.
    state = {item.get("name", "").rsplit("/", 1)[-1]: item.get("state") for item in body.get("services", [])}
    return [s for s in wanted if state.get(s) != "ENABLED"]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def preflight(
    gcp: Gcp,
    region: str,
    zone: str | None,
    accelerator: str | None,
    gpus_total: int,
    cpus_total: int,
    spot: bool,
    instances: int,
    *,
    gpus_per_instance: int | None = None,
    machine_family: str = "n1",
    disk_gb_total: int = 0,
    disk_type: str = "pd-balanced",
    external_ips: bool = True,
    on_demand_instances: int = 0,
) -> PreflightReport:
    """Check, before `terraform apply`, that the cluster fits: the regional GPU, vCPU (the quota of
    `machine_family`), disk (`disk_type`'s), address (one per node with `external_ips`) and instance
    quotas, GPUS_ALL_REGIONS, that `zone` is in `region` and offers `accelerator` (with at least
    `gpus_per_instance` cards per VM; default: gpus_total spread over `instances`), and which zones
    of the region offer it (report.zones, `zone` first when it qualifies), so that `up` can move on
    to the next one on ZONE_RESOURCE_POOL_EXHAUSTED. Without a `zone`, report.zone is the first zone
    of the region's listing that qualifies (zone names differ between regions: us-east1 has no -a).

    Spot VMs draw on PREEMPTIBLE_* quota where the project has been granted it in the region (a
    limit above 0), and on the standard quota otherwise (Compute Engine's documented rule);
    GPUS_ALL_REGIONS counts every GPU, spot or not. With `spot`, `on_demand_instances` of the
    `instances` are standard VMs all the same (the master, unless master_spot): their share of the
    vCPUs and GPUs is checked against the standard quota. Four or five API calls; no resource is
    created.
    """
    if not REGION_RE.fullmatch(region):
        raise UserError(f"region {region!r} is not a Compute Engine region name (like us-central1)")
    report = PreflightReport(project=gcp.project, region=region, zone=zone or "", accelerator=accelerator)
    with gcp.errors(f"reading quotas of region {region}"):
        region_res = gcp.compute("RegionsClient").get(project=gcp.project, region=region, **gcp.rpc())
    regional = {q.metric: q for q in region_res.quotas}

    def check(metric: str, needed: int, quotas: dict[str, Any], scope: str) -> None:
        if needed <= 0:
            return
        q = quotas.get(metric)
        limit, usage = (q.limit, q.usage) if q is not None else (0.0, 0.0)
        if q is None:
            report.notes.append(f"{metric} is not listed for {scope}: taken as limit 0")
        result = QuotaCheck(metric=metric, scope=scope, limit=limit, usage=usage, needed=needed)
        report.quotas.append(result)
        if not result.ok:
            report.problems.append(result.problem(gcp.project))

    def spot_metric(metric: str) -> str:
        pre = regional.get(f"PREEMPTIBLE_{metric}")
        if spot and pre is not None and pre.limit > 0:
            return pre.metric
        if spot:
            report.notes.append(f"no PREEMPTIBLE_{metric} quota granted in {region}: spot VMs use {metric}")
        return metric

    def check_split(metric: str, needed: int) -> None:
        """`needed` over every instance: the Spot ones' share on the Spot metric, the rest on `metric`."""
        chosen = spot_metric(metric)
        on_demand = needed // max(instances, 1) * on_demand_instances if spot else 0
        if chosen == metric or not on_demand:
            check(chosen, needed, regional, region)
            return
        check(chosen, needed - on_demand, regional, region)
        check(metric, on_demand, regional, region)

    def check_listed(metric: str, needed: int, what: str, spot_variant: bool = False) -> None:
        # A series' own quota that the region does not list is not taken as limit 0: that would refuse
        # a cluster on a guess. It is said, and not checked.
        if metric in regional:
            if spot_variant:
                check_split(metric, needed)
            else:
                check(metric, needed, regional, region)
        elif needed > 0:
            report.notes.append(f"{metric} is not listed for {region}: {what} quota not checked")

    cpu_metric = "CPUS" if machine_family in SHARED_CPU_QUOTA_SERIES else f"{machine_family.upper()}_CPUS"
    check_listed(cpu_metric, cpus_total, "vCPU", spot_variant=True)
    check("INSTANCES", instances, regional, region)
    if external_ips:
        check("IN_USE_ADDRESSES", instances, regional, region)  # one external IP per node
    check_listed(DISK_QUOTA[disk_type], disk_gb_total, "boot disk")
    if accelerator and gpus_total > 0:
        metric = ACCELERATOR_QUOTA.get(accelerator)
        if metric is None:
            report.notes.append(f"no known quota metric for {accelerator}: regional GPU quota not checked")
        else:
            check_split(metric, gpus_total)
        with gcp.errors("reading the project's quotas"):
            project_res = gcp.compute("ProjectsClient").get(project=gcp.project, **gcp.rpc())
        check("GPUS_ALL_REGIONS", gpus_total, {q.metric: q for q in project_res.quotas}, "global")

    up_zones = region_zones(gcp, region)
    if zone is not None and zone not in up_zones:
        report.problems.append(
            f"zone {zone} is not a zone of {region} that is up (zones: {', '.join(up_zones) or 'none'}): "
            f"set zone = one of them"
        )
    if not accelerator:
        report.zones = ([zone] if zone in up_zones else []) + [z for z in up_zones if z != zone]
        if zone is None:
            report.zone = report.zones[0] if report.zones else ""
            if not report.zones:
                report.problems.append(f"no zone of {region} is up: choose another region")
        return report

    # Checked even when this run adds no GPU (an update of a cluster that is up): the zone must still
    # offer the accelerator, with as many cards per VM as the nodes carry.
    per_vm = gpus_per_instance or max(1, math.ceil(gpus_total / max(instances, 1)))
    offered = _accelerator_zones(gcp, accelerator, up_zones)  # zone -> maximumCardsPerInstance
    fits = sorted(z for z, cards in offered.items() if cards >= per_vm)
    report.zones = ([zone] if zone in fits else []) + [z for z in fits if z != zone]
    others = [z for z in report.zones if z != zone]
    if zone is None:
        report.zone = report.zones[0] if report.zones else ""
        if not fits:
            offer = f"at most {max(offered.values())} per VM there" if offered else "in none of its zones"
            report.problems.append(f"{accelerator} with {per_vm} per VM is not offered in {region} ({offer})")
    elif zone in up_zones and zone not in offered:
        alt = f"zones in {region} that offer it: {', '.join(others)}" if others else f"no zone in {region} offers it"
        report.problems.append(f"{accelerator} is not offered in {zone}; {alt}")
    elif zone in offered and offered[zone] < per_vm:
        report.problems.append(
            f"{accelerator} allows at most {offered[zone]} per VM in {zone}, the cluster asks for {per_vm}: "
            "use fewer GPUs per node and more nodes"
        )
    return report


def region_zones(gcp: Gcp, region: str) -> list[str]:
    """The zones of `region` whose status is UP, by name."""
    with gcp.errors(f"listing the zones of {region}"):
        zones = list(
            gcp.compute("ZonesClient").list(
                request={"project": gcp.project, "filter": f"name eq {region}-.*"}, **gcp.rpc()
            )
        )
    return sorted(z.name for z in zones if short_name(z.region) == region and z.status == "UP")


def _accelerator_zones(gcp: Gcp, accelerator: str, zones: Iterable[str]) -> dict[str, int]:
    """zone -> maximumCardsPerInstance for the zones (among `zones`) that offer `accelerator`:
    one aggregated listing rather than one call per zone."""
    wanted = set(zones)
    offered: dict[str, int] = {}
    with gcp.errors(f"listing where {accelerator} is offered"):
        pages = gcp.compute("AcceleratorTypesClient").aggregated_list(
            request={"project": gcp.project, "filter": f'name = "{accelerator}"'}, **gcp.rpc()
        )
        for scope, scoped in pages:
            for acc in scoped.accelerator_types:
                zone = short_name(acc.zone) or short_name(scope)
                if acc.name == accelerator and zone in wanted:
                    offered[zone] = acc.maximum_cards_per_instance or 0
    return offered
