"""Copies a job's local checkpoint directory to the run's store, and puts the newest complete copy back.

dtrain gives the user's script a local directory on every node (DTRAIN_CHECKPOINT_DIR). The script
saves there as it likes (`torch.save(state, ckpt_dir / "ckpt.pt")`) and loads what it finds; it is not
changed. A `Mirror` on each node copies that directory to the run's `ckpt/` store in the background and
once more when the job ends; before a restarted or resumed job starts, `restore` puts the newest
complete copy back. A `Forward` sends a local append-only file (the SDK's metrics JSONL) to a store
file on the same background thread. Standard library only.

Layout under the store (the run's `ckpt/` prefix):

    blobs/<sha256>             one file's bytes, named by their sha256: uploaded once, shared by every
                               manifest (and node) that has the same bytes
    node-00000/00000007.json   node 0's directory at one moment: {"seq", "node", "time",
                               "files": {relpath: {"sha256", "size", "mtime_ns"}}}
    node-00000/pending.json    the blobs node 0 is uploading for its next manifest (so no GC takes them)

Why a manifest is written last, and what it may take: blobs are just bytes; only a manifest says which
of them form a checkpoint. Written after every blob it names is in the store, a manifest is never visible
before its checkpoint is whole, and `restore` checks that again (each blob present with its size, each
download's sha256), falling back to an older manifest otherwise, so a half-copied checkpoint is never
restored. A manifest takes a file only once it is known to be whole, and never a file some process of the
job has open for writing:
- a checkpoint folder whose format says when it is whole (dtrain's step-N once its meta.json lists every
  file at its size; HF Trainer's checkpoint-N once trainer_state.json, written last, is there; a path the
  program marked with dtrain.sdk.checkpoint_saved, while its files are as marked), and a single-file
  checkpoint (PyTorch Lightning's `.ckpt`, once closed; after a kill, not), is taken at the first scan that
  finds it so, whatever else in the directory is still changing;
- the rest of the directory is taken as one: when no temporary file is being written (a save under way)
  and either each changed file arrived by a rename (a new inode: `torch.save` to a temporary name, then
  `os.replace`), or it is a lone file (after a kill, not: a closed file may be one cut off mid-write), or
  every file is settled: its (size, mtime, inode) unchanged since the previous settle scan, an interval
  ago. Otherwise the rest keeps its last copy whole: a checkpoint of several files caught mid-write
  (model.pt done, optim.pt not yet) is never saved as the new model next to the old optimizer.
The thread scans every QUICK_SCAN_S for whole checkpoints, and every `interval_s` by the settle rule too.
What the rules cannot see is a writer that pauses for longer than an interval between two files of one
checkpoint written in place; a format with its own completion marker is safe from that.

Garbage collection, after each new manifest: a node deletes its own manifests but the newest `keep`,
then every blob that no manifest or pending.json of any node names. pending.json is written before a
node checks or uploads the blobs of its next manifest and deleted after the manifest, so a long upload
on one node is not collected by another; a GC that cannot read a listed manifest or pending.json
deletes no blob that round.

When two nodes' manifests name the same path with different bytes, `restore` takes the copy with the
newer mtime (a restored file keeps its recorded mtime, so a stale copy that another node got from an
earlier restore never wins over a fresh save).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable, Container, Iterable, Sequence
from pathlib import Path
from typing import Any

from dtrain.common.fileops import sha256_file
from dtrain.common.storage import Store

BLOBS = "blobs"
PENDING = "pending.json"
_MANIFEST_RE = re.compile(r"node-(\d{5})/(\d{8})\.json")
_PENDING_RE = re.compile(r"node-(\d{5})/pending\.json")
_SHA_RE = re.compile(r"[0-9a-f]{64}")

Log = Callable[[str], None]
# How often the thread looks for checkpoints that say they are whole (between the settle scans, every
# interval_s): such a checkpoint is copied within this much of its save.
QUICK_SCAN_S = 2.0
# Checkpoint folders whose format says when they are whole, by the file written last: dtrain's own
# (dtrain.common.checkpoint: meta.json, after state.pt, listing every file with its size) and HF Trainer's
# (Trainer._save_checkpoint writes trainer_state.json after the model, optimizer, scheduler and RNG state).
_DTRAIN_STEP_RE = re.compile(r"step-\d{8}")
DTRAIN_META = "meta.json"
_HF_CHECKPOINT_RE = re.compile(r"checkpoint-\d+")
HF_TRAINER_STATE = "trainer_state.json"
# Checkpoint files that are whole checkpoints on their own: PyTorch Lightning's (ModelCheckpoint writes each as one
# `.ckpt`, to a temporary file moved into place, mostly under a new name, where no earlier inode tells a rename).
# Whole once closed, unless the job was killed (then one written in place may be cut off).
SINGLE_FILE_SUFFIX = ".ckpt"
# What dtrain.sdk.checkpoint_saved writes at the root of the checkpoint directory: {"units": {path: {file:
# [size, mtime_ns]}}}, each path (a file or a folder) a checkpoint the program says is whole, as it stood.
# Hidden, so it is never copied itself.
SDK_MARKER = ".dtrain-complete.json"
# What "unchanged since the previous scan" compares: size, mtime, and the inode (a file replaced by a
# rename is a different file even when size and mtime agree).
_Key = tuple[int, int, int]


def node_prefix(node: int) -> str:
    return f"node-{node:05d}"


def manifest_name(node: int, seq: int) -> str:
    return f"{node_prefix(node)}/{seq:08d}.json"


def blob_name(sha: str) -> str:
    return f"{BLOBS}/{sha}"


def is_temporary(name: str) -> bool:
    """Names that are never copied (files, or directories and everything under them): hidden names
    (which covers `.x.tmp`), editor backups, and the usual suffixes of a file still being written."""
    return name.startswith(".") or name.endswith(("~", ".tmp", ".partial"))


@dataclasses.dataclass(frozen=True)
class SyncResult:
    uploaded_files: int = 0
    uploaded_bytes: int = 0
    manifest: int | None = None  # the seq this sync wrote, if it wrote one
    waiting: tuple[str, ...] = ()  # files not settled yet: no manifest until they are


@dataclasses.dataclass(frozen=True)
class RestoreResult:
    manifests: dict[int, int]  # node -> seq of the manifest restored from
    files: int  # files downloaded
    bytes: int  # bytes downloaded
    present: int = 0  # files already there with the right bytes (not downloaded)
    left_alone: tuple[str, ...] = ()  # local files the restored set does not name (not touched)


class Mirror:
    """Copies `local_dir` to `store` (the run's ckpt/ prefix) for one node; see the module docstring.

    `pids` gives the job's process tree, whose open files are checked for writers (None: every
    process of this uid). `forwards` are synced on the same thread, before the checkpoint files.
    """

    def __init__(
        self,
        local_dir: Path,
        store: Store,
        *,
        node: int,
        interval_s: float = 30.0,
        keep: int = 3,
        pids: Callable[[], Iterable[int]] | None = None,
        forwards: Sequence[Forward] = (),
        log: Log = print,
    ) -> None:
        if node < 0:
            raise ValueError(f"node must be >= 0, got {node}")
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.local_dir = Path(local_dir)
        self.store = store
        self.node = node
        self.interval_s = interval_s
        self.keep = keep
        self.forwards = tuple(forwards)
        self.log = log
        self._pids = pids
        self.quick_s = min(QUICK_SCAN_S, interval_s)
        self._seen: dict[str, _Key] = {}  # each file's key at the previous settle scan (sync())
        self._last_keys: dict[str, _Key] = {}  # each file's key at the previous scan of either kind
        self._renamed: set[str] = set()  # files whose present bytes arrived by a rename (a new inode)
        self._hashes: dict[str, tuple[_Key, str]] = {}  # sha256 of each file, valid while its key holds
        self._saved: dict[str, tuple[str, int]] | None = None  # (sha, size) per file in the last manifest
        self._last: dict[str, dict[str, Any]] = {}  # the last manifest's files: what a copy keeps of a file not whole
        self._seq = 0  # the newest manifest seq of this node
        self._loaded = False
        self._manifests: dict[str, dict[str, Any]] = {}  # parsed manifests by name: immutable once written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Syncs every `interval_s` on a daemon thread until close()."""
        if self._thread is not None:
            raise RuntimeError("Mirror.start() called twice")
        self._thread = threading.Thread(target=self._run, name=f"dtrain-mirror-{self.node}", daemon=True)
        self._thread.start()

    def close(self, *, final: bool = True) -> SyncResult:
        """Stops the thread and syncs once more. final: the job's processes ended by themselves, so its files
        are as it meant them: take them as they are. Not final (the job was killed, mid-save perhaps): only
        what the usual rule finds settled, so a checkpoint cut off by the kill is not the newest copy."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.sync(final=final, killed=not final)

    def _run(self) -> None:
        next_settle = time.monotonic() + self.interval_s
        while not self._stop.wait(self.quick_s):
            settle = time.monotonic() >= next_settle
            if settle:
                next_settle = time.monotonic() + self.interval_s
            try:
                self.sync(quick=not settle)
            except Exception as e:  # a flaky network must not end the copying: try again next tick
                self.log(
                    f"checkpoint mirror: copy to {self.store.url} failed ({type(e).__name__}: {e}); "
                    f"trying again in {self.quick_s:g}s"
                )

    def sync(self, *, final: bool = False, quick: bool = False, killed: bool = False) -> SyncResult:
        """One scan: forwards first, then the checkpoint files. A forward's failure is logged, never
        raised, so metrics never hold back a checkpoint; the checkpoint's failure is raised.

        A settle scan (quick=False) also takes files by the settle rule: unchanged since the previous settle
        scan. A quick one takes only what is known to be whole (see `_ready`). killed: the job's processes were
        killed, so a closed file may be one cut off mid-write: a lone file is not whole for being closed."""
        with self._lock:
            for fwd in self.forwards:
                try:
                    fwd.sync()
                except Exception as e:
                    self.log(f"checkpoint mirror: forwarding {fwd.local_path} failed ({type(e).__name__}: {e})")
            return self._sync_files(final, quick, killed)

    def _sync_files(self, final: bool, quick: bool = False, killed: bool = False) -> SyncResult:
        if not self._loaded:
            self._load()
        found, temporaries = _scan(self.local_dir)
        keys = {rel: _key(st) for rel, st in found.items()}
        pids = None if self._pids is None else list(self._pids())
        inodes = {(st.st_dev, st.st_ino) for st in found.values()}
        writing = _open_for_writing(inodes | temporaries, pids)
        busy = {rel for rel, st in found.items() if (st.st_dev, st.st_ino) in writing}
        saving = bool(writing - inodes)  # a temporary file is being written: a save is under way
        for rel, key in keys.items():  # which files' present bytes arrived by a rename
            before = self._last_keys.get(rel)
            if before != key:
                self._renamed.discard(rel)
                if before is not None and before[2] != key[2]:
                    self._renamed.add(rel)
        self._renamed &= set(keys)
        self._last_keys = keys
        unchanged = {rel for rel in found if final or self._seen.get(rel) == keys[rel]}
        settled = unchanged if not quick else {rel for rel in found if final}
        if not quick:
            self._seen = keys
        self._hashes = {rel: v for rel, v in self._hashes.items() if rel in found}
        take, keep, waiting = self._ready(keys, busy, settled, unchanged, saving, lone_is_whole=not killed)
        files = {rel: e for rel, e in self._last.items() if rel in keep}
        for rel in take:
            sha = self._sha256(rel, keys[rel])
            if sha is None:  # changed while being read: it was not whole after all
                return SyncResult(waiting=(rel,))
            files[rel] = {"sha256": sha, "size": keys[rel][0], "mtime_ns": keys[rel][1]}
        # An empty directory saves nothing: it must not become the newest copy of a saved checkpoint.
        if not files or _content(files) == self._saved:
            return SyncResult(waiting=waiting)
        result = self._save(files)
        return dataclasses.replace(result, waiting=result.waiting or waiting)

    def _ready(
        self,
        keys: dict[str, _Key],
        busy: set[str],
        settled: set[str],
        unchanged: set[str],
        saving: bool,
        *,
        lone_is_whole: bool,
    ) -> tuple[list[str], set[str], tuple[str, ...]]:
        """(files to copy as they are now, files whose last copy stands in for them, files waiting).

        A checkpoint folder that says it is whole (dtrain's step-N with its meta.json, HF Trainer's
        checkpoint-N with its trainer_state.json, a path the program marked with dtrain.sdk.checkpoint_saved),
        or a closed single-file checkpoint (a `.ckpt`, not after a kill), is copied as soon as it is, whatever
        else is still changing. The rest (other files, and such folders not whole yet) go together, as one
        checkpoint, when none is open for writing, no temporary file is, and either each changed file arrived
        by a rename, or there is only one file, or every file is settled (the settle rule, on settle scans);
        otherwise the rest keeps its last copy, so no copy mixes a new file with an old one of another save."""
        take: list[str] = []
        whole_units: list[str] = []
        for prefix, (members, whole) in _units(self.local_dir, keys, killed=not lone_is_whole).items():
            if whole and not members & busy:
                take += members
                whole_units.append(prefix)
        rest = [rel for rel in keys if not any(_under(rel, p) for p in whole_units)]
        changed = {rel for rel in rest if _content_of(self._last.get(rel)) != keys[rel][:2]}
        whole = not saving and not busy & set(rest)
        lone = lone_is_whole and len(rest) == 1
        whole = whole and (all(r in self._renamed for r in changed) or lone or set(rest) <= settled)
        if whole:
            return sorted(take + rest), set(), ()
        # the rest keeps its last copy, whole, as it was: none of it is mixed with what changed since
        keep = {rel for rel in self._last if not any(_under(rel, p) for p in whole_units)}
        waiting = (rel for rel in rest if rel in busy or (rel not in unchanged and rel in changed))
        return sorted(take), keep, tuple(sorted(waiting))

    def _load(self) -> None:
        """Continues this node's manifests after a relaunch: the next seq, and the last saved set (if
        complete) so an unchanged directory is not saved again."""
        seqs = [int(m.group(2)) for n in self.store.list(node_prefix(self.node)) if (m := _MANIFEST_RE.fullmatch(n))]
        if seqs:
            self._seq = max(seqs)
            manifest = _read_manifest(self.store, manifest_name(self.node, self._seq), self.log)
            if manifest is not None and _incomplete(self.store, manifest["files"], None, {}) is None:
                self._saved, self._last = _content(manifest["files"]), dict(manifest["files"])
        self._loaded = True

    def _sha256(self, rel: str, key: _Key) -> str | None:
        cached = self._hashes.get(rel)
        if cached is not None and cached[0] == key:
            return cached[1]
        path = self.local_dir / rel
        try:
            sha = sha256_file(path)
            after = _key(os.stat(path))
        except FileNotFoundError:
            return None
        if after != key:
            return None
        self._hashes[rel] = (key, sha)
        return sha

    def _save(self, files: dict[str, dict[str, Any]]) -> SyncResult:
        needed = {e["sha256"]: (rel, e["size"]) for rel, e in sorted(files.items())}  # one copy per content
        pending = f"{node_prefix(self.node)}/{PENDING}"
        _write_json(self.store, pending, {"node": self.node, "time": time.time(), "blobs": sorted(needed)})
        uploaded = nbytes = 0
        for sha, (rel, size) in needed.items():
            if _blob_size(self.store, sha) == size:
                continue
            try:  # whole, in memory: Store.write_bytes takes bytes (one upload, visible only when complete)
                data = (self.local_dir / rel).read_bytes()
            except FileNotFoundError:
                data = b""
            if hashlib.sha256(data).hexdigest() != sha:
                # Changed since it was hashed, though it looked settled: it must settle again.
                self._seen.pop(rel, None)
                return SyncResult(uploaded, nbytes, waiting=(rel,))
            self.store.write_bytes(blob_name(sha), data)
            uploaded += 1
            nbytes += len(data)
        seq = self._seq + 1
        name = manifest_name(self.node, seq)
        manifest = {"seq": seq, "node": self.node, "time": time.time(), "files": files}
        _write_json(self.store, name, manifest)
        self._seq, self._saved, self._last = seq, _content(files), dict(files)
        self._manifests[name] = manifest
        self.store.delete(pending)
        self.log(
            f"checkpoint mirror: node {self.node} saved {len(files)} file(s) as manifest {seq} "
            f"({uploaded} uploaded, {nbytes:,} bytes)"
        )
        try:
            self._collect()
        except Exception as e:  # the checkpoint is saved; an old one left behind is collected next time
            self.log(f"checkpoint mirror: garbage collection failed ({type(e).__name__}: {e})")
        return SyncResult(uploaded, nbytes, seq)

    def _collect(self) -> None:
        names = self.store.list()
        own = sorted(n for n in names if (m := _MANIFEST_RE.fullmatch(n)) and int(m.group(1)) == self.node)
        dropped = set(own[: -self.keep])
        for name in sorted(dropped):
            self.store.delete(name)
            self._manifests.pop(name, None)
        referenced: set[str] = set()
        for name in names:
            if name in dropped:
                continue
            if _MANIFEST_RE.fullmatch(name):
                manifest = self._manifests.get(name) or _read_manifest(self.store, name, self.log)
                if manifest is None:
                    self.log(f"checkpoint mirror: cannot read {self.store.join(name)}; deleting no blobs this time")
                    return
                self._manifests[name] = manifest
                referenced.update(e["sha256"] for e in manifest["files"].values())
            elif _PENDING_RE.fullmatch(name):
                try:
                    referenced.update(json.loads(self.store.read_bytes(name))["blobs"])
                except (FileNotFoundError, ValueError, KeyError, TypeError):
                    # Gone: its node has just written a manifest this listing did not see.
                    return
        for name in names:
            if name.startswith(f"{BLOBS}/") and name[len(BLOBS) + 1 :] not in referenced:
                self.store.delete(name)


class Forward:
    """Forwards the whole lines appended to `local_path` to `store`'s `rel`, each once.

    The offset sent so far is kept in `<local_path>.fwd`, so a relaunched agent goes on where the last
    one stopped. It is written after the append: a crash between the two sends those lines again (at
    least once, never lost). A local file shorter than the offset was started over, and is sent from
    its beginning.
    """

    def __init__(self, local_path: Path, store: Store, rel: str) -> None:
        self.local_path = Path(local_path)
        self.store = store
        self.rel = rel
        self.sidecar = self.local_path.with_name(self.local_path.name + ".fwd")
        try:
            self.offset = int(self.sidecar.read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            self.offset = 0

    def sync(self) -> int:
        """Appends the new whole lines (up to the last newline); returns the bytes sent."""
        try:
            f = self.local_path.open("rb")
        except FileNotFoundError:
            return 0
        with f:
            size = os.fstat(f.fileno()).st_size
            if size < self.offset:
                self.offset = 0
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n") + 1
        if end == 0:
            return 0
        self.store.append_bytes(self.rel, data[:end])
        self.offset += end
        tmp = self.sidecar.with_name(f".{self.sidecar.name}.{secrets.token_hex(4)}.tmp")
        tmp.write_text(f"{self.offset}\n")
        os.replace(tmp, self.sidecar)
        return end


def restore(store: Store, local_dir: Path, *, log: Log = print) -> RestoreResult | None:
    """Puts the union of every node's newest complete manifest into `local_dir`; None (and nothing
    written) when the store has no complete manifest. See the module docstring."""
    local_dir = Path(local_dir)
    chooser = _Chooser(store, log)
    while True:
        chosen = chooser.choose()
        if not chosen:
            if chooser.by_node:
                log(f"checkpoint restore: no complete checkpoint in {store.url}; starting without one")
            return None
        wanted = _union(chosen, log)
        try:
            downloaded, nbytes, present = _fetch(store, local_dir, wanted)
        except _BadBlob as e:
            chooser.bad.add(e.sha)
            continue
        left_alone = tuple(sorted(set(_scan(local_dir)[0]) - set(wanted)))
        result = RestoreResult({n: m["seq"] for n, m in chosen.items()}, downloaded, nbytes, present, left_alone)
        log(
            f"checkpoint restore: {len(wanted)} file(s) from "
            + ", ".join(f"node {n} manifest {s}" for n, s in result.manifests.items())
            + f" ({downloaded} downloaded, {nbytes:,} bytes; {present} already here)"
        )
        return result


class _Chooser:
    """Each node's newest manifest whose blobs are all in the store (asked once per manifest and blob)."""

    def __init__(self, store: Store, log: Log) -> None:
        self.store, self.log = store, log
        names = store.list()
        self.blobs = {n[len(BLOBS) + 1 :] for n in names if n.startswith(f"{BLOBS}/")}
        self.by_node: dict[int, list[int]] = {}
        for name in names:
            if m := _MANIFEST_RE.fullmatch(name):
                self.by_node.setdefault(int(m.group(1)), []).append(int(m.group(2)))
        self.manifests: dict[tuple[int, int], dict[str, Any] | None] = {}
        self.sizes: dict[str, int | None] = {}  # blob sizes in the store, asked once each
        self.bad: set[str] = set()  # blobs whose bytes do not match their name
        self.skipped: set[tuple[int, int]] = set()

    def choose(self) -> dict[int, dict[str, Any]]:
        chosen: dict[int, dict[str, Any]] = {}
        for node, seqs in sorted(self.by_node.items()):
            for seq in sorted(seqs, reverse=True):
                if (node, seq) not in self.manifests:
                    self.manifests[node, seq] = _read_manifest(self.store, manifest_name(node, seq), self.log)
                manifest = self.manifests[node, seq]
                if manifest is None:
                    continue
                problem = _incomplete(self.store, manifest["files"], self.blobs, self.sizes, self.bad)
                if problem is None:
                    chosen[node] = manifest
                    break
                if (node, seq) not in self.skipped:
                    self.skipped.add((node, seq))
                    self.log(f"checkpoint restore: node {node} manifest {seq} is incomplete ({problem}); "
                             "trying older ones")  # fmt: skip
        return chosen


class MirrorView:
    """The checkpoint directory as `restore` would put it back, read in place from the blobs: a read-only
    Store (list, read_bytes, exists, size) over the union of every node's newest complete manifest. What
    `dtrain runs`, the dashboard and `dtrain eval` read of a run whose checkpoint directory was copied (a
    cluster's run), without downloading it first. A blob that does not hold its bytes raises ValueError."""

    def __init__(self, store: Store, files: dict[str, dict[str, Any]] | None = None, prefix: str = "") -> None:
        self.store = store
        self._files = files  # read on first use: the manifests, and each blob's size
        self.prefix = prefix
        self.url = store.url.rstrip("/") + (f" (copies of {prefix.rstrip('/')})" if prefix else "")

    def __repr__(self) -> str:
        return f"MirrorView({self.store.url!r}, {self.prefix!r})"

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        if self._files is None:
            self._files = _union(_Chooser(self.store, _quiet).choose(), _quiet)
        return self._files

    def child(self, rel: str) -> MirrorView:
        return MirrorView(self.store, self.files, f"{self.prefix}{rel.strip('/')}/")

    def _entry(self, rel: str) -> dict[str, Any]:
        e = self.files.get(self.prefix + rel)
        if e is None:
            raise FileNotFoundError(f"{self.url}: {rel}")
        return e

    def read_bytes(self, rel: str, start: int = 0) -> bytes:
        e = self._entry(rel)
        data = self.store.read_bytes(blob_name(e["sha256"]))
        if hashlib.sha256(data).hexdigest() != e["sha256"]:
            raise ValueError(f"{self.store.url}: blob {e['sha256'][:12]} ({rel}) does not hold the bytes its name says")
        return data[start:]

    def exists(self, rel: str) -> bool:
        return self.prefix + rel in self.files

    def size(self, rel: str) -> int:
        return int(self._entry(rel)["size"])

    def list(self, rel_prefix: str = "") -> list[str]:
        full = self.prefix + rel_prefix
        return sorted(p[len(self.prefix) :] for p in self.files if p.startswith(full))


def _quiet(_message: str) -> None:
    pass


class _BadBlob(Exception):
    def __init__(self, sha: str) -> None:
        super().__init__(sha)
        self.sha = sha


def _union(chosen: dict[int, dict[str, Any]], log: Log) -> dict[str, dict[str, Any]]:
    """Every file of the chosen manifests; for a path two nodes disagree on, the newer mtime (then the
    lower node) wins."""
    wanted: dict[str, dict[str, Any]] = {}
    owner: dict[str, int] = {}
    for node, manifest in sorted(chosen.items()):
        for rel, e in manifest["files"].items():
            have = wanted.get(rel)
            if have is not None and have["sha256"] != e["sha256"]:
                newer = e.get("mtime_ns", 0) > have.get("mtime_ns", 0)
                log(
                    f"checkpoint restore: {rel} differs between node {owner[rel]} and node {node}; "
                    f"taking node {node if newer else owner[rel]}'s (newer)"
                )
                if not newer:
                    continue
            elif have is not None:
                continue
            wanted[rel], owner[rel] = e, node
    return wanted


def _fetch(store: Store, local_dir: Path, wanted: dict[str, dict[str, Any]]) -> tuple[int, int, int]:
    """Downloads what is missing into temp files, verified, and renames them into place only once all
    are verified, so a corrupt blob leaves the directory as it was. Returns (files, bytes, present)."""
    staged: list[tuple[Path, Path, int]] = []
    nbytes = present = 0
    try:
        for rel, e in sorted(wanted.items()):
            target = local_dir / rel
            if _has(target, e):
                present += 1
                continue
            data = store.read_bytes(blob_name(e["sha256"]))
            if hashlib.sha256(data).hexdigest() != e["sha256"]:
                raise _BadBlob(e["sha256"])
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.restore.tmp")
            staged.append((tmp, target, int(e.get("mtime_ns", 0))))
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            nbytes += len(data)
        for tmp, target, mtime_ns in staged:
            os.replace(tmp, target)
            if mtime_ns:  # the saved mtime, so that this copy does not look newer than it is (_union)
                os.utime(target, ns=(mtime_ns, mtime_ns))
        return len(staged), nbytes, present
    finally:
        for tmp, _, _ in staged:
            tmp.unlink(missing_ok=True)


def _has(path: Path, e: dict[str, Any]) -> bool:
    try:
        return path.stat().st_size == e["size"] and sha256_file(path) == e["sha256"]
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False


def _incomplete(
    store: Store,
    files: dict[str, dict[str, Any]],
    blobs: set[str] | None,
    sizes: dict[str, int | None],
    bad: Container[str] = (),
) -> str | None:
    """Why a manifest's files are not all in the store ('ckpt.pt: blob 1a2b… is missing'), or None.
    `blobs` is a listing of the blob names (None: ask for each), `sizes` a cache of blob sizes."""
    for rel, e in sorted(files.items()):
        sha, size = e["sha256"], e["size"]
        if sha in bad:
            return f"{rel}: blob {sha[:12]} does not hold the bytes its name says"
        if sha not in sizes:
            sizes[sha] = _blob_size(store, sha) if blobs is None or sha in blobs else None
        if sizes[sha] is None:
            return f"{rel}: blob {sha[:12]} is missing"
        if sizes[sha] != size:
            return f"{rel}: blob {sha[:12]} has {sizes[sha]:,} bytes, not {size:,}"
    return None


def _read_manifest(store: Store, name: str, log: Log) -> dict[str, Any] | None:
    """A manifest, checked for shape (and for paths that stay inside the directory), or None."""
    try:
        manifest = json.loads(store.read_bytes(name))
        files = manifest["files"]
        ok = isinstance(files, dict) and all(
            _safe_rel(rel)
            and isinstance(e, dict)
            and isinstance(e.get("sha256"), str)
            and _SHA_RE.fullmatch(e["sha256"])
            and isinstance(e.get("size"), int)
            and e["size"] >= 0
            for rel, e in files.items()
        )
        if ok and isinstance(manifest.get("seq"), int):
            return manifest
    except FileNotFoundError:
        return None  # deleted by its node's GC since the listing
    except (ValueError, KeyError, TypeError):
        pass
    log(f"checkpoint store: {store.join(name)} is not a valid manifest; ignoring it")
    return None


def _safe_rel(rel: object) -> bool:
    return (
        isinstance(rel, str)
        and not rel.startswith("/")
        and "\\" not in rel
        and all(p not in ("", ".", "..") for p in rel.split("/"))
    )


def _content(files: dict[str, dict[str, Any]]) -> dict[str, tuple[str, int]]:
    # mtime is left out: touching a file without changing its bytes is no reason for a new manifest.
    return {rel: (e["sha256"], e["size"]) for rel, e in files.items()}


def _write_json(store: Store, name: str, obj: dict[str, Any]) -> None:
    store.write_bytes(name, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _blob_size(store: Store, sha: str) -> int | None:
    try:
        return store.size(blob_name(sha))
    except FileNotFoundError:
        return None


def _key(st: os.stat_result) -> _Key:
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _scan(local_dir: Path) -> tuple[dict[str, os.stat_result], set[tuple[int, int]]]:
    """One walk of `local_dir`: its regular files by '/'-separated relative path, temporary-looking names and
    everything under a temporary-looking directory left out; and (st_dev, st_ino) of those temporary files (never
    copied: one that is open for writing means a save is under way, `torch.save` to `x.tmp`, then a rename).
    Hidden directories (.git and the like) are not walked."""
    found: dict[str, os.stat_result] = {}
    temporaries: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(local_dir):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel_dir = Path(dirpath).relative_to(local_dir)
        in_temporary = any(is_temporary(part) for part in rel_dir.parts)
        for name in sorted(filenames):
            try:
                st = os.stat(os.path.join(dirpath, name))
            except OSError:  # removed while we looked
                continue
            if in_temporary or is_temporary(name):
                temporaries.add((st.st_dev, st.st_ino))
            elif stat.S_ISREG(st.st_mode):
                found[(rel_dir / name).as_posix()] = st
    return found, temporaries


def _under(rel: str, prefix: str) -> bool:
    return rel == prefix or rel.startswith(prefix + "/")


def _content_of(entry: dict[str, Any] | None) -> tuple[int, int] | None:
    return None if entry is None else (entry["size"], entry["mtime_ns"])


def _units(local_dir: Path, keys: dict[str, _Key], *, killed: bool) -> dict[str, tuple[set[str], bool]]:
    """The checkpoint folders, single-file checkpoints and marked paths that say when they are whole: prefix ->
    (its files, whole). killed: the job was killed, so a closed single-file checkpoint may be cut off."""
    units: dict[str, tuple[set[str], bool]] = {}
    marked = _sdk_units(local_dir)
    for prefix, listed in marked.items():
        members = {rel for rel in keys if _under(rel, prefix)}
        units[prefix] = (members, bool(members) and {rel: list(keys[rel][:2]) for rel in members} == listed)
    for rel in keys:
        parts = rel.split("/")
        for i, part in enumerate(parts):
            prefix = "/".join(parts[: i + 1])
            if prefix in units or any(_under(prefix, p) for p in marked):
                break
            if i == len(parts) - 1:
                if part.endswith(SINGLE_FILE_SUFFIX):
                    units[prefix] = ({rel}, not killed)
            elif _DTRAIN_STEP_RE.fullmatch(part) or _HF_CHECKPOINT_RE.fullmatch(part):
                members = {r for r in keys if _under(r, prefix)}
                units[prefix] = (members, _format_whole(local_dir, prefix, part, members, keys))
                break
    return units


def _format_whole(local_dir: Path, prefix: str, name: str, members: set[str], keys: dict[str, _Key]) -> bool:
    if _HF_CHECKPOINT_RE.fullmatch(name):
        return f"{prefix}/{HF_TRAINER_STATE}" in members
    try:  # dtrain's: meta.json lists every file with its size
        listed = json.loads((local_dir / prefix / DTRAIN_META).read_text())["files"]
        return all(keys.get(f"{prefix}/{f}", (-1,))[0] == e["size"] for f, e in listed.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _sdk_units(local_dir: Path) -> dict[str, dict[str, list[int]]]:
    try:
        units = json.loads((local_dir / SDK_MARKER).read_text())["units"]
        return {str(p): {str(f): list(v) for f, v in files.items()} for p, files in units.items() if _safe_rel(p)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _open_for_writing(inodes: set[tuple[int, int]], pids: Iterable[int] | None) -> set[tuple[int, int]]:
    """Those of `inodes` ((st_dev, st_ino)) that a process in `pids` (None: every process of this
    uid) has open for writing, from /proc/<pid>/fd and the access mode in /proc/<pid>/fdinfo."""
    found: set[tuple[int, int]] = set()
    if not inodes:
        return found
    for pid in _own_pids() if pids is None else pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or not ours to look at
            continue
        for fd in fds:
            try:
                st = os.stat(f"{fd_dir}/{fd}")
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in inodes and key not in found and _writable(pid, fd):
                found.add(key)
    return found


def _writable(pid: int, fd: str) -> bool:
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/fdinfo/{fd}") as f:
        for line in f:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
    return False  # closed meanwhile


def _own_pids() -> list[int]:
    uid = os.getuid()
    pids = []
    with contextlib.suppress(FileNotFoundError), os.scandir("/proc") as entries:  # no /proc: no writers seen
        for entry in entries:
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if entry.stat().st_uid == uid:
                        pids.append(int(entry.name))
    return pids
