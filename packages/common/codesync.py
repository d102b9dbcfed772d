"""Incremental sync of a user's working directory from the launcher to a node. Standard library only:
the node half runs on machines that may have nothing else installed.

Launcher: `scan(root)` lists the files to send (honouring .gitignore and .dtrainignore) with their
sha256, which a cache keyed by (size, mtime_ns, inode) keeps from being recomputed for unchanged files.
`send` then talks to `python -m dtrain.common.codesync receive --dest D` on the node over its
stdin/stdout:

    launcher -> node   the manifest, one JSON line (Manifest.to_json)
    node -> launcher   {"need": [relpath, ...]}: files missing on the node, changed in the manifest,
                       or edited on the node since the last sync
    launcher -> node   8-byte big-endian length, then a tar (gzip level 1 when it pays) of those files
    node -> launcher   {"ok": true, "files": n, "bytes": b, "deleted": d}
                       or, at any point instead of the line expected, {"ok": false, "error": "..."}

The node keeps the manifest it last applied, with each file's (size, mtime_ns, inode) as written, in
`dest/.dtrain-manifest.json`; that is how it knows what it has without hashing anything.

Files are replaced, never rewritten in place: each is received into a staging directory inside
`dest` (same file system) and `os.replace`d over the old one. A job's snapshot (`--snapshot`) is a
hard-link copy of `dest`, so it shares inodes with it; replacing a file gives `dest` a new inode and
leaves the snapshot's old one, and its old content, alone. Writing in place would change the code
under a running job. It also makes a failed sync harmless: files already replaced no longer match the
recorded (size, mtime_ns, inode), so the next sync asks for them again.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import stat
import struct
import sys
import tarfile
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.fileops import locked, sha256_file

DEFAULT_LIMIT_BYTES = 200 * 1024 * 1024
# Excluded even without a .gitignore; a .gitignore or .dtrainignore can `!` them back.
DEFAULT_EXCLUDES = (
    "__pycache__/",
    "*.pyc",
    ".venv/",
    "venv/",
    ".mypy_cache/",
    ".pytest_cache/",
    ".ipynb_checkpoints/",
    ".DS_Store",
)
IGNORE_FILES = (".gitignore", ".dtrainignore")
STATE_FILE = ".dtrain-manifest.json"
_INCOMING_DIR = ".dtrain-incoming"  # received files wait here (same file system) until all arrived
_TMP_PREFIX = ".dtrain-tmp-"
# A file modified within this window before it was hashed may be modified again without its mtime
# changing (timestamps come from a coarse clock; some file systems keep 1 or 2 s). Such files are not
# cached, so they are hashed again next time (git's "racy clean" problem).
_RACY_WINDOW_NS = 2_000_000_000
_CHUNK = 1024 * 1024
# pack() compresses only when a sample of the files' heads shrinks below this ratio: gzip costs about
# 1 s per 60 MB of incompressible data (weights, archives) and saves nothing on it.
_COMPRESS_BELOW = 0.8
_SAMPLE_FILES, _SAMPLE_HEAD = 64, 16 * 1024
_LARGEST_SHOWN = 3


@dataclasses.dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the root, posix separators
    size: int
    mode: int  # 0o755 if executable, else 0o644
    sha256: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What `scan` found: the files and symlinks to sync, and what it left out and why."""

    root: Path
    files: dict[str, FileEntry]
    links: dict[str, str]  # relpath -> the link's target text (relative, inside root)
    skipped: tuple[tuple[str, str], ...]  # (relpath, reason): symlinks out of root, sockets, unreadable
    total_bytes: int
    digest: str  # sha256 over the sorted entries: the same tree gives the same digest

    @classmethod
    def build(
        cls, root: Path, files: dict[str, FileEntry], links: dict[str, str], skipped: Sequence[tuple[str, str]] = ()
    ) -> Manifest:
        files = dict(sorted(files.items()))
        links = dict(sorted(links.items()))
        return cls(
            root=Path(root),
            files=files,
            links=links,
            skipped=tuple(sorted((str(p), str(r)) for p, r in skipped)),
            total_bytes=sum(e.size for e in files.values()),
            digest=_digest(files, links),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "root": str(self.root),
            "files": [[e.path, e.size, e.mode, e.sha256] for e in self.files.values()],
            "links": self.links,
            "skipped": [list(s) for s in self.skipped],
            "total_bytes": self.total_bytes,
            "digest": self.digest,
        }

    def to_json(self) -> str:
        """One line of JSON (no newline in it)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        if not isinstance(d, dict) or d.get("version") != 1:
            raise ValueError("not a version 1 code sync manifest")
        files = {}
        for path, size, mode, sha in d["files"]:
            files[str(path)] = FileEntry(str(path), int(size), int(mode), str(sha))
        links = {str(p): str(t) for p, t in d["links"].items()}
        manifest = cls.build(Path(d["root"]), files, links, [tuple(s) for s in d.get("skipped", ())])
        if manifest.digest != d["digest"]:
            raise ValueError("manifest digest does not match its entries")
        return manifest

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True)
class SyncStats:
    files_sent: int
    bytes_sent: int  # the tar's size on the wire (0 when nothing was needed)
    deleted: int  # files and links removed on the node
    seconds: float


# ---------------------------------------------------------------------------------------------
# Ignore rules: gitignore's syntax and semantics, matched here (the node has no git, and neither
# may the launcher).


@dataclasses.dataclass(frozen=True)
class _Rule:
    base: str  # directory of the file the rule came from, relative to the root ("" for the root)
    regex: re.Pattern[str]  # matched against the path relative to `base`
    negate: bool
    dir_only: bool


def _translate(pattern: str) -> str:
    """A gitignore glob (already anchored: matched against the whole relative path) as a regex."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        at_segment_start = i == 0 or pattern[i - 1] == "/"
        if c == "*" and pattern.startswith("**", i) and at_segment_start and pattern.startswith("**/", i):
            out.append("(?:.*/)?")  # leading or middle **/: zero or more directories
            i += 3
        elif c == "*" and at_segment_start and pattern[i:] == "**":
            out.append(".*")  # trailing /**: everything inside
            i += 2
        elif c == "*":
            while i < n and pattern[i] == "*":
                i += 1
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = i + 1
            if j < n and pattern[j] in "!^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:  # no closing bracket: a literal "["
                out.append(re.escape(c))
                i += 1
                continue
            body = pattern[i + 1 : j]
            negate = body[:1] in ("!", "^")
            if negate:
                body = body[1:]
            chars = "".join(ch if ch == "-" else re.escape(ch) for ch in body)
            out.append(f"(?!/)[{'^' if negate else ''}{chars}]")
            i = j + 1
        elif c == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(c))
            i += 1
    return "".join(out)


def _parse_rules(text: str, base: str) -> list[_Rule]:
    rules = []
    for raw in text.splitlines():
        line = raw
        while line.endswith(" ") and not line.endswith("\\ "):
            line = line[:-1]
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate or line.startswith(("\\!", "\\#")):  # "\#": a name that starts with "#"
            line = line[1:]
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        # A slash anywhere but at the end anchors the pattern to the ignore file's directory;
        # without one it matches a name at any depth below it.
        line = line.lstrip("/") if "/" in line else "**/" + line
        rules.append(_Rule(base, re.compile(_translate(line), re.DOTALL), negate, dir_only))
    return rules


def _ignored(rel: str, is_dir: bool, rules: Sequence[_Rule]) -> bool:
    for rule in reversed(rules):  # the last rule that matches decides
        if rule.dir_only and not is_dir:
            continue
        sub = rel[len(rule.base) + 1 :] if rule.base else rel
        if rule.regex.fullmatch(sub):
            return not rule.negate
    return False


def _read_rules(directory: str, base: str, name: str) -> list[_Rule]:
    try:
        with open(os.path.join(directory, name), "rb") as f:
            return _parse_rules(f.read().decode("utf-8", "surrogateescape"), base)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError):
        return []


# ---------------------------------------------------------------------------------------------
# Launcher side: scan, pack, send.


def _digest(files: dict[str, FileEntry], links: dict[str, str]) -> str:
    h = hashlib.sha256()
    for path in sorted(files):
        e = files[path]
        h.update(f"F\0{path}\0{e.size}\0{e.mode:o}\0{e.sha256}\n".encode("utf-8", "surrogateescape"))
    for path in sorted(links):
        h.update(f"L\0{path}\0{links[path]}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _human(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _largest(sizes: dict[str, int], count: int = _LARGEST_SHOWN) -> list[tuple[str, int]]:
    """The biggest items, files or directories (shown with a trailing "/"). A directory that holds
    over 90% of the candidates is replaced by its contents, so `src/` is not the answer when `src/data/` is."""
    dir_size: dict[str, int] = {}
    children: dict[str, set[str]] = {}
    for path, size in sizes.items():
        parts = path.split("/")
        for i in range(len(parts)):
            parent, child = "/".join(parts[:i]), "/".join(parts[: i + 1])
            children.setdefault(parent, set()).add(child)
            if i < len(parts) - 1:
                dir_size[child] = dir_size.get(child, 0) + size

    def size_of(item: str) -> int:
        return dir_size[item] if item in dir_size else sizes[item]

    items = list(children.get("", ()))
    while True:
        items.sort(key=lambda p: (-size_of(p), p))
        if items and items[0] in dir_size and size_of(items[0]) > 0.9 * sum(size_of(p) for p in items):
            items[:1] = children[items[0]]
            continue
        return [(p + "/" if p in dir_size else p, size_of(p)) for p in items[:count]]


def _cache_path(root: Path, cache_dir: Path | None) -> Path:
    if cache_dir is None:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = Path(cache_home) / "dtrain" / "codesync"
    return Path(cache_dir) / f"{hashlib.sha256(os.fsencode(str(root))).hexdigest()}.json"


def _load_cache(path: Path) -> dict[str, list]:
    try:
        data = json.loads(path.read_text())
        return data["files"] if data.get("version") == 1 else {}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return {}


def _save_cache(path: Path, files: dict[str, list]) -> None:
    # The cache only saves time: failing to write it (read-only home, full disk) is not an error.
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TMP_PREFIX}{secrets.token_hex(4)}-{path.name}")
        try:
            tmp.write_text(json.dumps({"version": 1, "files": files}, separators=(",", ":")))
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def scan(
    root: Path,
    *,
    limit_bytes: int = DEFAULT_LIMIT_BYTES,
    exclude: Sequence[str] = (),
    cache_dir: Path | None = None,
) -> Manifest:
    """The files under `root` to sync: .git/, DEFAULT_EXCLUDES, .gitignore and .dtrainignore rules
    (the latter applied after the former) and `exclude` (gitignore patterns relative to root, applied
    last) left out. Raises UserError when the total is over `limit_bytes`, naming the largest items."""
    root = Path(root).resolve()
    if not root.is_dir():
        raise UserError(f"working directory {root} is not a directory")
    root_s = str(root)
    scan_started_ns = time.time_ns()
    defaults = _parse_rules("\n".join(DEFAULT_EXCLUDES), "")
    extra = _parse_rules("\n".join(exclude), "")
    found: dict[str, os.stat_result] = {}
    links: dict[str, str] = {}
    skipped: list[tuple[str, str]] = []

    def walk(directory: str, prefix: str, chains: tuple[list[_Rule], list[_Rule]]) -> None:
        base = prefix.rstrip("/")
        git_rules = chains[0] + _read_rules(directory, base, ".gitignore")
        dtrain_rules = chains[1] + _read_rules(directory, base, ".dtrainignore")
        rules = defaults + git_rules + dtrain_rules + extra
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as e:
            skipped.append((base or ".", f"unreadable directory: {e.strerror}"))
            return
        for entry in entries:
            rel = prefix + entry.name
            if entry.name == ".git":
                continue
            if entry.is_symlink():
                if _ignored(rel, False, rules):
                    continue
                target = os.readlink(entry.path)
                resolved = os.path.realpath(entry.path)
                if not os.path.exists(entry.path):
                    skipped.append((rel, f"dangling symlink to {target}"))
                elif not _inside(resolved, root_s):
                    skipped.append((rel, f"symlink to {target}, outside {root_s}"))
                else:
                    if os.path.isabs(target):  # the node has the tree elsewhere: point relatively
                        target = os.path.relpath(resolved, os.path.realpath(directory))
                    links[rel] = target
            elif entry.is_dir(follow_symlinks=False):
                if not _ignored(rel, True, rules):
                    walk(entry.path, rel + "/", (git_rules, dtrain_rules))
            elif entry.is_file(follow_symlinks=False):
                if not _ignored(rel, False, rules):
                    found[rel] = entry.stat(follow_symlinks=False)
            elif not _ignored(rel, False, rules):
                skipped.append((rel, "not a regular file, directory or symlink"))

    walk(root_s, "", ([], []))

    total = sum(st.st_size for st in found.values())
    if total > limit_bytes:
        largest = ", ".join(f"{p} {_human(s)}" for p, s in _largest({p: st.st_size for p, st in found.items()}))
        raise UserError(
            f"working directory {root} holds {_human(total)} to sync, over the {_human(limit_bytes)} limit; "
            f"largest: {largest}: add them to .dtrainignore, or raise the limit "
            "(--code-limit MB, or code_limit in the job)"
        )

    cache_file = _cache_path(root, cache_dir)
    old_cache = _load_cache(cache_file)
    new_cache: dict[str, list] = {}
    files: dict[str, FileEntry] = {}
    for rel, st in found.items():
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        cached = old_cache.get(rel)
        if isinstance(cached, list) and len(cached) == 4 and cached[:3] == key:
            sha = cached[3]
        else:
            try:
                sha = sha256_file(os.path.join(root_s, rel))
            except OSError as e:
                skipped.append((rel, f"unreadable: {e.strerror}"))
                continue
        if st.st_mtime_ns < scan_started_ns - _RACY_WINDOW_NS:
            new_cache[rel] = [*key, sha]
        mode = 0o755 if st.st_mode & 0o111 else 0o644
        files[rel] = FileEntry(rel, st.st_size, mode, sha)
    if new_cache != old_cache:
        _save_cache(cache_file, new_cache)
    return Manifest.build(root, files, links, skipped)


class _HashingReader:
    def __init__(self, f: IO[bytes]) -> None:
        self._f, self.hash = f, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self.hash.update(data)
        return data


def _worth_compressing(root: Path, paths: Sequence[str]) -> bool:
    step = max(1, len(paths) // _SAMPLE_FILES)
    sample = bytearray()
    for path in paths[::step]:
        with contextlib.suppress(OSError), open(root / path, "rb") as f:
            sample += f.read(_SAMPLE_HEAD)
    return bool(sample) and len(zlib.compress(bytes(sample), 1)) < _COMPRESS_BELOW * len(sample)


def pack(manifest: Manifest, paths: Iterable[str]) -> bytes:
    """A tar of `paths` (files of the manifest) read from its root; gzip level 1 when a sample shows
    that it pays. Raises UserError if a file no longer matches the manifest (edited since the scan)."""
    paths = list(paths)
    for path in paths:
        if path not in manifest.files:
            raise ValueError(f"{path!r} is not a file of the manifest")
    buf = io.BytesIO()
    gzip: dict[str, Any] = {"compresslevel": 1} if _worth_compressing(manifest.root, paths) else {}
    with tarfile.open(fileobj=buf, mode="w:gz" if gzip else "w", format=tarfile.PAX_FORMAT, **gzip) as tar:
        for path in paths:
            entry = manifest.files[path]
            info = tarfile.TarInfo(path)
            info.size, info.mode = entry.size, entry.mode
            changed = UserError(f"{manifest.root / path} changed while it was being synced: run again")
            try:
                with open(manifest.root / path, "rb") as f:
                    reader = _HashingReader(f)
                    tar.addfile(info, reader)  # type: ignore[arg-type]
                    if f.read(1) or reader.hash.hexdigest() != entry.sha256:
                        raise changed
            except FileNotFoundError as e:
                raise changed from e
            except OSError as e:
                if "unexpected end of data" in str(e):  # tarfile: the file shrank
                    raise changed from e
                raise UserError(f"cannot read {manifest.root / path}: {e.strerror or e}") from e
    return buf.getvalue()


def _write_line(wfile: IO[bytes], obj: dict[str, Any] | str) -> None:
    text = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    wfile.write(text.encode("utf-8", "surrogateescape") + b"\n")
    wfile.flush()


def _read_reply(rfile: IO[bytes]) -> dict[str, Any]:
    line = rfile.readline()
    if not line:
        raise UserError(
            "code sync: the node side closed the connection without replying (see its stderr)",
            exit_code=ExitCode.FAILURE,
        )
    try:
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ValueError
    except ValueError:
        raise UserError(
            f"code sync: unexpected output from the node: {line[:200]!r} (does the remote shell print to stdout?)",
            exit_code=ExitCode.FAILURE,
        ) from None
    if reply.get("ok") is False:
        raise UserError(f"code sync failed on {reply.get('error')}", exit_code=ExitCode.FAILURE)
    return reply


def send(manifest: Manifest, rfile: IO[bytes], wfile: IO[bytes]) -> SyncStats:
    """The launcher half of the protocol (module docstring). `rfile` is the node process's stdout,
    `wfile` its stdin. Raises UserError with the node's message if it fails."""
    started = time.monotonic()
    with contextlib.suppress(BrokenPipeError):  # the node quit early: its reply says why
        _write_line(wfile, manifest.to_json())
    need = _read_reply(rfile).get("need")
    if not isinstance(need, list) or not all(isinstance(p, str) and p in manifest.files for p in need):
        raise UserError(f"code sync: the node asked for files not in the manifest: {need!r:.200}")
    payload = pack(manifest, need) if need else b""
    with contextlib.suppress(BrokenPipeError):
        wfile.write(struct.pack(">Q", len(payload)))
        wfile.write(payload)
        wfile.flush()
    done = _read_reply(rfile)
    if done.get("ok") is not True:
        raise UserError(f"code sync: unexpected reply from the node: {done!r:.200}", exit_code=ExitCode.FAILURE)
    return SyncStats(
        files_sent=len(need), bytes_sent=len(payload), deleted=int(done["deleted"]), seconds=time.monotonic() - started
    )


# ---------------------------------------------------------------------------------------------
# Node side: receive.


class _Payload:
    """Reads exactly `n` bytes of `rfile`, and no more (what follows is not the tar's)."""

    def __init__(self, rfile: IO[bytes], n: int) -> None:
        self._f, self.left = rfile, n

    def read(self, size: int = -1) -> bytes:
        size = self.left if size is None or size < 0 else min(size, self.left)
        parts = []
        while size > 0:
            chunk = self._f.read(size)
            if not chunk:
                raise ValueError(f"the launcher hung up with {self.left} bytes of files still to come")
            parts.append(chunk)
            size -= len(chunk)
            self.left -= len(chunk)
        return b"".join(parts)

    def drain(self) -> None:
        while self.left:
            self.read(min(self.left, _CHUNK))


def _check_paths(manifest: Manifest) -> None:
    """Refuses paths that would land outside dest or on the sync's own files."""
    entries = [*manifest.files, *manifest.links]
    if len(set(entries)) != len(entries):
        raise ValueError("a path is both a file and a symlink in the manifest")
    names = set(entries)
    for path in entries:
        parts = path.split("/")
        if path.startswith("/") or "\0" in path or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"bad path in manifest: {path!r}")
        if parts[0] in (STATE_FILE, _INCOMING_DIR):
            raise ValueError(f"the manifest may not contain {parts[0]}")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in names:
                raise ValueError(f"{path!r} lies under a file or symlink of the same manifest")


def _parent_dirs(manifest: Manifest) -> set[str]:
    dirs = set()
    for path in [*manifest.files, *manifest.links]:
        parts = path.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return dirs


def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{secrets.token_hex(4)}-{path.name}")
    try:
        tmp.write_text(json.dumps(obj, separators=(",", ":")))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _load_state(dest: Path) -> tuple[Manifest | None, dict[str, list[int]]]:
    """The last applied manifest and each file's [size, mtime_ns, inode] as written. Creates an empty
    state in a new or empty `dest`, and refuses a non-empty directory this module did not write: the
    sync deletes whatever is not in the manifest."""
    state_file = dest / STATE_FILE
    if not state_file.exists():
        if dest.exists() and not dest.is_dir():
            raise UserError(f"code directory {dest} exists and is not a directory")
        if dest.exists() and any(p.name != _INCOMING_DIR for p in dest.iterdir()):
            raise UserError(
                f"code directory {dest} is not empty and was not written by dtrain: empty it, or pick another"
            )
        dest.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(state_file, {"version": 1, "manifest": None, "written": {}})
        return None, {}
    try:
        state = json.loads(state_file.read_text())
        manifest = Manifest.from_dict(state["manifest"]) if state.get("manifest") else None
        return manifest, {p: list(v) for p, v in state["written"].items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, {}  # unreadable: ask for everything


def _needed(dest: Path, new: Manifest, old: Manifest | None, written: dict[str, list[int]]) -> list[str]:
    need = []
    for path, entry in new.files.items():
        before = old.files.get(path) if old else None
        if before is None or (before.size, before.mode, before.sha256) != (entry.size, entry.mode, entry.sha256):
            need.append(path)
            continue
        try:
            st = os.lstat(dest / path)
        except (FileNotFoundError, NotADirectoryError):
            need.append(path)
            continue
        # Edited on the node (in place or replaced) since we wrote it: take the launcher's copy again.
        if not stat.S_ISREG(st.st_mode) or [st.st_size, st.st_mtime_ns, st.st_ino] != written.get(path):
            need.append(path)
    return need


def _unpack(payload: _Payload, incoming: Path, manifest: Manifest, need: set[str]) -> dict[str, Path]:
    """Receives the tar into `incoming` (one flat file per member), checking each against the manifest."""
    received: dict[str, Path] = {}
    if payload.left:
        with tarfile.open(fileobj=payload, mode="r|*") as tar:  # type: ignore[call-overload]
            for member in tar:
                name = member.name
                if not member.isreg() or name not in need or name in received:
                    raise ValueError(f"unexpected entry {name!r} in the files sent")
                entry = manifest.files[name]
                src = tar.extractfile(member)
                tmp = incoming / str(len(received))
                h = hashlib.sha256()
                try:
                    with open(tmp, "wb") as f:
                        while chunk := src.read(_CHUNK):  # type: ignore[union-attr]
                            h.update(chunk)
                            f.write(chunk)
                except OSError as e:  # the message names the file, not the staging copy
                    where = f"receiving {name} ({_human(entry.size)}) into {incoming.parent}"
                    raise OSError(e.errno, f"{e.strerror} {where}") from e
                if h.hexdigest() != entry.sha256:
                    raise ValueError(f"{name} arrived with a different sha256 than its manifest entry")
                os.chmod(tmp, entry.mode)
                received[name] = tmp
        payload.drain()
    missing = need - set(received)
    if missing:
        raise ValueError(f"{len(missing)} needed files were not sent, e.g. {sorted(missing)[0]}")
    return received


def _count_entries(directory: str) -> int:
    """Files and symlinks under `directory` (os.walk lists a symlink to a directory among the dirs)."""
    count = 0
    for parent, dirs, files in os.walk(directory):
        count += len(files) + sum(1 for d in dirs if os.path.islink(os.path.join(parent, d)))
    return count


def _mirror(dest: Path, manifest: Manifest) -> int:
    """Deletes what is in `dest` but not in `manifest` (directories that hold nothing of it go whole,
    which also prunes empty ones). Returns the number of files and symlinks deleted."""
    keep_dirs = _parent_dirs(manifest)
    deleted = 0

    def visit(directory: str, prefix: str) -> None:
        nonlocal deleted
        for entry in os.scandir(directory):
            rel = prefix + entry.name
            if not prefix and entry.name in (STATE_FILE, _INCOMING_DIR):
                continue
            if entry.is_dir(follow_symlinks=False):
                if rel in keep_dirs:
                    visit(entry.path, rel + "/")
                else:
                    deleted += _count_entries(entry.path)
                    shutil.rmtree(entry.path)
                continue
            if rel in manifest.files and entry.is_file(follow_symlinks=False):
                continue
            if rel in manifest.links and entry.is_symlink() and os.readlink(entry.path) == manifest.links[rel]:
                continue
            os.unlink(entry.path)
            deleted += 1

    visit(str(dest), "")
    return deleted


def _place_link(target: str, path: Path) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{secrets.token_hex(4)}-{path.name}")
    os.symlink(target, tmp)
    os.replace(tmp, path)


def _snapshot(dest: Path, manifest: Manifest, snapshot: Path) -> None:
    """Makes `snapshot` a hard-link copy of the synced tree, built beside it and swapped in."""
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(4)
    tmp = snapshot.with_name(f"{_TMP_PREFIX}{token}-{snapshot.name}")
    try:
        tmp.mkdir()
        for path in manifest.files:
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(dest / path, tmp / path)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                    raise
                shutil.copy2(dest / path, tmp / path)  # another file system, or no hard links there
        for path, target in manifest.links.items():
            (tmp / path).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, tmp / path)
        if os.path.lexists(snapshot):
            old = snapshot.with_name(f"{_TMP_PREFIX}{token}-old-{snapshot.name}")
            os.rename(snapshot, old)
            os.rename(tmp, snapshot)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        else:
            os.rename(tmp, snapshot)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return str(e) or type(e).__name__


def _receive(dest: Path, rfile: IO[bytes], wfile: IO[bytes], snapshot: Path | None) -> tuple[int, int, int]:
    line = rfile.readline()
    if not line:
        raise ValueError("the launcher closed the connection before sending the manifest")
    manifest = Manifest.from_json(line)
    _check_paths(manifest)
    if snapshot is not None and (_inside(str(snapshot), str(dest)) or _inside(str(dest), str(snapshot))):
        raise UserError(f"snapshot {snapshot} and code directory {dest} must not contain one another")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with locked(dest.parent / f"{dest.name}.lock"):
        old, written = _load_state(dest)
        need = _needed(dest, manifest, old, written)
        _write_line(wfile, {"need": need})
        header = rfile.read(8)
        if len(header) != 8:
            raise ValueError("the launcher hung up before sending the files")
        payload = _Payload(rfile, struct.unpack(">Q", header)[0])
        size = payload.left
        incoming = dest / _INCOMING_DIR
        shutil.rmtree(incoming, ignore_errors=True)  # left by a sync that died
        incoming.mkdir()
        try:
            received = _unpack(payload, incoming, manifest, set(need))
            deleted = _mirror(dest, manifest)
            for path, tmp in received.items():
                (dest / path).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, dest / path)
            for path, target in manifest.links.items():
                if not os.path.islink(dest / path):
                    (dest / path).parent.mkdir(parents=True, exist_ok=True)
                    _place_link(target, dest / path)
            now_written = {}
            for path in manifest.files:
                if path in received:
                    st = os.lstat(dest / path)
                    now_written[path] = [st.st_size, st.st_mtime_ns, st.st_ino]
                else:
                    now_written[path] = written[path]
            state = {"version": 1, "manifest": manifest.to_dict(), "written": now_written}
            _write_json_atomic(dest / STATE_FILE, state)  # last: it vouches for everything above
        finally:
            shutil.rmtree(incoming, ignore_errors=True)
        if snapshot is not None:
            _snapshot(dest, manifest, snapshot)
    return len(need), size, deleted


def receive(dest: Path, rfile: IO[bytes], wfile: IO[bytes], *, snapshot: Path | None = None) -> SyncStats:
    """The node half of the protocol (module docstring): brings `dest` (kept between runs) to the
    launcher's manifest, then makes `snapshot`, if given, a hard-link copy of it. On failure, replies
    {"ok": false, "error": ...} and raises UserError."""
    started = time.monotonic()
    dest, snapshot = Path(dest).absolute(), (Path(snapshot).absolute() if snapshot is not None else None)
    try:
        files, size, deleted = _receive(dest, rfile, wfile, snapshot)
    except Exception as e:
        message = f"{socket.gethostname()}: {_describe(e)}"
        with contextlib.suppress(OSError, ValueError):
            _write_line(wfile, {"ok": False, "error": message})
        raise UserError(message, exit_code=ExitCode.FAILURE) from e
    _write_line(wfile, {"ok": True, "files": files, "bytes": size, "deleted": deleted})
    return SyncStats(files_sent=files, bytes_sent=size, deleted=deleted, seconds=time.monotonic() - started)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.common.codesync")
    commands = parser.add_subparsers(dest="command", required=True)
    receive_cmd = commands.add_parser("receive", help="the node half of a code sync, over stdin/stdout")
    receive_cmd.add_argument("--dest", type=Path, required=True, help="the project's code directory (kept)")
    receive_cmd.add_argument("--snapshot", type=Path, help="make this a hard-link copy of dest afterwards")
    args = parser.parse_args(argv)
    try:
        receive(args.dest, sys.stdin.buffer, sys.stdout.buffer, snapshot=args.snapshot)
    except UserError as e:
        print(f"dtrain code sync: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
