"""Compute Engine and Cloud Storage for the gcp backend: credentials and project, one mapping from
API errors to one-line UserErrors, preflight (quota, accelerator, zones), node status, and the
sweep `dtrain down` runs after `terraform destroy`.

Everything here is plain functions over a `Gcp` (the project, the credentials and lazily made
clients), so that the commands stay thin and the tests run against a local server that speaks the
Compute REST API (tests/gcp/compute_fake.py) and gcp-storage-emulator.

The google libraries are imported inside functions: `dtrain --help` never loads them.

Conventions this module relies on (infra/ keeps them):
  - every resource that takes labels carries `dtrain-cluster = <name>` (instances, disks,
    addresses, buckets);
  - networks, subnetworks, routers and firewalls take no labels in Compute v1: the network is named
    `dtrain-<name>` and says "dtrain cluster <name>" in its description; everything on it is the
    cluster's (see `find_leftovers`).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.gcp.auth import default_credentials, google_module

CLUSTER_LABEL = "dtrain-cluster"
QUOTA_PAGE = "https://console.cloud.google.com/iam-admin/quotas?project={project}"

# Bounds on waiting for one Compute operation (a delete): each `wait` call returns after at most
# about two minutes server-side; the deadline is ours.
OPERATION_TIMEOUT_S = 600.0
OPERATION_POLL_S = 1.0
# One request to the API gives up after REQUEST_TIMEOUT_S; transient errors (503, 429) are retried
# with backoff for up to RETRY_DEADLINE_S in all (the library's default would retry for 600 s).
REQUEST_TIMEOUT_S = 60.0
RETRY_DEADLINE_S = 30.0

REGION_RE = re.compile(r"[a-z]+(?:-[a-z0-9]+)+")

# Google REST APIs dtrain calls without a client library (a few calls each; Gcp.rest), by name. With
# DTRAIN_GCP_API_ENDPOINT every one of them is asked at that one base URL instead (the tests' fake).
REST_APIS = {
    "serviceusage": "https://serviceusage.googleapis.com",
    "cloudresourcemanager": "https://cloudresourcemanager.googleapis.com",
    "oslogin": "https://oslogin.googleapis.com",
    "openidconnect": "https://openidconnect.googleapis.com",
}
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

# IAM roles to suggest for a missing permission, by the permission's prefix (first match wins).
ROLE_FOR_PERMISSION = (
    ("compute.firewalls.", "roles/compute.securityAdmin"),
    ("compute.networks.", "roles/compute.networkAdmin"),
    ("compute.subnetworks.", "roles/compute.networkAdmin"),
    ("compute.addresses.", "roles/compute.networkAdmin"),
    ("compute.instances.", "roles/compute.instanceAdmin.v1"),
    ("compute.disks.", "roles/compute.instanceAdmin.v1"),
    ("compute.", "roles/compute.viewer"),
    ("storage.", "roles/storage.admin"),
    ("serviceusage.", "roles/serviceusage.serviceUsageConsumer"),
    ("orgpolicy.", "roles/orgpolicy.policyViewer"),
    ("iap.tunnelInstances.", "roles/iap.tunnelResourceAccessor"),
    ("iam.roles.", "roles/iam.roleAdmin"),
)


# Every permission `dtrain up` needs on the project, by what needs it (infra/*.tf, and how dtrain logs in),
# with the predefined role that grants the group: preflight asks for them all in one Resource Manager
# projects.testIamPermissions call (https://cloud.google.com/resource-manager/reference/rest/v1/projects/testIamPermissions)
# and names every missing one, with its role, in one line, before anything is created. Roles: the
# predefined roles reference, https://cloud.google.com/iam/docs/understanding-roles. `when` names the
# condition under which a group is needed ("" always; "nat": nodes without external IPs; "external_ip";
# "os_login"); preflight_permissions() picks the groups.
@dataclasses.dataclass(frozen=True)
class PermissionGroup:
    what: str  # what needs them, as the error line says it
    role: str  # the predefined role that grants them
    permissions: tuple[str, ...]
    when: str = ""


UP_PERMISSIONS = (
    # infra/network.tf: the cluster's VPC network and subnetwork.
    PermissionGroup(
        "the cluster's network (infra/network.tf)",
        "roles/compute.networkAdmin",
        (
            "compute.networks.create",
            "compute.networks.get",
            "compute.networks.delete",
            "compute.subnetworks.create",
            "compute.subnetworks.get",
            "compute.subnetworks.delete",
        ),
    ),  # fmt: skip
    # infra/network.tf: Cloud Router and NAT for nodes without external IPs (the NAT is a router update).
    PermissionGroup(
        "Cloud NAT for nodes without external IPs (infra/network.tf)",
        "roles/compute.networkAdmin",
        ("compute.routers.create", "compute.routers.get", "compute.routers.update", "compute.routers.delete"),
        when="nat",
    ),
    # infra/network.tf: the SSH and internal firewall rules (a rule on a network also needs updatePolicy on it).
    PermissionGroup(
        "the cluster's firewall rules (infra/network.tf)",
        "roles/compute.securityAdmin",
        (
            "compute.firewalls.create",
            "compute.firewalls.get",
            "compute.firewalls.delete",
            "compute.networks.updatePolicy",
        ),
    ),  # fmt: skip
    # infra/compute.tf: the VMs, their boot disks, metadata, labels, tags and service account, on the subnetwork.
    PermissionGroup(
        "the VMs (infra/compute.tf)",
        "roles/compute.instanceAdmin.v1",
        (
            "compute.instances.create",
            "compute.instances.get",
            "compute.instances.delete",
            "compute.instances.setMetadata",
            "compute.instances.setLabels",
            "compute.instances.setTags",
            "compute.instances.setServiceAccount",
            "compute.instances.start",
            "compute.instances.stop",
            "compute.disks.create",
            "compute.disks.setLabels",
            "compute.subnetworks.use",
        ),
    ),  # fmt: skip
    PermissionGroup(
        "the VMs' external IPs (infra/compute.tf)",
        "roles/compute.instanceAdmin.v1",
        ("compute.subnetworks.useExternalIp",),
        when="external_ip",
    ),
    # infra/compute.tf: a VM that runs as the nodes' service account needs actAs on it.
    PermissionGroup(
        "running the VMs as the nodes' service account (infra/compute.tf)",
        "roles/iam.serviceAccountUser",
        ("iam.serviceAccounts.actAs",),
    ),
    # infra/iam.tf: google_service_account.node.
    PermissionGroup(
        "the nodes' service account (infra/iam.tf)",
        "roles/iam.serviceAccountAdmin",
        ("iam.serviceAccounts.create", "iam.serviceAccounts.get", "iam.serviceAccounts.delete"),
    ),
    # infra/iam.tf: google_project_iam_custom_role.service.
    PermissionGroup(
        "the cluster service's custom role (infra/iam.tf)",
        "roles/iam.roleAdmin",
        ("iam.roles.create", "iam.roles.get", "iam.roles.delete", "iam.roles.undelete"),
    ),
    # infra/iam.tf: google_project_iam_member (the service role's bindings, the observability roles).
    PermissionGroup(
        "the project-level grants (infra/iam.tf)",
        "roles/resourcemanager.projectIamAdmin",
        ("resourcemanager.projects.getIamPolicy", "resourcemanager.projects.setIamPolicy"),
    ),
    # infra/storage.tf and infra/iam.tf: the checkpoint bucket and the nodes' grant on it.
    PermissionGroup(
        "the checkpoint bucket and its grant (infra/storage.tf, infra/iam.tf)",
        "roles/storage.admin",
        (
            "storage.buckets.create",
            "storage.buckets.get",
            "storage.buckets.update",
            "storage.buckets.delete",
            "storage.buckets.getIamPolicy",
            "storage.buckets.setIamPolicy",
        ),
    ),  # fmt: skip
    # infra/storage.tf and infra/iam.tf: the image repository and the nodes' read grant on it.
    PermissionGroup(
        "the image repository and its grant (infra/storage.tf, infra/iam.tf)",
        "roles/artifactregistry.admin",
        (
            "artifactregistry.repositories.create",
            "artifactregistry.repositories.get",
            "artifactregistry.repositories.delete",
            "artifactregistry.repositories.getIamPolicy",
            "artifactregistry.repositories.setIamPolicy",
        ),
    ),  # fmt: skip
    # Logging in: OS Login with sudo (which `sudo docker` needs), and IAP TCP forwarding without external IPs.
    PermissionGroup(
        "logging in to the nodes", "roles/compute.osAdminLogin", ("compute.instances.osAdminLogin",), when="os_login"
    ),
    PermissionGroup(
        "logging in to the nodes",
        "roles/iap.tunnelResourceAccessor",
        ("iap.tunnelInstances.accessViaIAP",),
        when="nat",
    ),  # fmt: skip
)


def up_permissions(*, nat: bool, external_ip: bool, os_login: bool) -> list[PermissionGroup]:
    """The groups of UP_PERMISSIONS a cluster with these settings needs."""
    on = {"": True, "nat": nat, "external_ip": external_ip, "os_login": os_login}
    return [g for g in UP_PERMISSIONS if on[g.when]]


def missing_permissions_line(project: str, groups: Iterable[PermissionGroup], missing: Iterable[str]) -> str:
    """The one line that names every missing permission, what needs it and the roles that grant them."""
    missing = set(missing)
    lacking = [(g, [p for p in g.permissions if p in missing]) for g in groups]
    lacking = [(g, perms) for g, perms in lacking if perms]
    roles = list(dict.fromkeys(g.role for g, _ in lacking))
    binding = f"gcloud projects add-iam-policy-binding {project} --member=user:YOU --role="
    if len(lacking) == 1 and len(lacking[0][1]) == 1:
        (group, (permission,)) = lacking[0]
        return (
            f"you lack {permission} on project {project}, which {group.what} needs: ask for {group.role} "
            f"({binding}{group.role})"
        )
    count = sum(len(perms) for _, perms in lacking)
    parts = "; ".join(f"{', '.join(perms)} for {g.what}" for g, perms in lacking)
    return (
        f"you lack {count} permissions on project {project} that dtrain up needs ({parts}): ask for "
        f"{', '.join(roles)} ({binding}ROLE, once per role)"
    )


# A zone without capacity for the VM (a stockout), as Compute reports it: the operation's error code, or
# the words of its message when the error comes back on the request itself (a 503) or through Terraform.
# ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS is the same stockout with "'(resource type:compute)'" added to
# the message (https://cloud.google.com/compute/docs/troubleshooting/troubleshooting-resource-availability).
# Every place that asks "is this a stockout?" asks `is_stockout`.
STOCKOUT_CODES = frozenset({"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "STOCKOUT"})
STOCKOUT_RE = re.compile(
    r"\b(?:ZONE_RESOURCE_POOL_EXHAUSTED(?:_WITH_DETAILS)?|STOCKOUT)\b|does not have enough resources available"
)
REQUIRE_OS_LOGIN = "constraints/compute.requireOsLogin"
EXTERNAL_IP_ACCESS = "constraints/compute.vmExternalIpAccess"
# Enforced, it refuses new VMs without Secure Boot, vTPM and integrity monitoring
# (https://cloud.google.com/resource-manager/docs/organization-policy/org-policy-constraints).
REQUIRE_SHIELDED_VM = "constraints/compute.requireShieldedVm"


# --------------------------------------------------------------------------------------------
# Clients and credentials


class Gcp:
    """One project's credentials and its Compute Engine / Cloud Storage clients (made on first use).

    Build it with `Gcp.connect(...)`. `endpoint` overrides the Compute API's address (None: Google's),
    `storage_endpoint` the Cloud Storage one; tests point them at local servers.
    """

    def __init__(
        self,
        project: str,
        credentials: Any,
        *,
        endpoint: str | None = None,
        storage_endpoint: str | None = None,
        api_endpoint: str | None = None,
    ) -> None:
        self.project = project
        self.credentials = credentials
        self.endpoint = endpoint
        self.storage_endpoint = storage_endpoint
        self.api_endpoint = api_endpoint
        self._clients: dict[str, Any] = {}

    @classmethod
    def connect(
        cls,
        project: str | None = None,
        *,
        endpoint: str | None = None,
        storage_endpoint: str | None = None,
        api_endpoint: str | None = None,
        credentials: Any = None,
        cluster: str = "NAME",
    ) -> Gcp:
        """Resolve credentials (given, else Application Default Credentials) and the project
        (given, else ADC's, else GOOGLE_CLOUD_PROJECT): a one-line UserError saying what to do if
        either is missing. `cluster` only names the dtrain.toml table in that message."""
        adc_project = None
        if credentials is None:
            credentials, adc_project = default_credentials()
        if not project:
            project = adc_project or os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT")
        if not project:
            raise UserError(
                f'no Google Cloud project: set project = "..." under [clusters.{cluster}] in dtrain.toml, '
                "or export GOOGLE_CLOUD_PROJECT=..."
            )
        return cls(
            project, credentials, endpoint=endpoint, storage_endpoint=storage_endpoint, api_endpoint=api_endpoint
        )

    def compute(self, name: str) -> Any:
        """A compute_v1 client by class name ("InstancesClient", "RegionsClient", ...)."""
        client = self._clients.get(name)
        if client is None:
            compute_v1 = google_module("compute")
            options = {"api_endpoint": self.endpoint} if self.endpoint else None
            client = getattr(compute_v1, name)(credentials=self.credentials, client_options=options)
            self._clients[name] = client
        return client

    def storage(self) -> Any:
        client = self._clients.get("storage")
        if client is None:
            storage = google_module("storage")
            options = {"api_endpoint": self.storage_endpoint} if self.storage_endpoint else None
            client = storage.Client(project=self.project, credentials=self.credentials, client_options=options)
            self._clients["storage"] = client
        return client

    def rest(self, api: str, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One call to a Google REST API that has no client library among dtrain's dependencies
        (REST_APIS), with the credentials; an error answer is raised as the google.api_core exception
        the client libraries raise, so `errors` maps it like any other. `kwargs` go to requests
        (params, json)."""
        session = self._clients.get("rest")
        if session is None:
            session = google_module("auth.requests").AuthorizedSession(self.credentials)
            self._clients["rest"] = session
        url = (self.api_endpoint or REST_APIS[api]).rstrip("/") + path
        response = session.request(method, url, timeout=REQUEST_TIMEOUT_S, **kwargs)
        if response.status_code >= 400:
            raise google_module("api_core.exceptions").from_http_response(response)
        return response.json() if response.content else {}

    def rpc(self) -> dict[str, Any]:
        """Per-call options for Compute requests: a timeout, and retries of transient errors (503,
        429, deadline exceeded) bounded by RETRY_DEADLINE_S rather than the library's 600 s. A
        refused connection is not retried: it is reported at once."""
        from google.api_core import exceptions as gexc
        from google.api_core import retry as gretry

        predicate = gretry.if_exception_type(gexc.ServiceUnavailable, gexc.TooManyRequests, gexc.DeadlineExceeded)
        first = min(1.0, RETRY_DEADLINE_S / 5)
        retry = gretry.Retry(predicate=predicate, initial=first, maximum=8.0, multiplier=2.0, timeout=RETRY_DEADLINE_S)
        return {"timeout": REQUEST_TIMEOUT_S, "retry": retry}

    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """Turn any API, auth or network error raised inside into `api_error(...)`."""
        try:
            yield
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - api_error re-raises what it does not know
            mapped = api_error(e, project=self.project, doing=doing, endpoint=self.endpoint)
            if mapped is None:
                raise
            raise mapped from e


# --------------------------------------------------------------------------------------------
# Errors


def api_error(exc: BaseException, *, project: str, doing: str, endpoint: str | None = None) -> UserError | None:
    """The one-line UserError for an exception raised by a Google client, or None when it is not
    one we know (a bug: let it raise with its traceback).

    Things the user fixes in their project or config (API disabled, permission, no such project,
    region or zone, no credentials) exit 2; conditions that may pass on a retry (rate limits,
    server errors, the network) exit 1.
    """
    try:
        import requests
        from google.api_core import exceptions as gexc
        from google.auth import exceptions as auth_exc
    except ImportError:  # pragma: no cover - no google libraries, no google errors
        return None

    where = f"{doing}: " if doing else ""
    if isinstance(exc, gexc.RetryError) and exc.cause is not None:
        # Retries ran out: what matters is the last error, and that it may pass later.
        cause = api_error(exc.cause, project=project, doing=doing, endpoint=endpoint)
        if cause is not None:
            return UserError(
                f"{cause} (still failing after {RETRY_DEADLINE_S:g}s of retries)", exit_code=ExitCode.FAILURE
            )
    if isinstance(exc, auth_exc.RefreshError):
        return UserError(
            f"{where}Google credentials were refused ({_first_line(str(exc))}): "
            "run gcloud auth application-default login",
        )
    if isinstance(exc, auth_exc.DefaultCredentialsError):
        return UserError(
            "no Google credentials: run gcloud auth application-default login "
            "(or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file)"
        )
    if isinstance(exc, (requests.ConnectionError, requests.Timeout, gexc.RetryError)):
        target = endpoint or "the Google Cloud APIs"
        return UserError(
            f"{where}cannot reach {target} ({_first_line(str(exc), 160)}): check the network, proxy or endpoint "
            "and run the command again",
            exit_code=ExitCode.FAILURE,
        )
    if not isinstance(exc, gexc.GoogleAPICallError):
        return None

    message = _api_message(exc)
    reasons = {getattr(exc, "reason", None)} | {
        e.get("reason") for e in (exc.errors or []) if isinstance(e, dict) and e.get("reason")
    }
    code = exc.code or 0

    if reasons & {"SERVICE_DISABLED", "accessNotConfigured"} or "has not been used in project" in message:
        api = (getattr(exc, "metadata", None) or {}).get("service") or "compute.googleapis.com"
        return UserError(enable_hint(project, [api]))
    if reasons & {"RATE_LIMIT_EXCEEDED", "rateLimitExceeded", "userRateLimitExceeded"} or code == 429:
        return UserError(
            f"{where}API rate limit reached in project {project} ({message}): wait a minute and run it again",
            exit_code=ExitCode.FAILURE,
        )
    if reasons & {"quotaExceeded", "QUOTA_EXCEEDED"}:
        return UserError(
            f"{where}quota exceeded in project {project} ({message}): request more at "
            f"{QUOTA_PAGE.format(project=project)}",
            exit_code=ExitCode.FAILURE,
        )
    if code in (401,) or isinstance(exc, gexc.Unauthorized):
        return UserError(
            f"{where}Google refused the credentials ({message}): run gcloud auth application-default login"
        )
    if code == 403:
        permission = _permission_in(message)
        if permission:
            role = next((r for prefix, r in ROLE_FOR_PERMISSION if permission.startswith(prefix)), "roles/editor")
            return UserError(
                f"{where}permission {permission} denied in project {project}: ask for {role} "
                f"(gcloud projects add-iam-policy-binding {project} --member=user:YOU --role={role})"
            )
        return UserError(f"{where}permission denied in project {project} ({message}): check your IAM roles")
    if code == 404:
        resource = _resource_in(message)
        if resource is None or re.fullmatch(r"projects/[^/]+", resource):
            return UserError(
                f"{where}project {project} not found, or you cannot see it: check project = in dtrain.toml "
                "(gcloud projects list shows yours)"
            )
        kind, _, name = resource.rpartition("/")
        kind = kind.rsplit("/", 1)[-1].rstrip("s") or "resource"
        listing = {"region": "gcloud compute regions list", "zone": "gcloud compute zones list"}.get(kind)
        hint = f": {listing} shows the valid ones" if listing else ""
        return UserError(f"{where}{kind} {name} not found in project {project}{hint}")
    if code == 400:
        return UserError(f"{where}the API rejected the request: {message}")
    if code >= 500 or isinstance(exc, (gexc.ServiceUnavailable, gexc.InternalServerError)):
        return UserError(
            f"{where}Google Cloud answered {code} ({message}): run it again in a minute",
            exit_code=ExitCode.FAILURE,
        )
    return UserError(f"{where}{message}", exit_code=ExitCode.FAILURE)


_API_NAMES = {
    "compute.googleapis.com": "Compute Engine API",
    "storage.googleapis.com": "Cloud Storage API",
    "storage-api.googleapis.com": "Cloud Storage API",
    "artifactregistry.googleapis.com": "Artifact Registry API",
    "iam.googleapis.com": "IAM API",
    "serviceusage.googleapis.com": "Service Usage API",
    "cloudresourcemanager.googleapis.com": "Cloud Resource Manager API",
    "oslogin.googleapis.com": "OS Login API",
}


def is_stockout(code: str = "", message: str = "") -> bool:
    """Whether an error (an operation's error code and message, or any error text) says the zone has no
    capacity for the VM now."""
    return code in STOCKOUT_CODES or STOCKOUT_RE.search(message or "") is not None


def _api_message(exc: Any) -> str:
    # The library prefixes "GET http://...: " to the server's message; the server's text is enough.
    text = getattr(exc, "message", None) or str(exc)
    text = re.sub(r"^(GET|POST|DELETE|PATCH|PUT) \S+: ", "", str(text))
    return _first_line(text, 300)


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _permission_in(message: str) -> str | None:
    # A permission is service.resource.verb; not a piece of an e-mail or a host name.
    m = re.search(
        r"(?<![\w@.-])((?:compute|storage|serviceusage|iam|resourcemanager|orgpolicy|oslogin|iap)\.[A-Za-z]+\.[A-Za-z]+)"
        r"(?![\w.])",
        message,
    )
    return m.group(1) if m else None


def _resource_in(message: str) -> str | None:
    m = re.search(r"resource '([^']+)'", message)
    return m.group(1) if m else None


def _short(url: str) -> str:
    """The last path segment of a Compute URL (zone, machine type, network...)."""
    return url.rstrip("/").rsplit("/", 1)[-1] if url else ""


def _label_filter(cluster_name: str) -> str:
    return f'labels.{CLUSTER_LABEL} = "{cluster_name}"'


def _labelled(resource: Any, cluster_name: str) -> bool:
    # The server filter narrows the listing; this check is what the code trusts.
    return dict(getattr(resource, "labels", None) or {}).get(CLUSTER_LABEL) == cluster_name


# --------------------------------------------------------------------------------------------
# Preflight


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


def enable_hint(project: str, services: Iterable[str]) -> str:
    """The one line that says which APIs are off and how to turn them on."""
    services = list(services)
    names = ", ".join(_API_NAMES.get(s, s) for s in services)
    verb = "is" if len(services) == 1 else "are"
    command = f"gcloud services enable {' '.join(services)} --project {project}"
    return f"{names} {verb} not enabled in project {project}: {command}"


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
    return sorted(z.name for z in zones if _short(z.region) == region and z.status == "UP")


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
                zone = _short(acc.zone) or _short(scope)
                if acc.name == accelerator and zone in wanted:
                    offered[zone] = acc.maximum_cards_per_instance or 0
    return offered


# --------------------------------------------------------------------------------------------
# Organisation policies, permissions, identity and OS Login


def effective_policy(gcp: Gcp, constraint: str) -> dict[str, Any]:
    """The organisation policy in force on the project for `constraint` (Resource Manager v1
    projects.getEffectiveOrgPolicy: the project's, its folders' and its organisation's merged). Needs
    orgpolicy.policy.get; a project outside any organisation answers with the constraint's default."""
    with gcp.errors(f"reading the organisation policy {constraint}"):
        return gcp.rest(
            "cloudresourcemanager",
            "POST",
            f"/v1/projects/{gcp.project}:getEffectiveOrgPolicy",
            json={"constraint": constraint},
        )


def enforced(policy: dict[str, Any]) -> bool:
    """Whether a boolean constraint's policy is on."""
    return bool((policy.get("booleanPolicy") or {}).get("enforced"))


def external_ip_denied(policy: dict[str, Any], project: str, zone: str, names: Iterable[str]) -> list[str]:
    """Which of the VMs `names` (in `zone`) constraints/compute.vmExternalIpAccess denies an external IP.
    Its values are instance paths, projects/P/zones/Z/instances/N; all values allowed when no list
    policy is set (the constraint's default)."""
    listed = policy.get("listPolicy") or {}

    def values(key: str) -> set[str]:
        return {v.removeprefix("is:") for v in listed.get(key) or []}

    allowed, denied, everything = values("allowedValues"), values("deniedValues"), listed.get("allValues")
    out = []
    for name in names:
        path = f"projects/{project}/zones/{zone}/instances/{name}"
        if everything == "ALLOW":
            continue
        if everything == "DENY" or path in denied or (allowed and path not in allowed):
            out.append(name)
    return out


def missing_permissions(gcp: Gcp, permissions: Iterable[str]) -> list[str]:
    """Which of `permissions` the caller lacks on the project (Resource Manager testIamPermissions)."""
    wanted = list(permissions)
    if not wanted:
        return []
    with gcp.errors("checking your permissions on the project"):
        body = gcp.rest(
            "cloudresourcemanager",
            "POST",
            f"/v1/projects/{gcp.project}:testIamPermissions",
            json={"permissions": wanted},
        )
    held = set(body.get("permissions") or [])
    return [p for p in wanted if p not in held]


def caller_email(gcp: Gcp) -> str:
    """The e-mail of the account the credentials belong to: a service account's own, else the
    OpenID Connect userinfo answer (the token of `gcloud auth application-default login` carries the
    userinfo.email scope)."""
    from dtrain.control.gcp.auth import account_email

    email = account_email(gcp.credentials)
    if email:
        return email
    with gcp.errors("finding which account the Google credentials belong to"):
        email = gcp.rest("openidconnect", "GET", "/v1/userinfo").get("email") or ""
    if "@" not in email:
        raise UserError(
            "OS Login needs the e-mail of the account dtrain runs as, and the credentials do not tell it: "
            "run gcloud auth application-default login again (its token carries the e-mail scope)"
        )
    return email


@dataclasses.dataclass(frozen=True)
class OsLoginKey:
    """The cluster's key on an OS Login profile: whose (`user`, an e-mail), the POSIX user name the
    nodes know them by, and the key's SHA-256 `fingerprint` (what names it to delete it; what is shown
    instead of the key)."""

    user: str
    username: str
    fingerprint: str


def import_os_login_key(gcp: Gcp, public_key: str) -> OsLoginKey:
    """Add the cluster's public key to the caller's OS Login profile (users.importSshPublicKey, with
    the project so that a POSIX account exists there) and return the user name to log in as."""
    user = caller_email(gcp)
    key = public_key.strip()
    with gcp.errors(f"adding the cluster's SSH key to the OS Login profile of {user}"):
        body = gcp.rest(
            "oslogin",
            "POST",
            f"/v1/users/{user}:importSshPublicKey",
            params={"projectId": gcp.project},
            json={"key": key},
        )
    profile = body.get("loginProfile") or {}
    accounts = profile.get("posixAccounts") or []
    account = next((a for a in accounts if a.get("accountId") == gcp.project), None)
    account = account or next((a for a in accounts if a.get("primary")), None)
    fingerprint = next(
        (fp for fp, entry in (profile.get("sshPublicKeys") or {}).items() if (entry.get("key") or "").strip() == key),
        "",
    )
    if account is None or not account.get("username") or not fingerprint:
        raise UserError(
            f"OS Login did not give {user} a POSIX account with the cluster's key in project {gcp.project}: "
            "check that OS Login is allowed for your account (gcloud compute os-login describe-profile)"
        )
    return OsLoginKey(user=user, username=account["username"], fingerprint=fingerprint)


def remove_os_login_key(gcp: Gcp, user: str, fingerprint: str) -> bool:
    """Delete the cluster's key from `user`'s OS Login profile; False when it is already gone."""
    gexc = google_module("api_core.exceptions")

    with gcp.errors(f"removing the cluster's SSH key from the OS Login profile of {user}"):
        try:
            gcp.rest("oslogin", "DELETE", f"/v1/users/{user}/sshPublicKeys/{fingerprint}")
        except gexc.NotFound:
            return False
    return True


# --------------------------------------------------------------------------------------------
# Status


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
                request={"project": gcp.project, "zone": zone, "filter": _label_filter(cluster_name)},
                **gcp.rpc(),
            )
            if _labelled(inst, cluster_name)
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
                machine_type=_short(inst.machine_type),
                gpus=sum(a.accelerator_count for a in accs),
                accelerator=_short(accs[0].accelerator_type) if accs else "",
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
            request={"project": gcp.project, "filter": _label_filter(cluster_name)}, **gcp.rpc()
        )
        for scope, scoped in pages:
            zone = _short(scope)
            if zone.startswith(f"{region}-") and any(_labelled(i, cluster_name) for i in scoped.instances):
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
            name = _short(op.target_link)
            if at and (name not in latest or _time(at) > _time(latest[name])):
                latest[name] = at
    return latest


def _time(text: str) -> dt.datetime:
    """An RFC 3339 timestamp as Compute writes it ("2024-05-01T10:00:00.123-07:00")."""
    t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)


# --------------------------------------------------------------------------------------------
# Down: the sweep


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

    def aggregated(client: str, field: str, doing: str, label_filter: bool) -> Iterator[tuple[str, Any]]:
        request = {"project": gcp.project}
        if label_filter:
            request["filter"] = _label_filter(cluster_name)
        with gcp.errors(doing):
            for scope, scoped in gcp.compute(client).aggregated_list(request=request, **gcp.rpc()):
                for res in getattr(scoped, field):
                    yield scope, res

    for scope, inst in aggregated("InstancesClient", "instances", "listing VMs", True):
        if in_region.match(scope) and _labelled(inst, cluster_name):
            found.append(Leftover("instance", inst.name, _short(scope), label))
    for scope, disk in aggregated("DisksClient", "disks", "listing disks", True):
        if in_region.match(scope) and _labelled(disk, cluster_name):
            found.append(Leftover("disk", disk.name, _short(scope), label))
    for scope, addr in aggregated("AddressesClient", "addresses", "listing addresses", True):
        if in_region.match(scope) and _labelled(addr, cluster_name):
            found.append(Leftover("address", addr.name, _short(scope), label))

    with gcp.errors("listing networks"):
        networks = {}
        for n in gcp.compute("NetworksClient").list(project=gcp.project, **gcp.rpc()):
            if n.name == f"{NETWORK_PREFIX}{cluster_name}":
                networks[n.name] = f"name {n.name}"
            elif _described(n.description, cluster_name):
                networks[n.name] = described
    for scope, router in aggregated("RoutersClient", "routers", "listing Cloud Routers", False):
        if why := _on_networks(router.network, networks):
            found.append(Leftover("router", router.name, _short(scope), why))
    with gcp.errors("listing firewall rules"):
        for fw in gcp.compute("FirewallsClient").list(project=gcp.project, **gcp.rpc()):
            why = _on_networks(fw.network, networks) or (described if _described(fw.description, cluster_name) else "")
            if why:
                found.append(Leftover("firewall", fw.name, "global", why))
    for scope, sub in aggregated("SubnetworksClient", "subnetworks", "listing subnetworks", False):
        why = _on_networks(sub.network, networks) or (described if _described(sub.description, cluster_name) else "")
        if why:
            found.append(Leftover("subnetwork", sub.name, _short(scope), why))
    found += [Leftover("network", name, "global", why) for name, why in sorted(networks.items())]

    if include_buckets:
        with gcp.errors("listing buckets"):
            for bucket in gcp.storage().list_buckets(project=gcp.project, timeout=REQUEST_TIMEOUT_S):
                if (bucket.labels or {}).get(CLUSTER_LABEL) == cluster_name:
                    found.append(Leftover("bucket", bucket.name, "", label))
    return sorted(found, key=lambda x: (KIND_ORDER.index(x.kind), x.location, x.name))


NETWORK_PREFIX = "dtrain-"  # infra/modules/plan: name_prefix = "dtrain-${var.cluster_name}"
_MARK_RE = re.compile(r"(?:\bdtrain cluster |\bdtrain-cluster=)([A-Za-z0-9_.-]*[A-Za-z0-9_])")


def _described(description: str, cluster_name: str) -> bool:
    """Whether a label-less resource's description names this cluster ("dtrain cluster demo",
    "dtrain-cluster=demo"), the whole name: "dtrain cluster demo-2" is not cluster demo's."""
    return cluster_name in _MARK_RE.findall(description or "")


def _on_networks(network_url: str, networks: dict[str, str]) -> str:
    net = _short(network_url)
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
