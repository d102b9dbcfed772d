"""A gcp cluster's settings ([clusters.NAME] with backend = "gcp") and the tfvars they become.

    [clusters.demo]
    backend = "gcp"
    project = "my-project"              # default: GOOGLE_CLOUD_PROJECT, then the ADC project
    region = "us-central1"
    zone = "us-central1-a"              # default: the first zone of the region that offers the GPU
    workers = 1                         # worker VMs besides the master
    use_gpu = true
    accelerator = "nvidia-l4"           # default: infra/modules/plan/rules.json; or "nvidia-tesla-t4"
    gpus_per_node = 1
    spot = false
    master_spot = false                 # with spot = true: the master is Spot too (default: on-demand)
    stall_after = "30m"                 # a running Slurm job whose metrics have not advanced this long is stalled
    ssh_source_ranges = ["203.0.113.7/32"]   # who may SSH in (required, unless external_ip = false: IAP only)
    external_ip = true                  # false: internal IPs only, SSH through IAP (needs gcloud)
    os_login = "auto"                   # true / false; auto: as the organisation's policy requires
    autostop = "60m"                    # the cluster service stops an idle cluster ("off": never; docs/service.md)
    autostop_action = "stop"            # or "delete" (the bucket and Terraform's state are kept)
    capacity_wait = "2h"                # autostop fires anyway once a Spot worker waited this long for capacity

Every key, its type and default is in GCP_FIELDS below; `dtrain config show` lists the table as
written, and `dtrain up` shows what it resolved to. Derivation (which machine type carries which
GPU) and its validation live in Terraform (infra/modules/plan), not here, so that `terraform apply`
users and `dtrain up` get the same answer; this module checks only what Terraform cannot tell the
user in one line (types, names, an empty ssh_source_ranges).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.gcp import rules

PROJECT_RE = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GcpSpec:
    name: str
    project: str = ""
    region: str = "us-central1"
    zone: str = ""
    workers: int = 1
    use_gpu: bool = False  # as infra/variables.tf: new projects have no GPU quota; CPU nodes just work
    accelerator: str = dataclasses.field(default_factory=rules.default_accelerator)
    gpus_per_node: int = 1
    machine_type: str = ""
    spot: bool = False
    # The master stays on-demand when the workers are Spot: a preempted master cannot restart itself
    # or the workers (infra/'s master_spot).
    master_spot: bool = False
    disk_size_gb: int = 100
    ssh_source_ranges: tuple[str, ...] = ()
    allow_ssh_from_anywhere: bool = False
    iap_ssh: bool = True
    external_ip: bool = True  # false: no external IPs; dtrain reaches the nodes through IAP (gcloud)
    # "auto": OS Login where the organisation enforces constraints/compute.requireOsLogin, else the
    # cluster's key in instance metadata; true / false: always / never OS Login.
    os_login: bool | str = "auto"
    bucket: str = ""
    bucket_lifecycle_days: int = 7
    force_destroy: bool = False
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ssh_user: str = "dtrain"
    state_bucket: str = ""
    ready_timeout: int = 900  # seconds `dtrain up` waits for every node to be ready
    image: str = ""  # training image (container mode); default: the last `dtrain build --cluster NAME`
    # A running job whose metrics have not advanced for this long is stalled ("30m", "2h", "90s").
    stall_after: str = "30m"
    # The cluster service (docs/service.md): stop the cluster after this long idle ("30m", "90s", "2h";
    # "off" or "0": never); "stop" keeps the disks, "delete" deletes the VMs (bucket and state kept).
    autostop: str = "60m"
    autostop_action: str = "stop"
    # While a Spot worker waits for capacity its jobs cannot run, but the on-demand master bills: autostop
    # fires anyway after this long ("2h"; "off": wait for ever). A running job or a login still keeps it up.
    capacity_wait: str = "2h"
    # Launcher keys shared with hosts clusters
    rdzv_port: int = 29400
    rdzv_timeout: int = 120
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def nodes(self) -> int:
        return 1 + self.workers

    def node_spot(self, role: str) -> bool:
        """Whether a node of this role ("master" or "worker") is a Spot VM (infra/modules/plan's role_spot)."""
        return self.spot and (role != "master" or self.master_spot)

    def bucket_name(self, project: str) -> str:
        return self.bucket or f"{project}-dtrain-{self.name}"

    def state_bucket_name(self, project: str) -> str:
        return self.state_bucket or f"{project}-dtrain-tfstate"


GCP_FIELDS = {f.name: f for f in dataclasses.fields(GcpSpec) if f.name != "name"}
GCP_KEYS = set(GCP_FIELDS) | {"backend"}
_TYPES = typing.get_type_hints(GcpSpec)


def autostop_seconds(text: str | int, where: str = "autostop", key: str = "autostop") -> float | None:
    """The `autostop` key in seconds: a duration as every cluster-table duration is written ("30m", "90s",
    "2h", "1h30m", or seconds: dtrain.control.cluster.duration); None for "off" or 0 (never). The one
    reading of it: for `dtrain up` (the table) and for the cluster service (its config on the master)."""
    from dtrain.control.cluster import duration

    value = text if isinstance(text, int) else str(text).strip().lower()
    if value in ("off", "0", 0):
        return None
    return duration(value, key, where)


def gcp_spec(name: str, spec: Mapping[str, Any], where: str) -> GcpSpec:
    """Check a [clusters.NAME] table of backend gcp; one line naming the key for each mistake."""
    from dtrain.control.cluster import check_keys

    check_keys(spec, GCP_KEYS, where)
    if not rules.cluster_name_ok(name):
        raise UserError(
            f"{where}: a gcp cluster's name must be {rules.cluster_name_rule()} "
            f"(it prefixes VM and network names), got {name!r}"
        )
    values: dict[str, Any] = {}
    for key, raw in spec.items():
        if key == "backend":
            continue
        values[key] = _typed(key, raw, where)
    s = GcpSpec(name=name, **values)
    _check(s, where)
    return s


def _typed(key: str, raw: Any, where: str) -> Any:
    tp = _TYPES[key]
    if key == "os_login":
        if raw is True or raw is False or raw == "auto":
            return raw
        raise UserError(f'{where}: os_login must be true, false or "auto", got {raw!r}')
    origin = typing.get_origin(tp)
    if origin is tuple:
        if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
            raise UserError(f"{where}: {key} must be a list of strings, got {raw!r}")
        return tuple(raw)
    if tp is Mapping[str, str] or origin in (Mapping, dict):
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise UserError(f'{where}: {key} must be a table of name = "value", got {raw!r}')
        return dict(raw)
    if tp is bool:
        if not isinstance(raw, bool):
            raise UserError(f"{where}: {key} must be true or false, got {raw!r}")
        return raw
    if tp is int:
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise UserError(f"{where}: {key} must be an integer, got {raw!r}")
        return raw
    if not isinstance(raw, str):
        raise UserError(f"{where}: {key} must be a string, got {raw!r}")
    return raw


def _check(s: GcpSpec, where: str) -> None:
    if s.project and not PROJECT_RE.match(s.project):
        raise UserError(f"{where}: project {s.project!r} is not a project id (6-30 lowercase letters, digits, '-')")
    if not REGION_RE.match(s.region):
        raise UserError(f"{where}: region {s.region!r} is not a region name like us-central1")
    if s.zone and (not ZONE_RE.match(s.zone) or not s.zone.startswith(s.region + "-")):
        raise UserError(f"{where}: zone {s.zone!r} is not a zone of region {s.region} (like {s.region}-a)")
    if s.autostop_action not in ("stop", "delete"):
        raise UserError(f'{where}: autostop_action must be "stop" or "delete", got {s.autostop_action!r}')
    autostop_seconds(s.autostop, where)
    autostop_seconds(s.capacity_wait, where, "capacity_wait")
    lo, hi = rules.limits("worker_count")
    if not lo <= s.workers <= hi:
        raise UserError(f"{where}: workers must be {lo}-{hi}, got {s.workers}")
    refused = rules.refused_accelerator(s.accelerator)
    if refused:
        raise UserError(f"{where}: accelerator {s.accelerator} is refused: {refused}")
    if s.accelerator not in rules.accelerators():
        known = ", ".join(rules.accelerators())
        raise UserError(f"{where}: accelerator must be one of {known}, got {s.accelerator!r}")
    if s.use_gpu and s.gpus_per_node < 1:
        raise UserError(f"{where}: gpus_per_node must be >= 1 with use_gpu = true, got {s.gpus_per_node}")
    lo, hi = rules.limits("disk_size_gb")
    if not lo <= s.disk_size_gb <= hi:
        raise UserError(f"{where}: disk_size_gb must be {lo}-{hi}, got {s.disk_size_gb}")
    for cidr in s.ssh_source_ranges:
        try:
            net = ipaddress.ip_network(cidr, strict=True)
        except ValueError as e:
            raise UserError(f"{where}: ssh_source_ranges: {cidr!r} is not a CIDR range ({e})") from None
        if net.prefixlen == 0 and not s.allow_ssh_from_anywhere:
            raise UserError(
                f"{where}: ssh_source_ranges contains {cidr}, which opens SSH to the whole internet: "
                'list your own address (e.g. "203.0.113.7/32"), or set allow_ssh_from_anywhere = true'
            )
    if not s.external_ip and not s.iap_ssh:
        raise UserError(
            f"{where}: external_ip = false needs iap_ssh = true: without external IPs dtrain reaches the nodes "
            "through IAP TCP forwarding, which the firewall must admit"
        )
    if s.bucket_lifecycle_days < 1:
        raise UserError(f"{where}: bucket_lifecycle_days must be >= 1, got {s.bucket_lifecycle_days}")
    for k, v in s.labels.items():
        if not LABEL_RE.match(k) or not LABEL_VALUE_RE.match(v):
            raise UserError(f"{where}: label {k} = {v!r}: keys and values must be lowercase letters, digits, _ or -")
    if "dtrain-cluster" in s.labels:
        raise UserError(f"{where}: the label dtrain-cluster is set by dtrain (to the cluster's name)")
    if not 1 <= s.rdzv_port <= 65535:
        raise UserError(f"{where}: rdzv_port must be 1-65535, got {s.rdzv_port}")
    from dtrain.control.cluster import duration

    duration(s.stall_after, "stall_after", where)
    if s.ready_timeout < 60:
        raise UserError(f"{where}: ready_timeout must be at least 60 seconds, got {s.ready_timeout}")


def tfvars(
    s: GcpSpec,
    *,
    project: str,
    zone: str,
    ssh_public_key: str,
    adopt_bucket: bool = False,
    os_login: bool = False,
) -> dict[str, Any]:
    """The variables of infra/ for this cluster (the names are infra/variables.tf's). `adopt_bucket`:
    the checkpoint bucket exists (a `dtrain down` kept it) and Terraform imports it. `os_login`: the
    nodes take logins through OS Login (preflight decided, from `s.os_login` and the organisation's
    policy)."""
    # Without external IPs dtrain reaches the nodes only through IAP (_check: external_ip = false needs
    # iap_ssh), whose range the plan module adds itself: no range of the user's is needed then.
    if not s.ssh_source_ranges and not s.allow_ssh_from_anywhere and s.external_ip:
        raise UserError(
            f"[clusters.{s.name}]: set ssh_source_ranges to the addresses you SSH from, e.g. "
            'ssh_source_ranges = ["203.0.113.7/32"] (your public address: curl -s https://checkip.amazonaws.com), '
            "or set external_ip = false to reach the nodes through IAP only"
        )
    return {
        "project_id": project,
        "region": s.region,
        "zone": zone,
        "cluster_name": s.name,
        "worker_count": s.workers,
        "use_gpu": s.use_gpu,
        "accelerator_type": s.accelerator,
        "gpus_per_node": s.gpus_per_node,
        "machine_type": s.machine_type,
        "spot": s.spot,
        "master_spot": s.master_spot,
        "disk_size_gb": s.disk_size_gb,
        "ssh_source_ranges": list(s.ssh_source_ranges) or (["0.0.0.0/0"] if s.external_ip else []),
        "allow_ssh_from_anywhere": s.allow_ssh_from_anywhere,
        "iap_ssh": s.iap_ssh,
        "external_ip": s.external_ip,
        "bucket_name": s.bucket_name(project),
        "bucket_lifecycle_days": s.bucket_lifecycle_days,
        "force_destroy": s.force_destroy,
        "labels": dict(s.labels),
        "ssh_user": s.ssh_user,
        "ssh_public_key": ssh_public_key,
        "adopt_bucket": adopt_bucket,
        "os_login": os_login,
    }


def write_tfvars(values: Mapping[str, Any], path: Path) -> Path:
    """JSON tfvars (Terraform reads *.tfvars.json): no quoting rules of our own to get wrong."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_text(json.dumps(dict(values), indent=2, sort_keys=True) + "\n")
    return path
