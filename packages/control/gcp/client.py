"""One project's credentials and its Compute Engine / Cloud Storage / REST clients (`Gcp`), made on first
use, with the timeouts and retries of every request.

Everything in dtrain.control.gcp is plain functions over a `Gcp`, so that the commands stay thin and the
tests run against a local server that speaks the Compute REST API (tests/gcp/compute_fake.py) and
gcp-storage-emulator. The google libraries are imported inside functions: `dtrain --help` never loads them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.gcp.auth import default_credentials, google_module

# One request to the API gives up after REQUEST_TIMEOUT_S; transient errors (503, 429) are retried
# with backoff for up to RETRY_DEADLINE_S in all (the library's default would retry for 600 s).
REQUEST_TIMEOUT_S = 60.0
RETRY_DEADLINE_S = 30.0

# Google REST APIs dtrain calls without a client library (a few calls each; Gcp.rest), by name. With
# DTRAIN_GCP_API_ENDPOINT every one of them is asked at that one base URL instead (the tests' fake).
REST_APIS = {
    "serviceusage": "https://serviceusage.googleapis.com",
    "cloudresourcemanager": "https://cloudresourcemanager.googleapis.com",
    "oslogin": "https://oslogin.googleapis.com",
    "openidconnect": "https://openidconnect.googleapis.com",
}


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
        from dtrain.control.gcp.errors import api_error  # here: errors reads this module's RETRY_DEADLINE_S

        try:
            yield
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - api_error re-raises what it does not know
            mapped = api_error(e, project=self.project, doing=doing, endpoint=self.endpoint)
            if mapped is None:
                raise
            raise mapped from e


def short_name(url: str) -> str:
    """The last path segment of a Compute URL (zone, machine type, network...)."""
    return url.rstrip("/").rsplit("/", 1)[-1] if url else ""
