"""A stand-in for the Hugging Face Hub's model and dataset endpoints, served over real HTTP on 127.0.0.1,
for the tests of `--data <hub dataset name>` and `--model <hub id>`: the real `datasets`,
`transformers` and `huggingface_hub` clients talk to it with HF_ENDPOINT set to its address.

It holds repos the test builds (repo id -> {path in repo: bytes}, one commit each, on `main` and on
any tags given) and answers what the Hub answers for them, as huggingface_hub (2.x) reads it. Datasets
are under /api/datasets and /datasets, models under /api/models and at the root:

- GET /api/{models,datasets}/{repo}[/revision/{rev}]: the repo's info (id, sha, siblings, gated ...);
- GET .../tree/{rev}[/{path}]?recursive=: the entries under a folder;
- POST .../paths-info/{rev} (form: paths, expand): the entries of those paths that exist;
- HEAD/GET [/datasets]/{repo}/resolve/{rev}/{path}: the file, with X-Repo-Commit, ETag (the git blob
  id) and Content-Length, and byte ranges. Files stored in LFS (binary ones, as the Hub keeps Parquet
  and safetensors) answer 302 to a blob URL with X-Linked-Etag (sha256) and X-Linked-Size, as the Hub
  redirects to its CDN.

Repo ids: `owner/name`, or a bare `name` (the Hub's old canonical repos, `gpt2`-style). An alias (a
repo's old name, as `gpt2` is now `openai-community/gpt2`) answers 307 to the same path under the
repo's id, as the Hub redirects renamed repos. A revision is `main`, a tag, the commit id, or a prefix
of it of at least 7 hex digits (the Hub resolves short ids); every answer names the full commit.

Xet: the Hub stores new large files in Xet and sends X-Xet-Hash and X-Xet-Refresh-Route with them;
huggingface_hub with hf-xet installed then fetches them from Xet's CAS service, not over HTTP. This
stand-in does not serve Xet: it sends those headers for LFS files (as the Hub does), and answers the
refresh route (xet-read-token) 501, so a client that takes the Xet path fails loudly here instead of
quietly taking another path than users do. The tests pin the HTTP path with HF_HUB_DISABLE_XET=1
(`client_env`); docs/decisions.md ("gcpinfra") says why.

Errors as the Hub gives them (huggingface_hub tells them apart by X-Error-Code): a repo that does not
exist is 401 RepoNotFound to a caller without a token (the Hub does not say whether a private repo
exists), a revision 404 RevisionNotFound, a file 404 EntryNotFound. A gated repo's files are 401
GatedRepo without a token and 403 GatedRepo with a token it has not granted (its info and file list
stay public, as on the Hub). A rate-limited repo answers every request 429 with the Hub's RateLimit
headers. Anything else is a plain 404. Every request is logged in `requests`, so a test can tell what
a client asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".parquet", ".arrow", ".bin", ".safetensors")  # binary: kept in LFS, as the Hub does
CREATED = "2026-01-01T00:00:00.000Z"


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's bytes (what the Hub sends as a file's oid and ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclasses.dataclass
class Entry:
    path: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        """The LFS pointer file git holds in place of an LFS file."""
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n".encode()

    @property
    def oid(self) -> str:
        return git_blob_id(self.pointer if self.lfs else self.data)

    def info(self) -> dict:
        out: dict = {"type": "file", "oid": self.oid, "size": len(self.data), "path": self.path}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": len(self.data), "pointerSize": len(self.pointer)}
        return out


@dataclasses.dataclass
class Repo:
    repo_id: str
    files: dict[str, Entry]
    sha: str
    kind: str = "datasets"  # or "models": the URL prefix of its API
    tags: tuple[str, ...] = ()
    gated: bool = False
    granted: frozenset[str] = frozenset()  # tokens that may read a gated repo's files
    rate_limited: bool = False

    def revision(self, rev: str) -> bool:
        """main, a tag, the commit id or a prefix of it (7+ hex digits), as the Hub resolves them."""
        short = len(rev) >= 7 and re.fullmatch(r"[0-9a-f]+", rev) is not None and self.sha.startswith(rev)
        return rev in ("main", self.sha, *self.tags) or short

    def folders(self) -> set[str]:
        return {"/".join(p.split("/")[:i]) for p in self.files for i in range(1, p.count("/") + 1)}

    def folder_info(self, path: str) -> dict:
        under = sorted(e.oid for p, e in self.files.items() if p.startswith(path + "/"))
        return {"type": "directory", "oid": hashlib.sha1("".join(under).encode()).hexdigest(), "size": 0, "path": path}

    def entry_info(self, path: str) -> dict | None:
        if path in self.files:
            return self.files[path].info()
        return self.folder_info(path) if path in self.folders() else None

    def tree(self, path: str, recursive: bool) -> list[dict] | None:
        """Entries under folder `path` ("" is the root), folders first; None if it is not a folder."""
        if path and path not in self.folders():
            return None
        prefix = path + "/" if path else ""
        names = [p for p in (*sorted(self.folders()), *sorted(self.files)) if p.startswith(prefix)]
        if not recursive:
            names = [p for p in names if "/" not in p[len(prefix) :]]
        return [self.entry_info(p) for p in names]  # type: ignore[misc]


class Hub:
    """The stand-in: `add_dataset`, then `start()` (its URL is HF_ENDPOINT), `stop()` when done."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}  # "datasets/ID" or "models/ID" -> repo
        self.aliases: dict[str, str] = {}  # "datasets/OLD" -> the repo's id now
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self._lock = threading.Lock()
        self._servers: dict[str, ThreadingHTTPServer] = {}  # "hub" and "cdn" (LFS blobs: another origin)

    def add_dataset(self, repo_id: str, files: dict[str, bytes], **options: Any) -> str:
        """A dataset repo holding `files`; returns its commit id. Options: see `add_repo`."""
        return self.add_repo("datasets", repo_id, files, **options)

    def add_model(self, repo_id: str, files: dict[str, bytes], **options: Any) -> str:
        """A model repo holding `files`; returns its commit id. Options: see `add_repo`."""
        return self.add_repo("models", repo_id, files, **options)

    def add_repo(
        self,
        kind: str,
        repo_id: str,
        files: dict[str, bytes],
        *,
        tags: tuple[str, ...] = (),
        aliases: tuple[str, ...] = (),
        gated: bool = False,
        granted: tuple[str, ...] = (),
        rate_limited: bool = False,
    ) -> str:
        """`tags` name the repo's one commit; `aliases` are old names that redirect to `repo_id`; a
        `gated` repo's files need a token in `granted`; a `rate_limited` repo answers 429."""
        entries = {p: Entry(p, d) for p, d in files.items()}
        sha = hashlib.sha1(repo_id.encode() + b"".join(e.oid.encode() for _, e in sorted(entries.items()))).hexdigest()
        repo = Repo(repo_id, entries, sha, kind, tuple(tags), gated, frozenset(granted), rate_limited)
        self.repos[f"{kind}/{repo_id}"] = repo
        for alias in aliases:
            self.aliases[f"{kind}/{alias}"] = repo_id
        return sha

    def client_env(self) -> dict[str, str]:
        """The environment a Hugging Face client needs to use this stand-in: its URL, no download counts,
        and the HTTP download path (HF_HUB_DISABLE_XET: see the module's docstring)."""
        return {"HF_ENDPOINT": self.url, "HF_UPDATE_DOWNLOAD_COUNTS": "0", "HF_HUB_DISABLE_XET": "1"}

    def _origin(self, role: str) -> str:
        assert role in self._servers, "start() first"
        host, port = self._servers[role].server_address[:2]
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        return self._origin("hub")

    @property
    def cdn_url(self) -> str:
        return self._origin("cdn")

    def start(self) -> str:
        """Serve the Hub, and its CDN on another port (huggingface_hub treats another origin as the CDN it
        does not follow for metadata); returns the Hub's URL."""
        for role in ("hub", "cdn"):
            handler = type(f"{role.title()}Handler", (_Handler,), {"hub": self, "role": role})
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, name=f"hub-standin-{role}", daemon=True).start()
            self._servers[role] = server
        return self.url

    def stop(self) -> None:
        for server in self._servers.values():
            server.shutdown()
            server.server_close()
        self._servers.clear()

    def log(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def find(self, kind: str, segments: list[str]) -> tuple[str, str | None, list[str]]:
        """The repo id (or alias) that `segments` start with, what it resolves to (None if unknown),
        and the segments after it. `owner/name` is tried before a bare `name`."""
        for n in (2, 1):
            repo_id = "/".join(segments[:n])
            if len(segments) >= n and f"{kind}/{repo_id}" in self.repos:
                return repo_id, repo_id, segments[n:]
            if len(segments) >= n and f"{kind}/{repo_id}" in self.aliases:
                return repo_id, self.aliases[f"{kind}/{repo_id}"], segments[n:]
        n = 2 if len(segments) > 1 and segments[1] not in ("resolve", "revision", "tree", "paths-info") else 1
        return "/".join(segments[:n]), None, segments[n:]


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    role: str  # "hub" or "cdn"
    protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect of the Hub

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    # ------------------------------------------------------------------ answers

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, value: object, headers: dict[str, str] | None = None) -> None:
        self._send(
            200, json.dumps(value).encode(), {"Content-Type": "application/json; charset=utf-8", **(headers or {})}
        )

    def _error(self, status: int, code: str | None, message: str, extra: dict[str, str] | None = None) -> None:
        headers = {"Content-Type": "application/json; charset=utf-8", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), headers, head=self.command == "HEAD")

    def _repo_not_found(self) -> None:
        if self.headers.get("Authorization"):
            self._error(404, "RepoNotFound", "Repository not found")
        else:  # the Hub does not tell an anonymous caller whether a private repo exists
            self._error(401, "RepoNotFound", "Invalid username or password.")

    def _rev_ok(self, repo: Repo, rev: str) -> bool:
        if repo.revision(rev):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return False

    def _rate_limited(self) -> None:
        # The Hub's IETF RateLimit headers (huggingface_hub reads them; r=0: none left, t: seconds to reset).
        self._error(
            429,
            None,
            "Too Many Requests",
            {"RateLimit": '"api";r=0;t=0', "RateLimit-Policy": '"fixed window";"api";q=500;w=300'},
        )

    def _gate(self, repo: Repo) -> bool:
        """Whether the caller may read a gated repo's files; answers 401/403 GatedRepo if not."""
        if not repo.gated:
            return True
        kind = repo.kind[:-1]
        auth = self.headers.get("Authorization", "")
        if not auth:
            self._error(
                401,
                "GatedRepo",
                f"Access to {kind} {repo.repo_id} is restricted. You must have access to it and be authenticated "
                "to access it. Please log in.",
            )
            return False
        if auth.removeprefix("Bearer ").strip() not in repo.granted:
            self._error(
                403,
                "GatedRepo",
                f"Access to {kind} {repo.repo_id} is restricted and you are not in the authorized list. "
                f"Visit {self.hub.url}/{repo.repo_id} to ask for access.",
            )
            return False
        return True

    # ------------------------------------------------------------------ routes

    BLOB = re.compile(r"^/lfs-blobs/(?P<sha256>[0-9a-f]{64})$")

    def do_GET(self) -> None:
        self._route()

    def do_HEAD(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def _route(self) -> None:
        self.hub.log(self.command, self.path if self.role == "hub" else f"cdn:{self.path}")
        url = urlsplit(self.path)
        if self.role == "cdn":
            return self._blob(url.path)
        segments = [unquote(s) for s in url.path.strip("/").split("/")]
        if segments[:1] == ["api"] and segments[1:2] in (["models"], ["datasets"]):
            return self._api(segments[1], segments[2:], url)
        kind = "datasets" if segments[:1] == ["datasets"] else "models"
        rest = segments[1:] if kind == "datasets" else segments
        if "resolve" in rest and self.command in ("GET", "HEAD"):
            return self._resolve(kind, rest, url)
        self._error(404, None, "Not Found")

    def _lookup(self, kind: str, segments: list[str], url: Any) -> tuple[Repo, list[str]] | None:
        """The repo the path names, and the segments after its id; None when answered already (an
        alias's redirect, a rate limit, a repo that does not exist)."""
        name, repo_id, rest = self.hub.find(kind, segments)
        if repo_id is not None and repo_id != name:  # an old name: the Hub redirects to the repo's id
            location = url.path.replace(f"/{name}/", f"/{repo_id}/", 1) if rest else url.path[: -len(name)] + repo_id
            self._send(307, b"", {"Location": location + (f"?{url.query}" if url.query else "")}, head=True)
            return None
        repo = self.hub.repos.get(f"{kind}/{repo_id}") if repo_id else None
        if repo is None:
            self._repo_not_found()
            return None
        if repo.rate_limited:
            self._rate_limited()
            return None
        return repo, rest

    def _api(self, kind: str, segments: list[str], url: Any) -> None:
        found = self._lookup(kind, segments, url)
        if found is None:
            return
        repo, rest = found
        op, rev = (rest[0], rest[1]) if len(rest) >= 2 else (None, "main")
        if rest and op is None:
            return self._error(404, None, "Not Found")
        if not self._rev_ok(repo, rev):
            return
        query = parse_qs(url.query)
        if op in (None, "revision") and self.command == "GET" and len(rest) <= 2:
            return self._json(self._repo_info(repo))
        if op == "tree" and self.command == "GET":
            path = "/".join(rest[2:]).strip("/")
            entries = repo.tree(path, query.get("recursive", ["false"])[0].lower() == "true")
            if entries is None:
                return self._error(404, "EntryNotFound", f'{path} does not exist on "{rev}"')
            return self._json(entries)
        if op == "paths-info" and self.command == "POST" and len(rest) == 2:
            form = self._form()
            infos = [repo.entry_info(p.strip("/")) for p in form.get("paths", [])]
            return self._json([i for i in infos if i is not None])
        if op == "xet-read-token":  # the Xet path (see the module's docstring): not served here
            return self._error(501, None, "Xet is not served by this Hub stand-in (set HF_HUB_DISABLE_XET=1)")
        self._error(404, None, "Not Found")

    def _resolve(self, kind: str, segments: list[str], url: Any) -> None:
        found = self._lookup(kind, segments, url)
        if found is None:
            return
        repo, rest = found
        if len(rest) < 3 or rest[0] != "resolve":
            return self._error(404, None, "Not Found")
        rev, path = rest[1], "/".join(rest[2:])
        if not self._rev_ok(repo, rev) or not self._gate(repo):
            return
        entry = repo.files.get(path)
        if entry is None:
            return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.sha})
        if entry.lfs:  # the Hub sends LFS files from its CDN, and says where Xet has them
            api = f"{self.hub.url}/api/{repo.kind}/{repo.repo_id}"
            return self._send(
                302,
                b"",
                {
                    "Location": f"{self.hub.cdn_url}/lfs-blobs/{entry.sha256}",
                    "X-Repo-Commit": repo.sha,
                    "X-Linked-Etag": f'"{entry.sha256}"',
                    "X-Linked-Size": str(len(entry.data)),
                    "ETag": f'"{entry.oid}"',
                    "X-Xet-Hash": hashlib.sha256(b"xet" + entry.data).hexdigest(),
                    "X-Xet-Refresh-Route": f"{api}/xet-read-token/{repo.sha}",
                },
                head=self.command == "HEAD",
            )
        self._file(entry.data, {"X-Repo-Commit": repo.sha, "ETag": f'"{entry.oid}"'})

    def _blob(self, path: str) -> None:
        """The CDN: an LFS file's bytes by their sha256."""
        m = self.BLOB.match(path)
        files = (e for r in self.hub.repos.values() for e in r.files.values() if e.lfs)
        blob = next((e for e in files if m and e.sha256 == m["sha256"]), None)
        if blob is None or self.command not in ("GET", "HEAD"):
            return self._send(404, b"Not Found", {"Content-Type": "text/plain"}, head=self.command == "HEAD")
        self._file(blob.data, {"ETag": f'"{blob.sha256}"'})

    def _form(self) -> dict[str, list[str]]:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            data = json.loads(body or "{}")
            return {k: v if isinstance(v, list) else [v] for k, v in data.items()}
        return parse_qs(body)

    def _file(self, data: bytes, headers: dict[str, str]) -> None:
        """A file's bytes, or the byte range asked for (206), as the Hub and its CDN serve them."""
        headers = {"Content-Type": "application/octet-stream", "Accept-Ranges": "bytes", **headers}
        head = self.command == "HEAD"
        rng = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "").strip())
        if not rng or (rng[1] == "" and rng[2] == ""):
            return self._send(200, data, headers, head=head)
        if rng[1] == "":  # the last N bytes
            start, end = max(0, len(data) - int(rng[2])), len(data) - 1
        else:
            start, end = int(rng[1]), min(int(rng[2]) if rng[2] else len(data) - 1, len(data) - 1)
        if start >= len(data) or start > end:
            return self._send(416, b"", {**headers, "Content-Range": f"bytes */{len(data)}"}, head=head)
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self._send(206, data[start : end + 1], headers, head=head)

    def _repo_info(self, repo: Repo) -> dict:
        ns = repo.repo_id.split("/")[0] if "/" in repo.repo_id else repo.repo_id
        return {
            "_id": repo.sha[:24],
            "id": repo.repo_id,
            "author": ns,
            "sha": repo.sha,
            "lastModified": CREATED,
            "createdAt": CREATED,
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
            "usedStorage": sum(len(e.data) for e in repo.files.values()),
        }
