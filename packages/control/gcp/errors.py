"""One mapping from the Google libraries' errors to one-line UserErrors (`api_error`, which `Gcp.errors`
applies), and the questions asked of an error elsewhere: is it a stockout (`is_stockout`), which APIs to
enable (`enable_hint`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.gcp import client

QUOTA_PAGE = "https://console.cloud.google.com/iam-admin/quotas?project={project}"

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


# A zone without capacity for the VM (a stockout), as Compute reports it: the operation's error code, or
# the words of its message when the error comes back on the request itself (a 503) or through Terraform.
# ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS is the same stockout with "'(resource type:compute)'" added to
# the message (https://cloud.google.com/compute/docs/troubleshooting/troubleshooting-resource-availability).
# Every place that asks "is this a stockout?" asks `is_stockout`.
STOCKOUT_CODES = frozenset({"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", "STOCKOUT"})
STOCKOUT_RE = re.compile(
    r"\b(?:ZONE_RESOURCE_POOL_EXHAUSTED(?:_WITH_DETAILS)?|STOCKOUT)\b|does not have enough resources available"
)


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
                f"{cause} (still failing after {client.RETRY_DEADLINE_S:g}s of retries)", exit_code=ExitCode.FAILURE
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


def enable_hint(project: str, services: Iterable[str]) -> str:
    """The one line that says which APIs are off and how to turn them on."""
    services = list(services)
    names = ", ".join(_API_NAMES.get(s, s) for s in services)
    verb = "is" if len(services) == 1 else "are"
    command = f"gcloud services enable {' '.join(services)} --project {project}"
    return f"{names} {verb} not enabled in project {project}: {command}"


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
