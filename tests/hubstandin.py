"""A stand-in for the Hugging Face Hub's dataset endpoints, served over real HTTP on 127.0.0.1, for
the tests of `--data <hub dataset name>`: the real `datasets` and `huggingface_hub` clients talk to it
with HF_ENDPOINT set to its address.

It holds dataset repos the test builds (repo id -> {path in repo: bytes}, one commit each on `main`)
and answers what the Hub answers for them, as huggingface_hub (2.x) reads it:

- GET /api/datasets/{repo}[/revision/{rev}]: the repo's info (id, sha, siblings ...);
- GET /api/datasets/{repo}/tree/{rev}[/{path}]?recursive=: the entries under a folder;
- POST /api/datasets/{repo}/paths-info/{rev} (form: paths, expand): the entries of those paths that exist;
- HEAD/GET /datasets/{repo}/resolve/{rev}/{path}: the file, with X-Repo-Commit, ETag (the git blob
  id) and Content-Length, and byte ranges. Files stored in LFS (binary ones, as the Hub keeps Parquet)
  answer 302 to a blob URL with X-Linked-Etag (sha256) and X-Linked-Size, as the Hub redirects to its CDN.

Errors as the Hub gives them (huggingface_hub tells them apart by X-Error-Code): a repo that does not
exist is 401 RepoNotFound to a caller without a token (the Hub does not say whether a private repo
exists), a revision 404 RevisionNotFound, a file 404 EntryNotFound. Anything else is a plain 404.
Every request is logged in `requests`, so a test can tell what a client asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self._lock = threading.Lock()
        self._servers: dict[str, ThreadingHTTPServer] = {}  # "hub" and "cdn" (LFS blobs: another origin)

    def add_dataset(self, repo_id: str, files: dict[str, bytes]) -> str:
        """A dataset repo holding `files`; returns its commit id."""
        entries = {p: Entry(p, d) for p, d in files.items()}
        sha = hashlib.sha1(repo_id.encode() + b"".join(e.oid.encode() for _, e in sorted(entries.items()))).hexdigest()
        self.repos[repo_id] = Repo(repo_id, entries, sha)
        return sha

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

    def revision(self, repo: Repo, rev: str) -> bool:
        return rev in ("main", repo.sha)


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

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._repo_not_found()
        return repo

    def _rev_ok(self, repo: Repo, rev: str) -> bool:
        if self.hub.revision(repo, rev):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return False

    # ------------------------------------------------------------------ routes

    API = re.compile(
        r"^/api/datasets/(?P<repo>[^/]+/[^/]+)(?:/(?P<op>revision|tree|paths-info)/(?P<rev>[^/]+)(?P<rest>/.*)?)?$"
    )
    RESOLVE = re.compile(r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
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
        query = parse_qs(url.query)
        if m := self.API.match(url.path):
            repo = self._repo(unquote(m["repo"]))
            if repo is None:
                return
            op, rev = m["op"], unquote(m["rev"] or "main")
            if not self._rev_ok(repo, rev):
                return
            if op in (None, "revision") and self.command == "GET" and not m["rest"]:
                return self._json(self._dataset_info(repo))
            if op == "tree" and self.command == "GET":
                path = unquote((m["rest"] or "").strip("/"))
                entries = repo.tree(path, query.get("recursive", ["false"])[0].lower() == "true")
                if entries is None:
                    return self._error(404, "EntryNotFound", f'{path} does not exist on "{rev}"')
                return self._json(entries)
            if op == "paths-info" and self.command == "POST" and not m["rest"]:
                form = self._form()
                infos = [repo.entry_info(p.strip("/")) for p in form.get("paths", [])]
                return self._json([i for i in infos if i is not None])
            return self._error(404, None, "Not Found")
        if (m := self.RESOLVE.match(url.path)) and self.command in ("GET", "HEAD"):
            repo = self._repo(unquote(m["repo"]))
            if repo is None or not self._rev_ok(repo, unquote(m["rev"])):
                return
            entry = repo.files.get(unquote(m["path"]))
            if entry is None:
                return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.sha})
            if entry.lfs:  # the Hub sends LFS files from its CDN
                return self._send(
                    302,
                    b"",
                    {
                        "Location": f"{self.hub.cdn_url}/lfs-blobs/{entry.sha256}",
                        "X-Repo-Commit": repo.sha,
                        "X-Linked-Etag": f'"{entry.sha256}"',
                        "X-Linked-Size": str(len(entry.data)),
                        "ETag": f'"{entry.oid}"',
                    },
                    head=self.command == "HEAD",
                )
            return self._file(entry.data, {"X-Repo-Commit": repo.sha, "ETag": f'"{entry.oid}"'})
        self._error(404, None, "Not Found")

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

    def _dataset_info(self, repo: Repo) -> dict:
        ns = repo.repo_id.split("/")[0]
        return {
            "_id": repo.sha[:24],
            "id": repo.repo_id,
            "author": ns,
            "sha": repo.sha,
            "lastModified": CREATED,
            "createdAt": CREATED,
            "private": False,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
            "usedStorage": sum(len(e.data) for e in repo.files.values()),
        }
