"""Who may talk to the dashboard.

Bound to a loopback address (the default), the dashboard is as private as the machine: no token, but
a request must name a loopback host in its Host header, so a web page whose domain resolves to
127.0.0.1 (DNS rebinding) cannot read it, and a state-changing request from a page of another origin
is refused (a browser sends Origin with those).

Bound to any other address, every request needs the token: `Authorization: Bearer TOKEN` (the API,
scripts), or the session cookie a page visit with `?token=TOKEN` sets, after which the browser is
sent to the same page without it (so the token leaves the address bar and the history). The cookie
holds a value derived from the token, not the token, and is HttpOnly and SameSite=Strict (other
sites' pages cannot make the browser send it). The token is generated once, stored 0600 in dtrain's
config directory and printed once, when it is made; it is never logged: the access log records
paths without their query string.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError
from dtrain.control.cluster import config_dir

COOKIE = "dtrain_dashboard"
TOKEN_FILE = "dashboard-token"
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_path() -> Path:
    return config_dir() / TOKEN_FILE


def load_or_create_token(*, renew: bool = False) -> tuple[str, bool]:
    """The dashboard's token and whether it was made just now (the caller shows it then, and only then).
    The file is created 0600 and a readable-by-others one is refused rather than used."""
    path = token_path()
    if path.exists() and not renew:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise UserError(
                f"{path} is readable by other users (mode {mode:o}): chmod 600 it, or pass --new-token to replace it"
            )
        token = path.read_text().strip()
        if len(token) >= 32:
            return token, False
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{TOKEN_FILE}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token, True


def session_value(token: str) -> str:
    return hmac.new(token.encode(), b"dtrain-dashboard-session", hashlib.sha256).hexdigest()


class Guard:
    """ASGI middleware in front of everything (pages, API, streams, /docs): the checks above."""

    def __init__(self, app: ASGIApp, *, token: str | None, port: int) -> None:
        self.app = app
        self.token = token
        self.session = session_value(token) if token else None
        self.port = port

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.token is None:
            refusal = self._local_refusal(scope, headers)
        else:
            query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if "token" in query:
                await self._login(scope, query, send)
                return
            refusal = None if self._authorised(headers) else (401, "this dashboard needs its token")
        if refusal is None and scope["method"] in UNSAFE_METHODS and not _same_origin(headers):
            refusal = (403, "refused: a request from a page of another origin")
        if refusal is not None:
            await _refuse(scope, send, *refusal)
            return
        await self.app(scope, receive, send)

    def _local_refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str] | None:
        host = _host_name(headers.get("host", ""))
        if not is_loopback(host):
            return 421, f"refused: this dashboard answers to localhost only, not {host or 'no Host header'}"
        return None

    def _authorised(self, headers: dict[str, str]) -> bool:
        assert self.token is not None and self.session is not None
        scheme, _, given = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return True
        cookie = _cookies(headers.get("cookie", "")).get(COOKIE, "")
        return hmac.compare_digest(cookie.encode(), self.session.encode())

    async def _login(self, scope: Scope, query: dict[str, list[str]], send: Any) -> None:
        """`?token=` on a page: set the session cookie and send the browser to the page without it."""
        assert self.token is not None and self.session is not None
        given = query.pop("token")[0]
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            await _refuse(scope, send, 401, "wrong token")
            return
        rest = urllib.parse.urlencode(query, doseq=True)
        location = scope.get("root_path", "") + scope["path"] + (f"?{rest}" if rest else "")
        cookie = f"{COOKIE}={self.session}; Path=/; HttpOnly; SameSite=Strict"
        await send(
            {
                "type": "http.response.start",
                "status": 303,
                "headers": [
                    (b"location", location.encode()),
                    (b"set-cookie", cookie.encode()),
                    (b"cache-control", b"no-store"),
                    (b"content-length", b"0"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:8765" -> "::1")."""
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _same_origin(headers: dict[str, str]) -> bool:
    origin = headers.get("origin")
    if origin is None:
        return True  # not a browser's cross-origin request: browsers send Origin on POST/DELETE
    return urllib.parse.urlsplit(origin).netloc == headers.get("host", "")


def _cookies(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name:
            out[name] = value
    return out


async def _refuse(scope: Scope, send: Any, status: int, message: str) -> None:
    if scope["path"].startswith("/api/"):
        body, kind = json.dumps({"detail": message}).encode(), b"application/json"
    else:
        hint = ""
        if status == 401:
            hint = " (open the link `dtrain dashboard` printed, or send Authorization: Bearer TOKEN)"
        body, kind = f"{status}: {message}{hint}\n".encode(), b"text/plain; charset=utf-8"
    headers = [(b"content-type", kind), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
