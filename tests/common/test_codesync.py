"""dtrain.common.codesync: scans honour ignore rules, and real node processes (`python -m
dtrain.common.codesync receive`) receive only what changed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.common import codesync
from dtrain.common.codesync import Manifest, SyncStats
from dtrain.common.errors import UserError

HOUR_NS = 3600 * 10**9


@pytest.fixture(autouse=True)
def _cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hash caches go under the test's directory, not ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-cache"


def write(root: Path, files: dict[str, bytes | str]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)


def age(root: Path) -> None:
    """Moves every mtime an hour back. scan() re-hashes files written in the last 2 s on every scan
    (their mtime cannot tell a second edit apart), so a tree written by the test looks fresh."""
    for parent, _, names in os.walk(root):
        for name in names:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                st = os.stat(path)
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - HOUR_NS))


def tree(root: Path) -> dict[str, tuple]:
    """Everything under root: files as (bytes, permission bits), symlinks as ("->", target)."""
    out: dict[str, tuple] = {}
    for parent, dirs, names in os.walk(root):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(parent, d))]:
            path = os.path.join(parent, name)
            rel = os.path.relpath(path, root)
            if rel == codesync.STATE_FILE:
                continue
            if os.path.islink(path):
                out[rel] = ("->", os.readlink(path))
            else:
                out[rel] = (Path(path).read_bytes(), os.stat(path).st_mode & 0o777)
    return out


def expected(manifest: Manifest) -> dict[str, tuple]:
    """What the node should hold for `manifest`: its files with normalised modes, and its links."""
    out: dict[str, tuple] = {p: ((manifest.root / p).read_bytes(), e.mode) for p, e in manifest.files.items()}
    out.update({p: ("->", t) for p, t in manifest.links.items()})
    return out


def sync(manifest: Manifest, dest: Path, snapshot: Path | None = None, *, ok: bool = True) -> SyncStats:
    """Runs `send` here against a real node process on pipes; returns its stats."""
    cmd = [sys.executable, "-m", "dtrain.common.codesync", "receive", "--dest", str(dest)]
    if snapshot is not None:
        cmd += ["--snapshot", str(snapshot)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        stats = codesync.send(manifest, proc.stdout, proc.stdin)
    finally:
        proc.stdin.close()
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    assert rc == 0, err
    assert err == ""
    return stats


def scan(root: Path, **kwargs) -> Manifest:
    return codesync.scan(root, **kwargs)


def test_first_sync_copies_the_tree(tmp_path: Path):
    src, dest = tmp_path / "src", tmp_path / "node" / "code"
    write(src, {"train.py": "print('hi')\n", "pkg/__init__.py": "", "pkg/model.py": "W = 3\n" * 1000,
                "run.sh": "#!/bin/sh\necho run\n", "data/tiny.bin": os.urandom(3000)})  # fmt: skip
    os.chmod(src / "run.sh", 0o775)
    os.chmod(src / "train.py", 0o600)
    os.symlink("pkg/model.py", src / "model_link.py")  # file inside: kept as a link
    os.symlink("pkg", src / "pkg_link")  # directory inside: a link, not followed
    os.symlink(str(src / "train.py"), src / "abs_link.py")  # absolute, inside: made relative
    os.symlink("/etc/hostname", src / "outside")
    os.symlink("missing.py", src / "dangling")

    manifest = scan(src)
    assert sorted(manifest.files) == ["data/tiny.bin", "pkg/__init__.py", "pkg/model.py", "run.sh", "train.py"]
    assert manifest.links == {"model_link.py": "pkg/model.py", "pkg_link": "pkg", "abs_link.py": "train.py"}
    assert [p for p, _ in manifest.skipped] == ["dangling", "outside"]
    assert manifest.files["run.sh"].mode == 0o755 and manifest.files["train.py"].mode == 0o644
    assert manifest.total_bytes == sum(os.path.getsize(src / p) for p in manifest.files)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert scan(src).digest == manifest.digest

    stats = sync(manifest, dest)
    assert (stats.files_sent, stats.deleted) == (5, 0)
    assert stats.bytes_sent >= 3000  # the random file does not compress
    assert tree(dest) == expected(manifest)
    assert (dest / "pkg_link" / "model.py").read_text() == "W = 3\n" * 1000
    assert os.stat(dest / "run.sh").st_mode & 0o777 == 0o755


def test_incremental_sync_of_a_50mb_tree(tmp_path: Path, monkeypatch):
    src, dest = tmp_path / "src", tmp_path / "code"
    blob = os.urandom(50 * 1024 * 1024)
    size = len(blob) // 60
    write(src, {f"d{i % 6}/f{i:02}.bin": blob[i * size : (i + 1) * size] for i in range(60)})
    age(src)
    first = sync(scan(src), dest)
    assert first.files_sent == 60 and first.bytes_sent >= 60 * size

    hashed: list[str] = []  # the second scan reads no file: every hash comes from the cache (stat calls only)
    real = codesync.sha256_file
    monkeypatch.setattr(codesync, "sha256_file", lambda path: hashed.append(str(path)) or real(path))
    manifest = scan(src)
    assert hashed == []
    monkeypatch.undo()
    again = sync(manifest, dest)
    assert (again.files_sent, again.bytes_sent, again.deleted) == (0, 0, 0)

    write(src, {"d3/f09.bin": os.urandom(size)})  # one file changed
    changed = sync(scan(src), dest)
    assert changed.files_sent == 1
    assert size <= changed.bytes_sent <= size + 64 * 1024
    assert (dest / "d3/f09.bin").read_bytes() == (src / "d3/f09.bin").read_bytes()

    (src / "d1/f07.bin").unlink()
    removed = sync(scan(src), dest)
    assert (removed.files_sent, removed.bytes_sent, removed.deleted) == (0, 0, 1)
    assert not (dest / "d1/f07.bin").exists()

    write(src, {"new/dir/added.py": "x = 1\n"})
    added = sync(scan(src), dest)
    assert (added.files_sent, added.deleted) == (1, 0) and 0 < added.bytes_sent <= 64 * 1024
    assert tree(dest) == expected(scan(src))


def test_snapshot_keeps_the_code_a_job_started_with(tmp_path: Path):
    src, dest = tmp_path / "src", tmp_path / "code"
    write(src, {"model.py": "VERSION = 1\n", "util.py": "same\n"})
    sync(scan(src), dest, snapshot=tmp_path / "run1")
    assert tree(tmp_path / "run1") == tree(dest)
    # A hard-link copy: no file bytes duplicated.
    assert os.stat(tmp_path / "run1/util.py").st_ino == os.stat(dest / "util.py").st_ino

    write(src, {"model.py": "VERSION = 2  # longer\n"})
    stats = sync(scan(src), dest, snapshot=tmp_path / "run2")
    assert stats.files_sent == 1
    assert (tmp_path / "run1/model.py").read_text() == "VERSION = 1\n"  # os.replace left run1's inode alone
    assert (tmp_path / "run2/model.py").read_text() == "VERSION = 2  # longer\n"
    assert (dest / "model.py").read_text() == "VERSION = 2  # longer\n"
    assert not (tmp_path / "run1" / codesync.STATE_FILE).exists()

    write(src, {"model.py": "VERSION = 3\n"})
    (src / "util.py").unlink()
    sync(scan(src), dest, snapshot=tmp_path / "run2")  # an existing snapshot is replaced whole
    assert tree(tmp_path / "run2") == {"model.py": (b"VERSION = 3\n", 0o644)}
    assert (tmp_path / "run1/util.py").read_text() == "same\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".dtrain")] == []


ROOT_GITIGNORE = r"""
# a comment, then a blank line

*.log
!keep.log
/build/
!build/keep.txt
docs/*.tmp
cache/
**/gen/*.c
secret*
!secret_ok.txt
tmp[0-9].txt
?.bak
logs/**
\#hash.txt
"""
SUB_GITIGNORE = """
*.dat
!important.dat
/local.txt
"""
DTRAINIGNORE = """
!a.log
data/
"""
KEPT = [
    ".dtrainignore", ".gitignore", "a.log", "cache", "docs/deep/a.tmp", "keep.log", "local.txt", "logs.txt",
    "secret_ok.txt", "sub/.gitignore", "sub/build/x.py", "sub/deeper/local.txt", "sub/docs/a.tmp",
    "sub/important.dat", "sub/keep.log", "tmpa.txt", "x/gen/b.h", "xy.bak",
]  # fmt: skip
IGNORED = [
    # .gitignore: unanchored, negation, anchored dir, a file under an ignored dir can't come back,
    # "*" stops at "/", dir-only at any depth, "**/" (zero and more dirs), "[...]", "?", "/**", "\#"
    "b.log", "sub/b.log", "build/out.o", "build/keep.txt", "docs/a.tmp", "sub/cache/c.bin", "gen/a.c",
    "x/y/gen/b.c", "secret.txt", "tmp1.txt", "x.bak", "logs/a/b.txt", "#hash.txt",
    # nested .gitignore: its patterns, its anchor
    "sub/x.dat", "sub/deeper/y.dat", "sub/local.txt",
    # .dtrainignore, default excludes, .git, exclude=["runs/"] (gitignore semantics: at any depth)
    "data/big.bin", "__pycache__/m.cpython-311.pyc", "pkg/__pycache__/x.pyc", "stray.pyc", ".venv/lib/x.py",
    "venv/bin/python", ".mypy_cache/x", ".pytest_cache/x", ".ipynb_checkpoints/n.ipynb", ".DS_Store",
    "sub/.DS_Store", ".git/HEAD", "runs/r1/metrics.jsonl", "sub/runs/x.txt",
]  # fmt: skip


def test_scan_follows_gitignore_and_dtrainignore_rules(tmp_path: Path):
    src = tmp_path / "src"
    write(src, {p: "x" for p in KEPT + IGNORED})
    write(src, {".gitignore": ROOT_GITIGNORE, "sub/.gitignore": SUB_GITIGNORE, ".dtrainignore": DTRAINIGNORE})
    manifest = scan(src, exclude=["runs/"])
    assert sorted(manifest.files) == sorted(KEPT)
    # Without the caller's exclude the runs come back; a .dtrainignore can re-include a default.
    write(src, {".dtrainignore": DTRAINIGNORE + "!.DS_Store\n"})
    extra = set(scan(src).files) - set(KEPT)
    assert extra == {"runs/r1/metrics.jsonl", "sub/runs/x.txt", ".DS_Store", "sub/.DS_Store"}
    assert set(scan(src, exclude=["/runs/"]).files) - set(KEPT) == {"sub/runs/x.txt", ".DS_Store", "sub/.DS_Store"}


def test_size_limit_names_the_biggest_items(tmp_path: Path):
    src = tmp_path / "proj"
    write(src, {"data/a.bin": b"\0" * 600_000, "data/b.bin": b"\0" * 600_000, "model.bin": b"\0" * 500_000,
                "src/train.py": "x = 1\n" * 100})  # fmt: skip
    with pytest.raises(UserError) as info:
        scan(src, limit_bytes=1024 * 1024)
    message = str(info.value)
    assert "\n" not in message
    assert str(src) in message and "1.6 MiB" in message and "1.0 MiB limit" in message
    assert "largest: data/ 1.1 MiB, model.bin 488.3 KiB, src/ 600 B" in message
    assert "add them to .dtrainignore, or raise the limit (--code-limit MB, or code_limit in the job)" in message
    write(src, {".dtrainignore": "data/\n"})
    assert scan(src, limit_bytes=1024 * 1024).total_bytes == 500_000 + 600 + len("data/\n")


def test_a_file_edited_on_the_node_is_sent_again(tmp_path: Path):
    src, dest = tmp_path / "src", tmp_path / "code"
    write(src, {"a.py": "a = 1\n", "b.py": "b = 2\n", "c.py": "c = 3\n"})
    manifest = scan(src)
    assert sync(manifest, dest).files_sent == 3

    with open(dest / "a.py", "a") as f:  # edited in place
        f.write("hacked = True\n")
    (dest / "b.tmp").write_text("b = 9\n")  # an editor's save: same size, new inode
    os.replace(dest / "b.tmp", dest / "b.py")
    (dest / "c.py").unlink()
    (dest / "stray.txt").write_text("made on the node\n")
    (dest / "empty" / "dir").mkdir(parents=True)

    stats = sync(manifest, dest)
    assert (stats.files_sent, stats.deleted) == (3, 1)
    assert tree(dest) == expected(manifest)
    assert not (dest / "empty").exists()


def test_hash_cache_skips_unchanged_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, _cache_home: Path):
    src = tmp_path / "src"
    write(src, {f"m{i}.py": f"x = {i}\n" for i in range(5)})
    age(src)
    hashed: list[str] = []
    real_hash = codesync.sha256_file
    monkeypatch.setattr(codesync, "sha256_file", lambda path: hashed.append(os.path.basename(path)) or real_hash(path))

    first = scan(src)
    assert len(hashed) == 5
    assert len(list((_cache_home / "dtrain" / "codesync").glob("*.json"))) == 1
    hashed.clear()
    assert scan(src) == first and hashed == []

    write(src, {"m2.py": "x = 22\n"})
    st = os.stat(src / "m2.py")
    second = scan(src)
    assert hashed == ["m2.py"] and second.digest != first.digest
    # Written within the last 2 s: hashed again (an edit in the same clock tick would keep its mtime)...
    hashed.clear()
    scan(src)
    assert hashed == ["m2.py"]
    # ...and cached once it is older.
    os.utime(src / "m2.py", ns=(st.st_atime_ns, st.st_mtime_ns - HOUR_NS))
    scan(src)
    hashed.clear()
    scan(src)
    assert hashed == []
    # An explicit cache_dir is used instead of $XDG_CACHE_HOME.
    scan(src, cache_dir=tmp_path / "elsewhere")
    assert len(list((tmp_path / "elsewhere").glob("*.json"))) == 1


def test_a_file_changed_after_the_scan_is_refused(tmp_path: Path):
    src = tmp_path / "src"
    write(src, {"a.py": "a = 1\n"})
    manifest = scan(src)
    write(src, {"a.py": "a = 2\n"})
    with pytest.raises(UserError, match="changed while it was being synced"):
        codesync.pack(manifest, ["a.py"])


def _run_failing(manifest: Manifest, dest: Path) -> tuple[str, int, str]:
    cmd = [sys.executable, "-m", "dtrain.common.codesync", "receive", "--dest", str(dest)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with pytest.raises(UserError) as info:
        codesync.send(manifest, proc.stdout, proc.stdin)
    proc.stdin.close()
    err = proc.stderr.read().decode()
    rc = proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()
    return str(info.value), rc, err


def test_node_errors_come_back_as_one_line(tmp_path: Path):
    src, dest = tmp_path / "src", tmp_path / "home"
    write(src, {"a.py": "a = 1\n"})
    write(dest, {"notes.txt": "the user's own files\n"})  # not a directory this module wrote
    message, rc, err = _run_failing(scan(src), dest)
    assert rc == 1 and "is not empty and was not written by dtrain" in message
    assert err.count("\n") == 1 and "not empty" in err
    assert tree(dest) == {"notes.txt": (b"the user's own files\n", 0o644)}


def test_disk_full_on_the_node_is_reported(tmp_path: Path, tmpfs):
    disk = tmpfs("256k")
    src, dest = tmp_path / "src", disk.path / "code"
    write(src, {"small.py": "x = 1\n"})
    sync(scan(src), dest)
    write(src, {"weights.bin": os.urandom(1024 * 1024)})
    message, rc, _ = _run_failing(scan(src), dest)
    assert rc == 1 and "No space left on device receiving weights.bin (1.0 MiB)" in message
    assert tree(dest) == {"small.py": (b"x = 1\n", 0o644)}  # the failed sync changed nothing
    assert sorted(p.name for p in dest.iterdir()) == [codesync.STATE_FILE, "small.py"]  # staging removed


def test_files_directories_and_links_change_places(tmp_path: Path):
    src, dest = tmp_path / "src", tmp_path / "code"
    write(src, {"a": "file a\n", "d/x.py": "x\n", "d/deep/y.py": "y\n", "t.py": "t\n"})
    os.symlink("t.py", src / "l")
    sync(scan(src), dest)

    (src / "a").unlink()
    write(src, {"a/inner.py": "now a directory\n"})
    for path in ("d/x.py", "d/deep/y.py", "l"):
        os.unlink(src / path)
    os.rmdir(src / "d/deep")
    os.rmdir(src / "d")
    write(src, {"d": "now a file\n", "l": "now a file too\n"})
    os.symlink("a", src / "d_link")
    stats = sync(scan(src), dest)
    assert (stats.files_sent, stats.deleted) == (3, 4)  # a, d/x.py, d/deep/y.py, l go; a/inner.py, d, l come
    assert tree(dest) == expected(scan(src))
