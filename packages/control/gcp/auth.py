"""The Google libraries and credentials, in one place (the model is SkyPilot's sky/adaptors/gcp.py).

Every import of a google package goes through `google_module`, so a missing extra is one line with
the install hint, and `dtrain --help` never loads them. Every use of Application Default Credentials
goes through `default_credentials`, so each failure reads the same wherever it happens (up, status,
a push to Artifact Registry) and never quotes a key file's contents.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from dtrain.common.errors import UserError

INSTALL_HINT = "pip install 'dtrain[gcp]'"
SCOPES = ("https://www.googleapis.com/auth/cloud-platform",)
MODULES = {
    "compute": "google.cloud.compute_v1",
    "storage": "google.cloud.storage",
    "auth": "google.auth",
    "auth.exceptions": "google.auth.exceptions",
    "auth.requests": "google.auth.transport.requests",
    "api_core.exceptions": "google.api_core.exceptions",
}


def google_module(what: str, *, needed_for: str = "the gcp backend") -> Any:
    """One google module by its short name (MODULES), or a UserError with the install hint."""
    try:
        return importlib.import_module(MODULES[what])
    except ImportError as e:
        raise UserError(
            f"{needed_for} needs the Google Cloud libraries ({e.name} is missing): {INSTALL_HINT}"
        ) from None


def default_credentials(*, purpose: str = "") -> tuple[Any, str | None]:
    """Application Default Credentials and their project (None if they name none); one line saying
    what to do when there are none or the key file is unusable. `purpose` ("to push to HOST") says
    what they were wanted for, where that is not the gcp backend itself."""
    needed_for = f"the credentials {purpose}" if purpose else "the gcp backend"
    auth = google_module("auth", needed_for=needed_for)
    exceptions = google_module("auth.exceptions", needed_for=needed_for)
    for_what = f" {purpose}" if purpose else ""
    try:
        return auth.default(scopes=list(SCOPES))
    except exceptions.DefaultCredentialsError as e:
        # Never the library's message: for a malformed key file it can quote the contents.
        key_file = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        if key_file:
            raise UserError(
                f"GOOGLE_APPLICATION_CREDENTIALS={key_file} is not a usable credentials file{for_what} "
                f"({type(e).__name__}): point it at a service-account key file, or unset it and run "
                "gcloud auth application-default login"
            ) from None
        raise UserError(
            f"no Google credentials{for_what}: run gcloud auth application-default login "
            "(or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file)"
        ) from None


def account_email(credentials: Any) -> str | None:
    """The e-mail the credentials name themselves, when they do (a service account's key or the
    metadata server's account once refreshed); None for a user's credentials, which carry none."""
    email = getattr(credentials, "service_account_email", None)
    return email if isinstance(email, str) and "@" in email else None


def access_token(credentials: Any, *, needed_for: str) -> str:
    """A fresh OAuth access token from `credentials` (never printed or logged)."""
    exceptions = google_module("auth.exceptions", needed_for=needed_for)
    requests = google_module("auth.requests", needed_for=needed_for)
    try:
        credentials.refresh(requests.Request())
    except (exceptions.RefreshError, exceptions.TransportError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"could not get a Google access token for {needed_for} ({first[:160]}): "
            "run `gcloud auth application-default login` again, or check the network"
        ) from None
    return credentials.token
