"""OS Login: the account the credentials belong to, and the cluster's SSH key added to (and removed from)
its OS Login profile."""

from __future__ import annotations

import dataclasses

from dtrain.common.errors import UserError
from dtrain.control.gcp.auth import google_module
from dtrain.control.gcp.client import Gcp


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
