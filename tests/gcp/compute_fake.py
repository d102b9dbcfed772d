"""A small, stateful Compute Engine v1 REST server for tests of dtrain.control.gcp.

It speaks the paths and JSON shapes google-cloud-compute's REST transport uses (the `uri` entries
of each service's transports/rest_base.py), keeps a world the tests build (quotas, zones,
accelerator types, instances, disks, addresses, networks, subnetworks, routers, firewalls, operations) and
really does what the API does with it:

  - lists filter (`field = "v"`, `!=`, `eq regex`, `ne regex`, joined by AND or as `(a) (b)`,
    nested fields like `labels.dtrain-cluster`) and page (`maxResults`/`pageToken`; the default
    page is small so the client's pager has to follow `nextPageToken`);
  - aggregated lists group by `zones/<z>` / `regions/<r>` like the API;
  - a DELETE answers with a RUNNING operation; the resource goes when the operation finishes,
    after `polls_to_finish` polls (operations get or wait); deleting a VM deletes its auto-delete
    disks; deleting a network, subnetwork or disk that something still uses is refused with the
    API's 400 resourceInUseByAnotherResource; unknown resources are 404 with the API's message;
  - faults the tests inject answer with Compute's error JSON (403 SERVICE_DISABLED, permission
    denied, ...);
  - instances.start/stop go through operations (RUNNING <-> TERMINATED); a start can be refused as Compute
    refuses it (the operation ends with ZONE_RESOURCE_POOL_EXHAUSTED, ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS
    or QUOTA_EXCEEDED) and calls the test's `on_start` hook once done; starting a RUNNING VM changes
    nothing; `mark_preempted` makes a confirmed preemption; `fail_status_once` makes the next instances
    list/get a 500;
  - every request is recorded (method, path, query) for assertions.

The same server also answers the other Google REST APIs dtrain calls (given to dtrain as
DTRAIN_GCP_API_ENDPOINT; their paths do not collide), from the same world:

  - Service Usage services.batchGet (which APIs are enabled: all but `disabled_services`);
  - Resource Manager v1 projects.getEffectiveOrgPolicy (`org_policies`, v1 JSON by constraint) and
    projects.testIamPermissions (the asked permissions the caller holds: by member, from `grants`, the
    caller being `identity`; `granted` for a member not in it, all when it is None);
  - OS Login v1 users.importSshPublicKey / users.getLoginProfile / users.sshPublicKeys.delete, one
    profile per e-mail with a POSIX username derived from it as Google does (dev@example.com ->
    dev_example_com) and keys by SHA-256 fingerprint;
  - OpenID Connect userinfo (`identity`, the e-mail of whoever calls);
  - IAM v1 projects.roles create / get / delete / undelete with Google's soft delete: a deleted custom role
    can be undeleted for ROLE_UNDELETE_DAYS, and its id is refused by a create for ROLE_ID_HELD_DAYS after
    the delete (7 + 30 days until it is purged); `days_passed` moves the fake's clock on.

Self links use https://www.googleapis.com/compute/v1 as the real API does, whatever the endpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

GOOGLEAPIS = "https://www.googleapis.com/compute/v1"
DEFAULT_TIME = "2025-01-01T00:00:00.000-08:00"
# How a start operation ends when it is refused (refuse_starts): the operation's error code -> (message,
# httpErrorStatusCode, httpErrorMessage). A stockout is ZONE_RESOURCE_POOL_EXHAUSTED or, as Compute also
# answers, ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS with the resource type in the message
# (https://cloud.google.com/compute/docs/troubleshooting/troubleshooting-resource-availability); a start
# refused for quota (another VM took the freed preemptible quota) is QUOTA_EXCEEDED, HTTP 403.
ZONE_EXHAUSTED = (
    "The zone 'projects/{project}/zones/{zone}' does not have enough resources available to fulfill the "
    "request.  Try a different zone, or try again later."
)
START_REFUSALS = {
    "ZONE_RESOURCE_POOL_EXHAUSTED": (ZONE_EXHAUSTED, 503, "SERVICE UNAVAILABLE"),
    "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS": (
        "The zone 'projects/{project}/zones/{zone}' does not have enough resources available to fulfill the "
        "request. '(resource type:compute)'.",
        503,
        "SERVICE UNAVAILABLE",
    ),
    "QUOTA_EXCEEDED": ("Quota 'PREEMPTIBLE_CPUS' exceeded.  Limit: 8.0 in region {region}.", 403, "FORBIDDEN"),
}


# ----------------------------------------------------------------------------------------------
# Error bodies, as Compute writes them


# IAM's custom-role soft delete (cloud.google.com/iam/docs/creating-custom-roles, "Deleting a custom role";
# projects.roles.delete): undelete works for 7 days; the role is then purged over 30 days, and its id cannot
# be used for a new role until 37 days after the delete.
DAY_S = 86400.0
ROLE_UNDELETE_DAYS = 7
ROLE_ID_HELD_DAYS = 37
ROLE_ID_RE = re.compile(r"[a-zA-Z0-9_.]{3,64}")


def error_body(code: int, message: str, reason: str, status: str, details: list | None = None) -> dict:
    body: dict[str, Any] = {
        "error": {
            "code": code,
            "message": message,
            "errors": [{"message": message, "domain": "global", "reason": reason}],
            "status": status,
        }
    }
    if details:
        body["error"]["details"] = details
    return body


def service_disabled(
    project: str, project_number: str = "123456789012", service: str = "compute.googleapis.com", title: str = ""
) -> dict:
    title = title or {"compute.googleapis.com": "Compute Engine API"}.get(service, service)
    message = (
        f"{title} has not been used in project {project_number} before or it is disabled. "
        f"Enable it by visiting https://console.developers.google.com/apis/api/{service}/"
        f"overview?project={project_number} then retry. If you enabled this API recently, wait a few "
        "minutes for the action to propagate to our systems and retry."
    )
    body = error_body(
        403,
        message,
        "accessNotConfigured",
        "PERMISSION_DENIED",
        details=[
            {
                "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                "reason": "SERVICE_DISABLED",
                "domain": "googleapis.com",
                "metadata": {"service": service, "consumer": f"projects/{project_number}"},
            },
            {
                "@type": "type.googleapis.com/google.rpc.Help",
                "links": [{"description": "Google developers console API activation", "url": "https://..."}],
            },
        ],
    )
    body["error"]["errors"][0]["domain"] = "usageLimits"
    return body


def permission_denied(permission: str, resource: str) -> dict:
    return error_body(403, f"Required '{permission}' permission for '{resource}'", "forbidden", "PERMISSION_DENIED")


def not_found(resource: str) -> dict:
    return error_body(404, f"The resource '{resource}' was not found", "notFound", "NOT_FOUND")


def in_use(resource: str, user: str) -> dict:
    return error_body(
        400,
        f"The {resource.split('/')[-2].rstrip('s')} resource '{resource}' is already being used by '{user}'",
        "resourceInUseByAnotherResource",
        "FAILED_PRECONDITION",
    )


@dataclasses.dataclass(frozen=True)
class Grant:
    """What one member holds on the project: exactly `only` (when not None), else every permission but
    `but` (a member whose roles lack a few permissions, as an Editor lacks the IAM-admin ones)."""

    only: frozenset[str] | None = None
    but: frozenset[str] = frozenset()

    def holds(self, permission: str) -> bool:
        return permission in self.only if self.only is not None else permission not in self.but


@dataclasses.dataclass
class Fault:
    """Answer requests matching `method` and `path` (a regex searched in the path) with `body`,
    `times` times (None: always)."""

    method: str
    path: str
    body: dict
    times: int | None = None


class HttpError(Exception):
    def __init__(self, body: dict) -> None:
        super().__init__(body["error"]["message"])
        self.body = body


# ----------------------------------------------------------------------------------------------
# Filters


_TERM = re.compile(
    r"""\s*(?P<field>[A-Za-z][\w.-]*)\s*(?P<op>!=|=|\seq\s|\sne\s)\s*(?P<value>"[^"]*"|'[^']*'|[^\s()"']+)\s*"""
)


def parse_filter(text: str) -> list[tuple[str, str, str]]:
    """A Compute list filter as (field, op, value) terms that must all hold."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("("):
        parts = re.findall(r"\(([^()]*)\)", text)
        if "".join(f"({p})" for p in parts).replace(" ", "") != text.replace(" ", ""):
            raise HttpError(_bad_filter(text))
    else:
        parts = re.split(r"\s+AND\s+", text)
    terms = []
    for part in parts:
        m = _TERM.fullmatch(part)
        if not m:
            raise HttpError(_bad_filter(text))
        value = m["value"]
        if value[:1] in "\"'":
            value = value[1:-1]
        terms.append((m["field"], m["op"].strip(), value))
    return terms


def _bad_filter(text: str) -> dict:
    return error_body(
        400,
        f"Invalid value for field 'filter': '{text}'. Invalid list filter expression.",
        "invalid",
        "INVALID_ARGUMENT",
    )


def matches(resource: dict, terms: list[tuple[str, str, str]]) -> bool:
    for field, op, value in terms:
        cur: Any = resource
        for key in field.split("."):
            cur = cur.get(key) if isinstance(cur, dict) else None
        text = "" if cur is None else (str(cur).lower() if isinstance(cur, bool) else str(cur))
        if op == "=" and not (cur is not None and text == value):
            return False
        if op == "!=" and cur is not None and text == value:
            return False
        if op == "eq" and not (cur is not None and re.fullmatch(value, text)):
            return False
        if op == "ne" and cur is not None and re.fullmatch(value, text):
            return False
    return True


# ----------------------------------------------------------------------------------------------
# The world


def now_rfc3339() -> str:
    """The time now as Compute writes it."""
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


class ComputeWorld:
    """The state the server answers from. Build it with the helpers, then `serve()`."""

    def __init__(self, project: str = "dtrain-test") -> None:
        self.project = project
        self.lock = threading.RLock()
        self.project_quotas: dict[str, list[float]] = {}  # metric -> [limit, usage]
        self.regions: dict[str, dict] = {}  # name -> {"quotas": {metric: [limit, usage]}, "status"}
        self.zones: dict[str, dict] = {}  # name -> {"region", "status"}
        self.accelerators: dict[str, dict[str, int]] = {}  # zone -> {type: maximumCardsPerInstance}
        self.instances: dict[tuple[str, str], dict] = {}  # (zone, name)
        self.disks: dict[tuple[str, str], dict] = {}  # (zone, name)
        self.addresses: dict[tuple[str, str], dict] = {}  # (region, name)
        self.subnetworks: dict[tuple[str, str], dict] = {}  # (region, name)
        self.routers: dict[tuple[str, str], dict] = {}  # (region, name)
        self.networks: dict[str, dict] = {}
        self.firewalls: dict[str, dict] = {}
        self.operations: dict[tuple[str, str], dict] = {}  # (scope path, name) -> op state
        self.op_failures: dict[tuple[str, str], str] = {}  # (kind, name) -> message: the delete op fails
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        self.page_size = 2
        self.polls_to_finish = 2
        self._ids = itertools.count(1000)
        # The other Google APIs (see the module docstring).
        self.project_number = "123456789012"
        self.disabled_services: set[str] = set()
        self.org_policies: dict[str, dict] = {}  # "constraints/compute.requireOsLogin" -> v1 Policy JSON
        # testIamPermissions answers by member: the caller is `identity` (whom userinfo names too), and
        # `grants` says what each member holds (see holds); a member not in it holds `granted` (None: all).
        self.granted: set[str] | None = None
        self.grants: dict[str, Grant] = {}
        self.identity = "dev@example.com"
        self.os_login: dict[str, dict] = {}  # e-mail -> {"username", "keys": {fingerprint: key}}
        # instances.start/stop (see start_instance): refusals left per instance name (None: every one),
        # and what the test does when an instance starts (revive its test-bed host).
        self.start_refusals: dict[str | None, int] = {}
        self.refusal_code = "ZONE_RESOURCE_POOL_EXHAUSTED"  # how refused starts end (START_REFUSALS)
        self.on_start: Any = None  # fn(zone, name), called in a thread of its own once the start is done
        self.on_stop: Any = None  # fn(zone, name), the same once a stop is done (the test crashes the host)
        self.status_failures = 0  # instances list/get answered with a 500 this many times
        self.roles: dict[str, dict] = {}  # custom role id -> Role JSON (+ "_deleted_at": fake-clock seconds)
        self.days_passed = 0.0  # added to the fake's clock (IAM's soft-delete windows)

    def now(self) -> float:
        return time.time() + self.days_passed * DAY_S

    # -- links

    def link(self, *parts: str) -> str:
        return "/".join([GOOGLEAPIS, "projects", self.project, *parts])

    # -- building

    def add_region(self, region: str, zones: list[str], status: str = "UP") -> None:
        self.regions.setdefault(region, {"quotas": {}, "status": status})
        for z in zones:
            self.zones[z] = {"region": region, "status": "UP"}

    def set_quota(self, metric: str, limit: float, usage: float = 0, region: str | None = None) -> None:
        target = self.regions[region]["quotas"] if region else self.project_quotas
        target[metric] = [float(limit), float(usage)]

    def offer(self, zone: str, accelerator: str, max_cards: int = 8) -> None:
        self.accelerators.setdefault(zone, {})[accelerator] = max_cards

    def add_network(self, name: str, description: str = "") -> dict:
        net = {
            "kind": "compute#network",
            "id": str(next(self._ids)),
            "name": name,
            "description": description,
            "selfLink": self.link("global", "networks", name),
            "autoCreateSubnetworks": False,
            "creationTimestamp": DEFAULT_TIME,
            "subnetworks": [],
        }
        self.networks[name] = net
        return net

    def add_subnetwork(self, region: str, name: str, network: str, description: str = "") -> dict:
        sub = {
            "kind": "compute#subnetwork",
            "id": str(next(self._ids)),
            "name": name,
            "description": description,
            "network": self.link("global", "networks", network),
            "region": self.link("regions", region),
            "ipCidrRange": "10.0.0.0/24",
            "selfLink": self.link("regions", region, "subnetworks", name),
            "creationTimestamp": DEFAULT_TIME,
        }
        self.subnetworks[(region, name)] = sub
        if network in self.networks:
            self.networks[network]["subnetworks"].append(sub["selfLink"])
        return sub

    def add_router(self, region: str, name: str, network: str, nat_subnetworks: list[str] = ()) -> dict:
        """A Cloud Router with one NAT over `nat_subnetworks` (names in `region`)."""
        router = {
            "kind": "compute#router",
            "id": str(next(self._ids)),
            "name": name,
            "network": self.link("global", "networks", network),
            "region": self.link("regions", region),
            "selfLink": self.link("regions", region, "routers", name),
            "creationTimestamp": DEFAULT_TIME,
        }
        if nat_subnetworks:
            router["nats"] = [
                {
                    "name": name,
                    "sourceSubnetworkIpRangesToNat": "LIST_OF_SUBNETWORKS",
                    "subnetworks": [
                        {
                            "name": self.link("regions", region, "subnetworks", s),
                            "sourceIpRangesToNat": ["ALL_IP_RANGES"],
                        }
                        for s in nat_subnetworks
                    ],
                }
            ]
        self.routers[(region, name)] = router
        return router

    def add_firewall(self, name: str, network: str, description: str = "") -> dict:
        fw = {
            "kind": "compute#firewall",
            "id": str(next(self._ids)),
            "name": name,
            "description": description,
            "network": self.link("global", "networks", network),
            "direction": "INGRESS",
            "priority": 1000,
            "sourceRanges": ["0.0.0.0/0"],
            "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}],
            "selfLink": self.link("global", "firewalls", name),
            "creationTimestamp": DEFAULT_TIME,
        }
        self.firewalls[name] = fw
        return fw

    def add_disk(self, zone: str, name: str, labels: dict[str, str] | None = None, size_gb: int = 100) -> dict:
        disk = {
            "kind": "compute#disk",
            "id": str(next(self._ids)),
            "name": name,
            "labels": labels or {},
            "sizeGb": str(size_gb),
            "zone": self.link("zones", zone),
            "status": "READY",
            "selfLink": self.link("zones", zone, "disks", name),
            "creationTimestamp": DEFAULT_TIME,
        }
        self.disks[(zone, name)] = disk
        return disk

    def add_address(self, region: str, name: str, labels: dict[str, str] | None = None, address: str = "") -> dict:
        addr = {
            "kind": "compute#address",
            "id": str(next(self._ids)),
            "name": name,
            "labels": labels or {},
            "address": address or f"34.1.0.{len(self.addresses) + 10}",
            "addressType": "EXTERNAL",
            "status": "RESERVED",
            "region": self.link("regions", region),
            "selfLink": self.link("regions", region, "addresses", name),
            "creationTimestamp": DEFAULT_TIME,
        }
        self.addresses[(region, name)] = addr
        return addr

    def add_instance(
        self,
        zone: str,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        status: str = "RUNNING",
        machine_type: str = "g2-standard-8",
        accelerator: str | None = None,
        gpus: int = 0,
        spot: bool = False,
        network: str = "default",
        subnetwork: str | None = None,
        internal_ip: str = "10.0.0.2",
        external_ip: str | None = None,
        created: str = DEFAULT_TIME,
        last_start: str | None = DEFAULT_TIME,
        boot_disk: bool = True,
        extra_disks: list[str] = (),
    ) -> dict:
        region = self.zones[zone]["region"]
        link = self.link("zones", zone, "instances", name)
        nic: dict[str, Any] = {
            "name": "nic0",
            "network": self.link("global", "networks", network),
            "networkIP": internal_ip,
        }
        if subnetwork:
            nic["subnetwork"] = self.link("regions", region, "subnetworks", subnetwork)
        if external_ip:
            nic["accessConfigs"] = [{"type": "ONE_TO_ONE_NAT", "name": "External NAT", "natIP": external_ip}]
        disks = []
        if boot_disk:
            disk = self.add_disk(zone, name, labels)
            disk["users"] = [link]
            disks.append(
                {"boot": True, "autoDelete": True, "source": disk["selfLink"], "deviceName": "persistent-disk-0"}
            )
        for extra in extra_disks:
            disk = self.disks[(zone, extra)]
            disk.setdefault("users", []).append(link)
            disks.append({"boot": False, "autoDelete": False, "source": disk["selfLink"], "deviceName": extra})
        scheduling: dict[str, Any] = {
            "provisioningModel": "STANDARD",
            "preemptible": False,
            "automaticRestart": True,
            "onHostMaintenance": "MIGRATE",
        }
        if spot:
            scheduling = {
                "provisioningModel": "SPOT",
                "preemptible": True,
                "automaticRestart": False,
                "onHostMaintenance": "TERMINATE",
                "instanceTerminationAction": "STOP",
            }
        inst = {
            "kind": "compute#instance",
            "id": str(next(self._ids)),
            "name": name,
            "zone": self.link("zones", zone),
            "machineType": self.link("zones", zone, "machineTypes", machine_type),
            "status": status,
            "labels": labels or {},
            "scheduling": scheduling,
            "networkInterfaces": [nic],
            "disks": disks,
            "creationTimestamp": created,
            "selfLink": link,
        }
        if last_start:
            inst["lastStartTimestamp"] = last_start
        if accelerator and gpus:
            inst["guestAccelerators"] = [
                {"acceleratorType": self.link("zones", zone, "acceleratorTypes", accelerator), "acceleratorCount": gpus}
            ]
        self.instances[(zone, name)] = inst
        return inst

    def insert_instance(self, zone: str, body: dict) -> dict:
        """instances.insert, from the request body the google provider would send (the fields dtrain
        reads back: name, machine type, labels, addresses, accelerators, scheduling)."""
        name = body.get("name", "")
        if (zone, name) in self.instances:
            link = self.link("zones", zone, "instances", name)
            raise HttpError(error_body(409, f"The resource '{link}' already exists", "alreadyExists", "ALREADY_EXISTS"))
        nic = (body.get("networkInterfaces") or [{}])[0]
        nat = (nic.get("accessConfigs") or [{}])[0].get("natIP")
        acc = (body.get("guestAccelerators") or [{}])[0]
        inst = self.add_instance(
            zone,
            name,
            labels=body.get("labels") or {},
            machine_type=str(body.get("machineType", "e2-medium")).rsplit("/", 1)[-1],
            accelerator=str(acc.get("acceleratorType", "")).rsplit("/", 1)[-1] or None,
            gpus=int(acc.get("acceleratorCount", 0)),
            spot=(body.get("scheduling") or {}).get("provisioningModel") == "SPOT",
            internal_ip=nic.get("networkIP", "10.0.0.2"),
            external_ip=nat,
            created=now_rfc3339(),
            last_start=now_rfc3339(),
        )
        return self._record_op(f"zones/{zone}", "insert", inst["selfLink"], now_rfc3339(), done=True, zone=zone)

    def preempt(self, zone: str, name: str, at: str) -> None:
        """What Compute Engine does to a spot VM with termination action STOP: the VM goes to
        TERMINATED and a `compute.instances.preempted` operation is recorded in the zone."""
        inst = self.instances[(zone, name)]
        inst["status"] = "TERMINATED"
        inst["lastStopTimestamp"] = at
        self._record_op(f"zones/{zone}", "compute.instances.preempted", inst["selfLink"], at, done=True, zone=zone)

    def mark_preempted(self, zone: str, name: str) -> None:
        """A spot VM preempted now (termination action STOP): TERMINATED, with its preempted operation
        timed after its last start, so dtrain sees a confirmed preemption."""
        self.preempt(zone, name, now_rfc3339())

    def refuse_starts(self, times: int, name: str | None = None, code: str = "ZONE_RESOURCE_POOL_EXHAUSTED") -> None:
        """The next `times` starts (of `name`, or of any instance) of a stopped VM end as Compute ends them
        when it refuses: the operation finishes DONE with the error `code` (START_REFUSALS: a stockout by
        default, or QUOTA_EXCEEDED)."""
        if code not in START_REFUSALS:
            raise ValueError(f"refuse_starts: no refusal {code!r} (one of {', '.join(START_REFUSALS)})")
        self.start_refusals[name] = times
        self.refusal_code = code

    def grant(self, member: str, *, only: Any = None, but: Any = ()) -> None:
        """Member ("user:a@example.com") holds exactly `only`, or every permission but `but`."""
        self.grants[member] = Grant(None if only is None else frozenset(only), frozenset(but))

    def holds(self, permission: str) -> bool:
        """Whether the caller (`identity`) holds `permission` on the project."""
        grant = self.grants.get(f"user:{self.identity}")
        if grant is not None:
            return grant.holds(permission)
        return self.granted is None or permission in self.granted

    def fail_status_once(self) -> None:
        """The next instances list or get answers 500 (a transient error of the API that the client
        library does not retry)."""
        self.status_failures += 1

    def start_instance(self, zone: str, name: str) -> dict:
        """instances.start: a RUNNING operation; when it finishes the VM is RUNNING with a new
        lastStartTimestamp (and `on_start` runs), or the operation fails (refuse_starts). Starting a VM
        that already runs changes nothing, as in Compute: the operation finishes without error, and
        neither lastStartTimestamp, a refusal nor `on_start` is spent on it."""
        inst = self._get(self.instances, (zone, name), f"zones/{zone}/instances/{name}")
        if inst["status"] == "RUNNING":
            return self._instance_op(zone, "start", inst, None, "")
        key = name if self.start_refusals.get(name) else None
        refuse = bool(self.start_refusals.get(key))
        if refuse:
            self.start_refusals[key] -= 1
        elif inst["status"] in ("TERMINATED", "STOPPED"):
            inst["status"] = "STAGING"

        code = self.refusal_code if refuse else ""

        def action() -> str | None:
            if refuse:
                message = START_REFUSALS[code][0]
                return message.format(project=self.project, zone=zone, region=self.zones[zone]["region"])
            inst["status"] = "RUNNING"
            inst["lastStartTimestamp"] = now_rfc3339()
            if self.on_start is not None:
                threading.Thread(target=self.on_start, args=(zone, name), daemon=True).start()
            return None

        return self._instance_op(zone, "start", inst, action, code)

    def stop_instance(self, zone: str, name: str) -> dict:
        """instances.stop: STOPPING at once, TERMINATED when the operation finishes (as Compute reports a
        stopped VM)."""
        inst = self._get(self.instances, (zone, name), f"zones/{zone}/instances/{name}")
        if inst["status"] == "RUNNING":
            inst["status"] = "STOPPING"

        def action() -> str | None:
            inst["status"] = "TERMINATED"
            inst["lastStopTimestamp"] = now_rfc3339()
            if self.on_stop is not None:
                threading.Thread(target=self.on_stop, args=(zone, name), daemon=True).start()
            return None

        return self._instance_op(zone, "stop", inst, action, "")

    def _instance_op(self, zone: str, op_type: str, inst: dict, action: Any, code: str) -> dict:
        scope = f"zones/{zone}"
        op = self._record_op(scope, op_type, inst["selfLink"], now_rfc3339(), done=False, action=action, zone=zone)
        self.operations[(scope, op["name"])]["code"] = code
        if self.polls_to_finish <= 0:
            return self._poll(scope, op["name"])
        return op

    def fail(self, method: str, path: str, body: dict, times: int | None = None) -> None:
        self.faults.append(Fault(method, path, body, times))

    def called(self, method: str, path_regex: str) -> int:
        return sum(1 for m, p, _ in self.requests if m == method and re.search(path_regex, p))

    # -- operations

    def _record_op(
        self,
        scope: str,
        op_type: str,
        target: str,
        at: str = DEFAULT_TIME,
        *,
        done: bool,
        zone: str | None = None,
        region: str | None = None,
        action: Any = None,
    ) -> dict:
        name = f"operation-{next(self._ids)}"
        op = {
            "kind": "compute#operation",
            "id": str(next(self._ids)),
            "name": name,
            "operationType": op_type,
            "targetLink": target,
            "status": "DONE" if done else "RUNNING",
            "progress": 100 if done else 0,
            "insertTime": at,
            "startTime": at,
            "selfLink": "/".join([GOOGLEAPIS, "projects", self.project, scope, "operations", name]),
            "user": "system",
        }
        if done:
            op["endTime"] = at
        if zone:
            op["zone"] = self.link("zones", zone)
        if region:
            op["region"] = self.link("regions", region)
        self.operations[(scope, name)] = {"op": op, "polls": 0, "action": action}
        return op

    def _poll(self, scope: str, name: str) -> dict:
        state = self.operations.get((scope, name))
        if state is None:
            raise HttpError(not_found(f"projects/{self.project}/{scope}/operations/{name}"))
        op = state["op"]
        if op["status"] != "DONE":
            state["polls"] += 1
            if state["polls"] >= self.polls_to_finish:
                failure = state["action"]() if state["action"] else None
                op.update(status="DONE", progress=100, endTime=DEFAULT_TIME)
                if failure:
                    code = state.get("code") or "RESOURCE_OPERATION_FAILED"
                    op["error"] = {"errors": [{"code": code, "message": failure}]}
                    _, status, text = START_REFUSALS.get(code, ("", 400, "BAD REQUEST"))
                    op["httpErrorStatusCode"], op["httpErrorMessage"] = status, text
        return op

    def _delete_op(self, kind: str, name: str, scope: str, target: str, remove: Any, **where: str) -> dict:
        def action() -> str | None:
            failure = self.op_failures.get((kind, name))
            if failure:
                return failure
            remove()
            return None

        op = self._record_op(scope, "delete", target, done=False, action=action, **where)
        if self.polls_to_finish <= 0:
            return self._poll(scope, op["name"])
        return op

    # -- resources: delete semantics

    def delete_instance(self, zone: str, name: str) -> dict:
        inst = self._get(self.instances, (zone, name), f"zones/{zone}/instances/{name}")
        inst["status"] = "STOPPING"

        def remove() -> None:
            self.instances.pop((zone, name), None)
            for d in inst.get("disks", []):
                key = (zone, d["source"].rsplit("/", 1)[-1])
                disk = self.disks.get(key)
                if disk is None:
                    continue
                disk["users"] = [u for u in disk.get("users", []) if u != inst["selfLink"]]
                if d.get("autoDelete"):
                    self.disks.pop(key, None)

        return self._delete_op("instance", name, f"zones/{zone}", inst["selfLink"], remove, zone=zone)

    def delete_disk(self, zone: str, name: str) -> dict:
        disk = self._get(self.disks, (zone, name), f"zones/{zone}/disks/{name}")
        if disk.get("users"):
            raise HttpError(in_use(disk["selfLink"].split("/v1/")[1], disk["users"][0].split("/v1/")[1]))
        return self._delete_op(
            "disk", name, f"zones/{zone}", disk["selfLink"], lambda: self.disks.pop((zone, name), None), zone=zone
        )

    def delete_address(self, region: str, name: str) -> dict:
        addr = self._get(self.addresses, (region, name), f"regions/{region}/addresses/{name}")
        return self._delete_op(
            "address",
            name,
            f"regions/{region}",
            addr["selfLink"],
            lambda: self.addresses.pop((region, name), None),
            region=region,
        )

    def delete_router(self, region: str, name: str) -> dict:
        router = self._get(self.routers, (region, name), f"regions/{region}/routers/{name}")
        return self._delete_op(
            "router",
            name,
            f"regions/{region}",
            router["selfLink"],
            lambda: self.routers.pop((region, name), None),
            region=region,
        )

    def delete_firewall(self, name: str) -> dict:
        fw = self._get(self.firewalls, name, f"global/firewalls/{name}")
        return self._delete_op("firewall", name, "global", fw["selfLink"], lambda: self.firewalls.pop(name, None))

    def delete_subnetwork(self, region: str, name: str) -> dict:
        sub = self._get(self.subnetworks, (region, name), f"regions/{region}/subnetworks/{name}")
        for inst in self.instances.values():
            if any(nic.get("subnetwork") == sub["selfLink"] for nic in inst["networkInterfaces"]):
                raise HttpError(in_use(sub["selfLink"].split("/v1/")[1], inst["selfLink"].split("/v1/")[1]))
        for router in self.routers.values():
            if any(s["name"] == sub["selfLink"] for nat in router.get("nats", []) for s in nat["subnetworks"]):
                raise HttpError(in_use(sub["selfLink"].split("/v1/")[1], router["selfLink"].split("/v1/")[1]))

        def remove() -> None:
            self.subnetworks.pop((region, name), None)
            net = self.networks.get(sub["network"].rsplit("/", 1)[-1])
            if net is not None:
                net["subnetworks"] = [s for s in net["subnetworks"] if s != sub["selfLink"]]

        return self._delete_op("subnetwork", name, f"regions/{region}", sub["selfLink"], remove, region=region)

    def delete_network(self, name: str) -> dict:
        net = self._get(self.networks, name, f"global/networks/{name}")
        users = [fw["selfLink"] for fw in self.firewalls.values() if fw["network"] == net["selfLink"]]
        users += [s["selfLink"] for s in self.subnetworks.values() if s["network"] == net["selfLink"]]
        users += [r["selfLink"] for r in self.routers.values() if r["network"] == net["selfLink"]]
        users += [
            i["selfLink"]
            for i in self.instances.values()
            if any(nic["network"] == net["selfLink"] for nic in i["networkInterfaces"])
        ]
        if users:
            raise HttpError(in_use(net["selfLink"].split("/v1/")[1], users[0].split("/v1/")[1]))
        return self._delete_op("network", name, "global", net["selfLink"], lambda: self.networks.pop(name, None))

    def _get(self, table: dict, key: Any, path: str) -> dict:
        res = table.get(key)
        if res is None:
            raise HttpError(not_found(f"projects/{self.project}/{path}"))
        return res

    # -- serving

    def serve(self) -> FakeComputeServer:
        return FakeComputeServer(self)


class FakeComputeServer:
    """The world on 127.0.0.1:<random port>. Use as a context manager; `.endpoint` is the URL
    to give as client_options api_endpoint."""

    def __init__(self, world: ComputeWorld) -> None:
        self.world = world
        handler = type("Handler", (_Handler,), {"world": world})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-compute", daemon=True
        )

    def __enter__(self) -> FakeComputeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def _page(items: list[dict], query: dict[str, list[str]], default_size: int) -> tuple[list[dict], str | None]:
    size = int(query.get("maxResults", [default_size])[0] or default_size)
    size = min(size, default_size)  # the server may return fewer than asked; clients must page
    start = int(query.get("pageToken", ["0"])[0] or 0)
    chunk = items[start : start + size]
    nxt = str(start + size) if start + size < len(items) else None
    return chunk, nxt


class _Handler(BaseHTTPRequestHandler):
    world: ComputeWorld
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query, keep_blank_values=True)
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            self.body = json.loads(raw) if raw else {}
        except ValueError:
            self.body = {}
        w = self.world
        with w.lock:
            w.requests.append((method, url.path, query))
            try:
                if w.status_failures and method == "GET" and re.search(r"/instances(/[^/]+)?$", url.path):
                    w.status_failures -= 1
                    raise HttpError(error_body(500, "Internal error. Please try again.", "backendError", "INTERNAL"))
                for fault in w.faults:
                    if fault.method == method and re.search(fault.path, url.path) and fault.times != 0:
                        if fault.times is not None:
                            fault.times -= 1
                        raise HttpError(fault.body)
                status, body = 200, self._route(method, url.path, query)
            except HttpError as e:
                status, body = e.body["error"]["code"], e.body
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=UTF-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str, path: str, query: dict[str, list[str]]) -> dict:
        w = self.world
        if not path.startswith("/compute/"):
            for pattern, verb, fn in _API_ROUTES:
                mm = re.fullmatch(pattern, unquote(path))
                if mm and verb == method:
                    return fn(self, query, *mm.groups())
            raise HttpError(error_body(404, f"the fake does not serve {method} {path}", "notFound", "NOT_FOUND"))
        m = re.fullmatch(r"/compute/v1/projects/([^/]+)(/.*)?", path)
        if not m:
            raise HttpError(error_body(404, f"no such path {path}", "notFound", "NOT_FOUND"))
        if m[1] != w.project:
            raise HttpError(not_found(f"projects/{m[1]}"))
        rest = m[2] or ""
        for pattern, verb, fn in _ROUTES:
            mm = re.fullmatch(pattern, rest)
            if mm and verb == method:
                return fn(self, query, *mm.groups())
        raise HttpError(error_body(404, f"the fake does not serve {method} {path}", "notFound", "NOT_FOUND"))

    # -- helpers

    def _region(self, region: str) -> dict:
        if region not in self.world.regions:
            raise HttpError(not_found(f"projects/{self.world.project}/regions/{region}"))
        return self.world.regions[region]

    def _zone(self, zone: str) -> dict:
        if zone not in self.world.zones:
            raise HttpError(not_found(f"projects/{self.world.project}/zones/{zone}"))
        return self.world.zones[zone]

    def _list(self, kind: str, items: list[dict], query: dict[str, list[str]], self_link: str) -> dict:
        terms = parse_filter(query.get("filter", [""])[0])
        items = sorted((i for i in items if matches(i, terms)), key=lambda i: i["name"])
        chunk, nxt = _page(items, query, self.world.page_size)
        body = {"kind": kind, "id": self_link, "items": chunk, "selfLink": self_link}
        if nxt:
            body["nextPageToken"] = nxt
        return body

    def _aggregated(self, kind: str, field: str, scoped: list[tuple[str, dict]], query: dict[str, list[str]]) -> dict:
        terms = parse_filter(query.get("filter", [""])[0])
        rows = sorted(((s, i) for s, i in scoped if matches(i, terms)), key=lambda r: (r[0], r[1]["name"]))
        chunk, nxt = _page([{"scope": s, "item": i} for s, i in rows], query, self.world.page_size)
        items: dict[str, dict] = {}
        for row in chunk:
            items.setdefault(row["scope"], {field: []})[field].append(row["item"])
        body: dict[str, Any] = {"kind": kind, "id": f"projects/{self.world.project}", "items": items}
        if nxt:
            body["nextPageToken"] = nxt
        return body

    # -- handlers

    def get_project(self, query: dict) -> dict:
        w = self.world
        quotas = [{"metric": k, "limit": v[0], "usage": v[1]} for k, v in w.project_quotas.items()]
        return {
            "kind": "compute#project",
            "id": "123456789012",
            "name": w.project,
            "quotas": quotas,
            "selfLink": w.link(),
        }

    def get_region(self, query: dict, region: str) -> dict:
        w = self.world
        r = self._region(region)
        zones = sorted(z for z, v in w.zones.items() if v["region"] == region)
        return {
            "kind": "compute#region",
            "id": "1000",
            "name": region,
            "status": r["status"],
            "quotas": [{"metric": k, "limit": v[0], "usage": v[1]} for k, v in r["quotas"].items()],
            "zones": [w.link("zones", z) for z in zones],
            "selfLink": w.link("regions", region),
        }

    def list_zones(self, query: dict) -> dict:
        w = self.world
        items = [
            {
                "kind": "compute#zone",
                "id": str(i),
                "name": z,
                "status": v["status"],
                "region": w.link("regions", v["region"]),
                "selfLink": w.link("zones", z),
            }
            for i, (z, v) in enumerate(sorted(w.zones.items()))
        ]
        return self._list("compute#zoneList", items, query, w.link("zones"))

    def _accelerator(self, zone: str, name: str, cards: int) -> dict:
        w = self.world
        return {
            "kind": "compute#acceleratorType",
            "id": str(abs(hash((zone, name))) % 10**6),
            "name": name,
            "description": name,
            "zone": w.link("zones", zone),
            "maximumCardsPerInstance": cards,
            "selfLink": w.link("zones", zone, "acceleratorTypes", name),
        }

    def list_accelerators(self, query: dict, zone: str) -> dict:
        self._zone(zone)
        items = [self._accelerator(zone, n, c) for n, c in self.world.accelerators.get(zone, {}).items()]
        return self._list(
            "compute#acceleratorTypeList", items, query, self.world.link("zones", zone, "acceleratorTypes")
        )

    def aggregated_accelerators(self, query: dict) -> dict:
        scoped = [
            (f"zones/{z}", self._accelerator(z, n, c))
            for z, accs in self.world.accelerators.items()
            for n, c in accs.items()
        ]
        return self._aggregated("compute#acceleratorTypeAggregatedList", "acceleratorTypes", scoped, query)

    def list_instances(self, query: dict, zone: str) -> dict:
        self._zone(zone)
        items = [i for (z, _), i in self.world.instances.items() if z == zone]
        return self._list("compute#instanceList", items, query, self.world.link("zones", zone, "instances"))

    def aggregated_instances(self, query: dict) -> dict:
        scoped = [(f"zones/{z}", i) for (z, _), i in self.world.instances.items()]
        return self._aggregated("compute#instanceAggregatedList", "instances", scoped, query)

    def get_instance(self, query: dict, zone: str, name: str) -> dict:
        return self.world._get(self.world.instances, (zone, name), f"zones/{zone}/instances/{name}")

    def delete_instance(self, query: dict, zone: str, name: str) -> dict:
        self._zone(zone)
        return self.world.delete_instance(zone, name)

    def start_instance(self, query: dict, zone: str, name: str) -> dict:
        self._zone(zone)
        return self.world.start_instance(zone, name)

    def stop_instance(self, query: dict, zone: str, name: str) -> dict:
        self._zone(zone)
        return self.world.stop_instance(zone, name)

    def insert_instance(self, query: dict, zone: str) -> dict:
        self._zone(zone)
        return self.world.insert_instance(zone, self.body)

    def aggregated_disks(self, query: dict) -> dict:
        scoped = [(f"zones/{z}", d) for (z, _), d in self.world.disks.items()]
        return self._aggregated("compute#diskAggregatedList", "disks", scoped, query)

    def delete_disk(self, query: dict, zone: str, name: str) -> dict:
        self._zone(zone)
        return self.world.delete_disk(zone, name)

    def aggregated_addresses(self, query: dict) -> dict:
        scoped = [(f"regions/{r}", a) for (r, _), a in self.world.addresses.items()]
        return self._aggregated("compute#addressAggregatedList", "addresses", scoped, query)

    def delete_address(self, query: dict, region: str, name: str) -> dict:
        self._region(region)
        return self.world.delete_address(region, name)

    def aggregated_subnetworks(self, query: dict) -> dict:
        scoped = [(f"regions/{r}", s) for (r, _), s in self.world.subnetworks.items()]
        return self._aggregated("compute#subnetworkAggregatedList", "subnetworks", scoped, query)

    def delete_subnetwork(self, query: dict, region: str, name: str) -> dict:
        self._region(region)
        return self.world.delete_subnetwork(region, name)

    def aggregated_routers(self, query: dict) -> dict:
        scoped = [(f"regions/{r}", x) for (r, _), x in self.world.routers.items()]
        return self._aggregated("compute#routerAggregatedList", "routers", scoped, query)

    def delete_router(self, query: dict, region: str, name: str) -> dict:
        self._region(region)
        return self.world.delete_router(region, name)

    def list_networks(self, query: dict) -> dict:
        w = self.world
        return self._list("compute#networkList", list(w.networks.values()), query, w.link("global", "networks"))

    def delete_network(self, query: dict, name: str) -> dict:
        return self.world.delete_network(name)

    def list_firewalls(self, query: dict) -> dict:
        w = self.world
        return self._list("compute#firewallList", list(w.firewalls.values()), query, w.link("global", "firewalls"))

    def delete_firewall(self, query: dict, name: str) -> dict:
        return self.world.delete_firewall(name)

    def list_operations(self, query: dict, scope: str) -> dict:
        w = self.world
        items = [s["op"] for (sc, _), s in w.operations.items() if sc == scope]
        return self._list("compute#operationList", items, query, w.link(scope, "operations"))

    def get_operation(self, query: dict, scope: str, name: str) -> dict:
        return self.world._poll(scope, name)

    def wait_operation(self, query: dict, scope: str, name: str) -> dict:
        # The API's wait returns when the operation is DONE or after about two minutes, whichever
        # comes first; the fake advances it one poll, which a client must be ready for.
        return self.world._poll(scope, name)

    # -- the other Google APIs

    def _project(self, project: str) -> None:
        if project not in (self.world.project, self.world.project_number):
            raise HttpError(
                error_body(403, f"Permission denied on resource project {project}.", "forbidden", "PERMISSION_DENIED")
            )

    def batch_get_services(self, query: dict, project: str) -> dict:
        self._project(project)
        services = []
        for name in query.get("names", []):
            service = name.rsplit("/", 1)[-1]
            state = "DISABLED" if service in self.world.disabled_services else "ENABLED"
            services.append(
                {"name": f"projects/{self.world.project_number}/services/{service}", "state": state,
                 "parent": f"projects/{self.world.project_number}", "config": {"name": service}}
            )  # fmt: skip
        return {"services": services}

    def effective_org_policy(self, query: dict, project: str) -> dict:
        self._project(project)
        constraint = self.body.get("constraint", "")
        return self.world.org_policies.get(constraint, {"constraint": constraint})

    def test_iam_permissions(self, query: dict, project: str) -> dict:
        self._project(project)
        # testIamPermissions (and every project IAM policy read or write, as Terraform's project grants
        # make) is a Resource Manager call: refused like any API call while that API is off.
        if "cloudresourcemanager.googleapis.com" in self.world.disabled_services:
            raise HttpError(
                service_disabled(
                    project, self.world.project_number, "cloudresourcemanager.googleapis.com",
                    "Cloud Resource Manager API",
                )
            )  # fmt: skip
        asked = self.body.get("permissions", [])
        held = [p for p in asked if self.world.holds(p)]
        return {"permissions": held} if held else {}

    # -- IAM custom roles

    def _role(self, project: str, role_id: str) -> dict:
        self._project(project)
        role = self.world.roles.get(role_id)
        if role is None:
            raise HttpError(error_body(404, f"The role named projects/{project}/roles/{role_id} was not found.",
                                       "notFound", "NOT_FOUND"))  # fmt: skip
        return role

    @staticmethod
    def _public(role: dict) -> dict:
        return {k: v for k, v in role.items() if not k.startswith("_")}

    def create_role(self, query: dict, project: str) -> dict:
        self._project(project)
        w, role_id = self.world, self.body.get("roleId", "")
        if not ROLE_ID_RE.fullmatch(role_id):
            message = f"The role_id ({role_id}) is not valid: it must match [a-zA-Z0-9_\\.]{{3,64}}."
            raise HttpError(error_body(400, message, "badRequest", "INVALID_ARGUMENT"))
        old = w.roles.get(role_id)
        if old is not None and old.get("deleted"):
            if w.now() - old["_deleted_at"] < ROLE_ID_HELD_DAYS * DAY_S:
                raise HttpError(error_body(
                    400, f"You can't create a role with role_id ({role_id}) where there is an existing role with "
                    "that role_id in a deleted state.", "failedPrecondition", "FAILED_PRECONDITION"))  # fmt: skip
            old = None  # purged
        if old is not None:
            raise HttpError(error_body(409, f"A role named {role_id} in projects/{project} already exists.",
                                       "alreadyExists", "ALREADY_EXISTS"))  # fmt: skip
        body = self.body.get("role", {})
        w.roles[role_id] = {
            "name": f"projects/{project}/roles/{role_id}", "title": body.get("title", ""),
            "includedPermissions": list(body.get("includedPermissions", [])), "stage": "GA", "etag": "BwX=",
        }  # fmt: skip
        return self._public(w.roles[role_id])

    def get_role(self, query: dict, project: str, role_id: str) -> dict:
        role = self._role(project, role_id)
        if role.get("deleted") and self.world.now() - role["_deleted_at"] >= ROLE_ID_HELD_DAYS * DAY_S:
            del self.world.roles[role_id]
            return self._role(project, role_id)
        return self._public(role)

    def delete_role(self, query: dict, project: str, role_id: str) -> dict:
        role = self._role(project, role_id)
        if not role.get("deleted"):
            role.update(deleted=True, _deleted_at=self.world.now())
        return self._public(role)

    def undelete_role(self, query: dict, project: str, role_id: str) -> dict:
        role = self._role(project, role_id)
        if role.get("deleted"):
            if self.world.now() - role["_deleted_at"] >= ROLE_UNDELETE_DAYS * DAY_S:
                raise HttpError(error_body(400, f"Role projects/{project}/roles/{role_id} was deleted more than "
                                           f"{ROLE_UNDELETE_DAYS} days ago and cannot be undeleted.",
                                           "failedPrecondition", "FAILED_PRECONDITION"))  # fmt: skip
            role.pop("deleted")
            role.pop("_deleted_at")
        return self._public(role)

    def userinfo(self, query: dict) -> dict:
        return {"sub": "1234567890", "email": self.world.identity, "email_verified": True}

    def _profile(self, email: str, project: str | None = None) -> dict:
        w = self.world
        entry = w.os_login.setdefault(email, {"username": re.sub(r"[^a-z0-9]", "_", email.lower()), "keys": {}})
        account = {
            "primary": True,
            "username": entry["username"],
            "uid": "1001",
            "gid": "1001",
            "homeDirectory": f"/home/{entry['username']}",
            "shell": "/bin/bash",
            "accountId": project or w.project,
            "operatingSystemType": "LINUX",
            "name": f"users/{email}/projects/{project or w.project}",
        }
        keys = {
            fp: {"key": key, "fingerprint": fp, "name": f"users/{email}/sshPublicKeys/{fp}"}
            for fp, key in entry["keys"].items()
        }
        return {"name": email, "posixAccounts": [account], "sshPublicKeys": keys}

    def import_ssh_key(self, query: dict, email: str) -> dict:
        import hashlib

        key = (self.body.get("key") or "").strip()
        if not re.fullmatch(r"(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp\d+) [A-Za-z0-9+/=]+( .*)?", key):
            raise HttpError(error_body(400, "Invalid SSH public key", "badRequest", "INVALID_ARGUMENT"))
        project = query.get("projectId", [None])[0]
        if project is not None:
            self._project(project)
        self.world.os_login.setdefault(email, {"username": re.sub(r"[^a-z0-9]", "_", email.lower()), "keys": {}})
        self.world.os_login[email]["keys"][hashlib.sha256(key.encode()).hexdigest()] = key
        return {"loginProfile": self._profile(email, project)}

    def login_profile(self, query: dict, email: str) -> dict:
        return self._profile(email, query.get("projectId", [None])[0])

    def delete_ssh_key(self, query: dict, email: str, fingerprint: str) -> dict:
        keys = self.world.os_login.get(email, {}).get("keys", {})
        if fingerprint not in keys:
            raise HttpError(not_found(f"users/{email}/sshPublicKeys/{fingerprint}"))
        del keys[fingerprint]
        return {}


_API_ROUTES = [
    (r"/v1/projects/([^/:]+)/roles", "POST", _Handler.create_role),
    (r"/v1/projects/([^/:]+)/roles/([^/:]+)", "GET", _Handler.get_role),
    (r"/v1/projects/([^/:]+)/roles/([^/:]+)", "DELETE", _Handler.delete_role),
    (r"/v1/projects/([^/:]+)/roles/([^/:]+):undelete", "POST", _Handler.undelete_role),
    (r"/v1/projects/([^/]+)/services:batchGet", "GET", _Handler.batch_get_services),
    (r"/v1/projects/([^/:]+):getEffectiveOrgPolicy", "POST", _Handler.effective_org_policy),
    (r"/v1/projects/([^/:]+):testIamPermissions", "POST", _Handler.test_iam_permissions),
    (r"/v1/userinfo", "GET", _Handler.userinfo),
    (r"/v1/users/([^/:]+):importSshPublicKey", "POST", _Handler.import_ssh_key),
    (r"/v1/users/([^/:]+)/loginProfile", "GET", _Handler.login_profile),
    (r"/v1/users/([^/:]+)/sshPublicKeys/([^/]+)", "DELETE", _Handler.delete_ssh_key),
]

_SCOPE = r"(global|zones/[^/]+|regions/[^/]+)"
_ROUTES = [
    (r"", "GET", _Handler.get_project),
    (r"/regions/([^/]+)", "GET", _Handler.get_region),
    (r"/zones", "GET", _Handler.list_zones),
    (r"/zones/([^/]+)/acceleratorTypes", "GET", _Handler.list_accelerators),
    (r"/aggregated/acceleratorTypes", "GET", _Handler.aggregated_accelerators),
    (r"/zones/([^/]+)/instances", "GET", _Handler.list_instances),
    (r"/zones/([^/]+)/instances", "POST", _Handler.insert_instance),
    (r"/aggregated/instances", "GET", _Handler.aggregated_instances),
    (r"/zones/([^/]+)/instances/([^/]+)", "GET", _Handler.get_instance),
    (r"/zones/([^/]+)/instances/([^/]+)", "DELETE", _Handler.delete_instance),
    (r"/zones/([^/]+)/instances/([^/]+)/start", "POST", _Handler.start_instance),
    (r"/zones/([^/]+)/instances/([^/]+)/stop", "POST", _Handler.stop_instance),
    (r"/aggregated/disks", "GET", _Handler.aggregated_disks),
    (r"/zones/([^/]+)/disks/([^/]+)", "DELETE", _Handler.delete_disk),
    (r"/aggregated/addresses", "GET", _Handler.aggregated_addresses),
    (r"/regions/([^/]+)/addresses/([^/]+)", "DELETE", _Handler.delete_address),
    (r"/aggregated/subnetworks", "GET", _Handler.aggregated_subnetworks),
    (r"/regions/([^/]+)/subnetworks/([^/]+)", "DELETE", _Handler.delete_subnetwork),
    (r"/aggregated/routers", "GET", _Handler.aggregated_routers),
    (r"/regions/([^/]+)/routers/([^/]+)", "DELETE", _Handler.delete_router),
    (r"/global/networks", "GET", _Handler.list_networks),
    (r"/global/networks/([^/]+)", "DELETE", _Handler.delete_network),
    (r"/global/firewalls", "GET", _Handler.list_firewalls),
    (r"/global/firewalls/([^/]+)", "DELETE", _Handler.delete_firewall),
    (rf"/{_SCOPE}/operations", "GET", _Handler.list_operations),
    (rf"/{_SCOPE}/operations/([^/]+)", "GET", _Handler.get_operation),
    (rf"/{_SCOPE}/operations/([^/]+)/wait", "POST", _Handler.wait_operation),
]
