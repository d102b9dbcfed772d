"""The checkpoint mirror with real files and real processes: what is copied (settled files only, never one
a process has open for writing), the store layout, crash safety of restore, GC, two nodes, the metrics
forward, and one round trip through the GCS emulator."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dtrain.common.mirror import Forward, Mirror, RestoreResult, SyncResult, restore
from dtrain.common.storage import Store, open_store

THREAD_DEADLINE_S = 10.0


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ckpt_store(tmp_path: Path) -> Store:
    return open_store(str(tmp_path / "run")).child("ckpt")


def manifests(store: Store, node: int = 0) -> list[str]:
    return [n for n in store.list(f"node-{node:05d}") if not n.endswith("pending.json")]


def manifest(store: Store, node: int, seq: int) -> dict:
    return json.loads(store.read_bytes(f"node-{node:05d}/{seq:08d}.json"))


def settle(m: Mirror) -> SyncResult:
    """At most two scans: a folder of one closed file is whole at once; files changed in place settle on the
    second scan (the first sees them changed)."""
    first = m.sync()
    return first if first.manifest is not None else m.sync()


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_closed_file_is_mirrored_after_two_scans_and_restored_byte_for_byte(tmp_path):
    local, store, logs = tmp_path / "local", ckpt_store(tmp_path), []
    (local / "sub").mkdir(parents=True)
    model = os.urandom(100_000)
    (local / "ckpt.pt").write_bytes(model)
    (local / "sub" / "opt.pt").write_bytes(b"optimizer")
    # never copied, and never what a manifest waits for
    for name in ["ckpt.pt.tmp", ".ckpt.pt.tmp", ".hidden", "notes~", "big.partial", ".staging/x.pt", "d.tmp/y.pt"]:
        (local / name).parent.mkdir(exist_ok=True)
        (local / name).write_bytes(b"junk")
    m = Mirror(local, store, node=0, log=logs.append)

    assert m.sync() == SyncResult(waiting=("ckpt.pt", "sub/opt.pt"))
    assert store.list() == []
    assert m.sync() == SyncResult(uploaded_files=2, uploaded_bytes=100_009, manifest=1)

    assert store.list() == sorted([f"blobs/{sha(model)}", f"blobs/{sha(b'optimizer')}", "node-00000/00000001.json"])
    saved = manifest(store, 0, 1)
    assert (saved["seq"], saved["node"]) == (1, 0)
    assert abs(saved["time"] - time.time()) < 60
    assert saved["files"] == {
        "ckpt.pt": {"sha256": sha(model), "size": 100_000, "mtime_ns": (local / "ckpt.pt").stat().st_mtime_ns},
        "sub/opt.pt": {"sha256": sha(b"optimizer"), "size": 9, "mtime_ns": (local / "sub/opt.pt").stat().st_mtime_ns},
    }
    assert logs == ["checkpoint mirror: node 0 saved 2 file(s) as manifest 1 (2 uploaded, 100,009 bytes)"]

    out = tmp_path / "restored"
    assert restore(store, out, log=logs.append) == RestoreResult({0: 1}, files=2, bytes=100_009)
    assert files_under(out) == {"ckpt.pt": model, "sub/opt.pt": b"optimizer"}
    # the saved mtime comes back too (so this copy never looks newer than the one it came from)
    assert (out / "ckpt.pt").stat().st_mtime_ns == (local / "ckpt.pt").stat().st_mtime_ns

    # again, over what is there: nothing downloaded; a file of the user's is left alone
    (out / "mine.txt").write_bytes(b"user's")
    again = restore(store, out, log=logs.append)
    assert again == RestoreResult({0: 1}, files=0, bytes=0, present=2, left_alone=("mine.txt",))
    assert (out / "mine.txt").read_bytes() == b"user's"


WRITER = textwrap.dedent(
    """
    import sys
    f = open(sys.argv[1], "wb")
    f.write(b"a" * 50_000)
    f.flush()
    print("half", flush=True)
    sys.stdin.readline()
    f.write(b"b" * 50_000)
    f.close()
    print("closed", flush=True)
    sys.stdin.readline()  # still running, with the file closed
    """
)


def test_a_file_open_for_writing_is_not_copied_until_the_writer_closes_it(tmp_path):
    local, store = tmp_path / "local", ckpt_store(tmp_path)
    local.mkdir()
    (local / "config.json").write_bytes(b"{}")
    m = Mirror(local, store, node=0, log=lambda _: None)  # pids=None: every process of this uid
    assert settle(m).manifest == 1

    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(local / "ckpt.pt")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert writer.stdout.readline() == b"half\n"
        (local / "extra.json").write_bytes(b"[]")  # settles meanwhile, but is not saved without ckpt.pt
        assert m.sync() == SyncResult(waiting=("ckpt.pt", "extra.json"))
        # The half file's size and mtime stay put while the writer sleeps: only its open fd holds it back.
        for _ in range(3):
            assert m.sync() == SyncResult(waiting=("ckpt.pt",))
        assert manifests(store) == ["node-00000/00000001.json"]
        assert "ckpt.pt" not in manifest(store, 0, 1)["files"]
        assert store.list("blobs") == [f"blobs/{sha(b'{}')}"]  # not even a blob of the half file

        # A mirror that is not told about the writer (pids: none) would copy the half file.
        blind_store = ckpt_store(tmp_path / "blind")
        blind = Mirror(local, blind_store, node=0, pids=lambda: [], log=lambda _: None)
        assert settle(blind).manifest == 1
        assert manifest(blind_store, 0, 1)["files"]["ckpt.pt"]["size"] == 50_000

        # The same check with the job's process tree given explicitly.
        tree = Mirror(local, ckpt_store(tmp_path / "tree"), node=0, pids=lambda: [writer.pid], log=lambda _: None)
        assert settle(tree) == SyncResult(waiting=("ckpt.pt",))

        writer.stdin.write(b"go\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == b"closed\n"
        assert writer.poll() is None  # alive, but no longer writing
        assert m.sync() == SyncResult(waiting=("ckpt.pt",))  # its size changed: one more scan
        assert m.sync() == SyncResult(uploaded_files=2, uploaded_bytes=100_002, manifest=2)
    finally:
        writer.kill()
        writer.wait()
    full = b"a" * 50_000 + b"b" * 50_000
    assert manifest(store, 0, 2)["files"]["ckpt.pt"]["sha256"] == sha(full)
    out = tmp_path / "out"
    restore(store, out, log=lambda _: None)
    assert files_under(out) == {"ckpt.pt": full, "config.json": b"{}", "extra.json": b"[]"}


@pytest.mark.parametrize("damage", ["deleted", "truncated", "corrupted"])
def test_restore_falls_back_past_an_incomplete_manifest(tmp_path, damage):
    local, store = tmp_path / "local", ckpt_store(tmp_path)
    local.mkdir()
    m = Mirror(local, store, node=0, log=lambda _: None)
    v1, v2 = b"1" * 1000, b"2" * 2000
    (local / "ckpt.pt").write_bytes(v1)
    assert settle(m).manifest == 1
    (local / "ckpt.pt").write_bytes(v2)
    assert settle(m).manifest == 2

    blob = f"blobs/{sha(v2)}"
    if damage == "deleted":
        store.delete(blob)
    elif damage == "truncated":
        store.write_bytes(blob, v2[:100])
    else:  # the right size, the wrong bytes: found only by the download's sha256
        store.write_bytes(blob, b"X" * 2000)
    logs: list[str] = []
    out = tmp_path / "out"
    assert restore(store, out, log=logs.append) == RestoreResult({0: 1}, files=1, bytes=1000)
    assert files_under(out) == {"ckpt.pt": v1}  # no temp file left behind either
    why = {"deleted": "is missing", "truncated": "has 100 bytes, not 2,000", "corrupted": "does not hold the bytes"}
    skipped = [line for line in logs if "node 0 manifest 2 is incomplete" in line]
    assert len(skipped) == 1 and why[damage] in skipped[0], logs

    # With the older blob gone too there is no complete manifest: None, and nothing written.
    store.delete(f"blobs/{sha(v1)}")
    empty, mine = tmp_path / "empty", tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_bytes(b"k")
    logs.clear()
    assert restore(store, empty, log=logs.append) is None
    assert restore(store, mine, log=logs.append) is None
    assert not empty.exists()
    assert files_under(mine) == {"keep.txt": b"k"}
    assert any("no complete checkpoint" in line for line in logs)
    assert restore(ckpt_store(tmp_path / "nothing"), empty, log=logs.append) is None


def test_an_unchanged_directory_uploads_nothing_and_writes_no_manifest(tmp_path):
    local, store = tmp_path / "local", ckpt_store(tmp_path)
    local.mkdir()
    (local / "ckpt.pt").write_bytes(b"x" * 4096)
    m = Mirror(local, store, node=0, log=lambda _: None)
    assert settle(m).manifest == 1
    assert m.sync() == SyncResult()
    assert m.sync(final=True) == SyncResult()
    # Touched (new mtime) but the same bytes: it settles again, and still no new manifest.
    os.utime(local / "ckpt.pt", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert settle(m) == SyncResult()
    # A relaunched agent on the same directory: nothing new to save; its next save is seq 2.
    again = Mirror(local, store, node=0, log=lambda _: None)
    assert settle(again) == SyncResult()
    (local / "ckpt.pt").write_bytes(b"y" * 100)
    assert settle(again) == SyncResult(uploaded_files=1, uploaded_bytes=100, manifest=2)
    # At the end (final=True, the job's processes gone) a file is taken in one scan, settled or not.
    (local / "ckpt.pt").write_bytes(b"z" * 10)
    assert again.sync(final=True) == SyncResult(uploaded_files=1, uploaded_bytes=10, manifest=3)
    assert manifests(store) == [f"node-00000/0000000{i}.json" for i in (1, 2, 3)]


def test_gc_keeps_the_newest_manifests_and_the_blobs_they_or_other_nodes_name(tmp_path):
    store = ckpt_store(tmp_path)
    local0, local1 = tmp_path / "node0", tmp_path / "node1"
    local0.mkdir()
    local1.mkdir()
    versions = [bytes([65 + i]) * (1000 + i) for i in range(5)]  # distinct bytes and sizes
    config = b'{"lr": 0.1}'
    (local0 / "config.json").write_bytes(config)
    m0 = Mirror(local0, store, node=0, keep=2, log=lambda _: None)
    results = []
    for i, data in enumerate(versions):
        (local0 / "ckpt.pt").write_bytes(data)
        results.append(settle(m0))
        if i == 0:  # node 1 holds the first version (as after a restore): it shares node 0's blob
            (local1 / "ckpt.pt").write_bytes(data)
            m1 = Mirror(local1, store, node=1, keep=2, log=lambda _: None)
            assert settle(m1) == SyncResult(uploaded_files=0, uploaded_bytes=0, manifest=1)

    assert results[0] == SyncResult(uploaded_files=2, uploaded_bytes=1000 + len(config), manifest=1)
    # config.json's blob is already there: each later save uploads only the new ckpt.pt
    assert results[1:] == [SyncResult(1, 1000 + i, i + 1) for i in range(1, 5)]
    assert manifests(store, 0) == ["node-00000/00000004.json", "node-00000/00000005.json"]
    assert manifests(store, 1) == ["node-00001/00000001.json"]
    kept = {sha(config), sha(versions[3]), sha(versions[4]), sha(versions[0])}  # versions[0]: node 1's
    assert store.list("blobs") == sorted(f"blobs/{s}" for s in kept)
    assert not store.exists("node-00000/pending.json")


def test_two_nodes_restore_the_union_and_a_stale_copy_never_wins(tmp_path):
    store = ckpt_store(tmp_path)
    dir0, dir1 = tmp_path / "node0", tmp_path / "node1"
    dir0.mkdir()
    dir1.mkdir()
    m0 = Mirror(dir0, store, node=0, log=lambda _: None)
    m1 = Mirror(dir1, store, node=1, log=lambda _: None)
    v1 = b"step 100" * 100
    (dir0 / "ckpt.pt").write_bytes(v1)
    assert settle(m0).manifest == 1
    assert settle(m1) == SyncResult()  # node 1 wrote nothing: no manifest
    assert manifests(store, 1) == []

    # A relaunch: node 1 starts from an empty directory and gets node 0's checkpoint.
    assert restore(store, dir1, log=lambda _: None) == RestoreResult({0: 1}, files=1, bytes=800)
    assert files_under(dir1) == {"ckpt.pt": v1}

    # Node 1 saves a file of its own; its manifest also lists the restored ckpt.pt (no upload for it).
    (dir1 / "rank1.pt").write_bytes(b"rank 1 state")
    assert settle(m1) == SyncResult(uploaded_files=1, uploaded_bytes=12, manifest=1)
    # Node 0 saves step 200; then node 1 saves again, its (newer) manifest still naming step 100's ckpt.pt.
    v2 = b"step 200" * 100
    (dir0 / "ckpt.pt").write_bytes(v2)
    later = (dir1 / "ckpt.pt").stat().st_mtime_ns + 10**9  # mtimes apart by more than any clock tick
    os.utime(dir0 / "ckpt.pt", ns=(later, later))
    assert settle(m0).manifest == 2
    (dir1 / "rank1.pt").write_bytes(b"rank 1 state, later")
    assert settle(m1).manifest == 2

    logs: list[str] = []
    out = tmp_path / "fresh"
    assert restore(store, out, log=logs.append) == RestoreResult({0: 2, 1: 2}, files=2, bytes=800 + 19)
    assert files_under(out) == {"ckpt.pt": v2, "rank1.pt": b"rank 1 state, later"}
    assert any("ckpt.pt differs between node 0 and node 1; taking node 0's" in line for line in logs), logs

    # And the other way round: when node 1 holds the newer ckpt.pt, node 1's is taken.
    v3 = b"step 300" * 100
    (dir1 / "ckpt.pt").write_bytes(v3)
    os.utime(dir1 / "ckpt.pt", ns=(later + 10**9, later + 10**9))
    assert settle(m1).manifest == 3
    logs.clear()
    assert restore(store, out, log=logs.append) == RestoreResult({0: 2, 1: 3}, files=1, bytes=800, present=1)
    assert files_under(out) == {"ckpt.pt": v3, "rank1.pt": b"rank 1 state, later"}
    assert any("ckpt.pt differs between node 0 and node 1; taking node 1's" in line for line in logs), logs


def test_forward_sends_each_whole_line_exactly_once(tmp_path):
    run = open_store(str(tmp_path / "run"))
    local = tmp_path / "node" / "metrics.jsonl"
    local.parent.mkdir()
    fwd = Forward(local, run, "metrics.jsonl")
    assert fwd.sync() == 0  # no file yet

    def line(step: int) -> bytes:
        return json.dumps({"step": step, "loss": 1.0 / step}).encode() + b"\n"

    def sent() -> list[int]:
        return [json.loads(x)["step"] for x in run.read_bytes("metrics.jsonl").splitlines()]

    with local.open("ab") as f:
        f.write(line(1) + line(2) + line(3))
    assert fwd.sync() == len(line(1) + line(2) + line(3))
    assert sent() == [1, 2, 3]

    with local.open("ab") as f:  # a line being written: its first half waits
        f.write(line(4) + line(5)[:7])
    assert fwd.sync() == len(line(4))
    assert fwd.sync() == 0
    assert sent() == [1, 2, 3, 4]

    relaunched = Forward(local, run, "metrics.jsonl")  # a new agent, from the sidecar's offset
    with local.open("ab") as f:
        f.write(line(5)[7:] + line(6))
    assert relaunched.sync() == len(line(5) + line(6))
    assert sent() == [1, 2, 3, 4, 5, 6]
    assert int(Path(f"{local}.fwd").read_text()) == local.stat().st_size


def test_the_thread_mirrors_and_forwards_and_close_takes_the_last_files_at_once(tmp_path):
    run = open_store(str(tmp_path / "run"))
    store = run.child("ckpt")
    local, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    local.mkdir()
    m = Mirror(local, store, node=3, interval_s=0.05, forwards=[Forward(metrics, run, "metrics.jsonl")], log=print)
    m.start()
    try:
        (local / "ckpt.pt").write_bytes(b"early")
        metrics.write_bytes(b'{"step": 1}\n')
        deadline = time.monotonic() + THREAD_DEADLINE_S
        while not (manifests(store, 3) and run.exists("metrics.jsonl")):
            assert time.monotonic() < deadline, "the mirror thread saved nothing"
            time.sleep(0.02)
        # A save at the very end: close() takes it as it is (the job is gone), in one scan.
        (local / "last.pt").write_bytes(b"last")
        with metrics.open("ab") as f:
            f.write(b'{"step": 2}\n')
    finally:
        m.close()
    newest = int(manifests(store, 3)[-1].split("/")[1].removesuffix(".json"))
    assert newest >= 2
    assert set(manifest(store, 3, newest)["files"]) == {"ckpt.pt", "last.pt"}
    assert run.read_bytes("metrics.jsonl") == b'{"step": 1}\n{"step": 2}\n'


def test_gcs_round_trip(tmp_path, gcs_bucket):
    run = open_store(gcs_bucket)
    store = run.child("ckpt")
    local = tmp_path / "local"
    (local / "shards").mkdir(parents=True)
    data = {"ckpt.pt": os.urandom(300_000), "shards/0.bin": b"zero", "shards/1.bin": b"zero"}  # 2 files, 1 blob
    for rel, content in data.items():
        (local / rel).write_bytes(content)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b'{"step": 1}\n{"step": 2}\n')
    m = Mirror(local, store, node=0, forwards=[Forward(metrics, run, "metrics.jsonl")], log=lambda _: None)
    assert settle(m) == SyncResult(uploaded_files=2, uploaded_bytes=300_004, manifest=1)
    assert m.sync() == SyncResult()
    assert store.list() == sorted(
        [f"blobs/{sha(data['ckpt.pt'])}", f"blobs/{sha(b'zero')}", "node-00000/00000001.json"]
    )
    out = tmp_path / "out"
    assert restore(store, out, log=lambda _: None) == RestoreResult({0: 1}, files=3, bytes=300_008)
    assert files_under(out) == data
    assert run.read_bytes("metrics.jsonl") == b'{"step": 1}\n{"step": 2}\n'


def test_a_killed_job_leaves_the_last_complete_copy_as_the_newest(tmp_path):
    """close(final=False): the job had to be killed, maybe in the middle of a save. A file that changed since
    the last scan is not settled, so no manifest takes it: the last complete copy stays the newest."""
    local, store = tmp_path / "ckpt", ckpt_store(tmp_path)
    local.mkdir()
    m = Mirror(local, store, node=0, interval_s=60, log=lambda _m: None)
    (local / "ckpt.pt").write_bytes(b"v1" * 1000)
    assert settle(m).manifest == 1
    (local / "ckpt.pt").write_bytes(b"v2-half")  # the kill came mid-save
    assert m.close(final=False).manifest is None
    assert manifests(store) == ["node-00000/00000001.json"]
    out = tmp_path / "restored"
    restore(store, out, log=lambda _m: None)
    assert (out / "ckpt.pt").read_bytes() == b"v1" * 1000
    # Ended by itself: the folder is as the program meant it, taken at once.
    m2 = Mirror(local, store, node=0, interval_s=60, log=lambda _m: None)
    assert m2.close(final=True).manifest == 2


def test_the_view_reads_the_newest_complete_copies_in_place_as_restore_would_put_them_back(tmp_path):
    """MirrorView (what `dtrain runs`, eval and the dashboard read of a run whose checkpoint directory was copied)
    lists and reads the same files restore puts back: a truncated newest copy is passed over for the older one,
    two nodes' copies are one directory, and a blob that lost its bytes is refused, never read as a checkpoint."""
    from dtrain.common.rundir import checkpoints

    run = open_store(str(tmp_path / "run"))
    store = run.child("ckpt")
    n0, n1 = tmp_path / "n0", tmp_path / "n1"
    for d in (n0, n1):
        (d / "step-00000002").mkdir(parents=True)
    m0, m1 = Mirror(n0, store, node=0, log=lambda _: None), Mirror(n1, store, node=1, log=lambda _: None)
    (n0 / "step-00000002" / "state.pt").write_bytes(b"s" * 300)
    (n0 / "LATEST").write_bytes(b"step-00000002")
    (n1 / "step-00000002" / "shard-1.pt").write_bytes(b"1" * 50)
    assert settle(m0).manifest == 1 and settle(m1).manifest == 1
    (n0 / "LATEST").write_bytes(b"step-00000004")
    (n0 / "step-00000004").mkdir()
    (n0 / "step-00000004" / "state.pt").write_bytes(b"t" * 400)
    assert settle(m0).manifest == 2
    store.write_bytes(f"blobs/{sha(b't' * 400)}", b"t" * 10)  # the newest copy of node 0 is incomplete

    view = checkpoints(run)  # no checkpoints/ in the run: the copies
    assert view.list("") == ["LATEST", "step-00000002/shard-1.pt", "step-00000002/state.pt"]
    assert view.list("step-00000002") == ["step-00000002/shard-1.pt", "step-00000002/state.pt"]
    assert view.read_bytes("LATEST") == b"step-00000002" and view.size("step-00000002/state.pt") == 300
    assert view.child("step-00000002").read_bytes("shard-1.pt") == b"1" * 50
    assert not view.exists("step-00000004/state.pt")
    with pytest.raises(FileNotFoundError):
        view.read_bytes("step-00000004/state.pt")
    out = tmp_path / "out"
    restore(store, out, log=lambda _: None)
    assert files_under(out) == {p: view.read_bytes(p) for p in view.list("")}

    store.write_bytes(f"blobs/{sha(b's' * 300)}", b"S" * 300)  # the right size, other bytes
    with pytest.raises(ValueError, match="does not hold the bytes its name says"):
        checkpoints(run).read_bytes("step-00000002/state.pt")

    # A user's program's copies are its own files (no step layout of dtrain's): not read as checkpoints.
    run.write_bytes("config.json", b'{"kind": "program"}')
    assert checkpoints(run).list("") == []
    (tmp_path / "run" / "checkpoints").mkdir()
    (tmp_path / "run" / "checkpoints" / "LATEST").write_bytes(b"step-00000009")
    assert checkpoints(run).read_bytes("LATEST") == b"step-00000009"  # written in place: read there


HOLDER = textwrap.dedent(
    """
    import sys
    f = open(sys.argv[1], "ab")
    f.write(b"log line\\n")
    f.flush()
    print("open", flush=True)
    sys.stdin.readline()
    """
)


def step_dir(local: Path, step: int, data: bytes) -> None:
    """A checkpoint as dtrain.common.checkpoint writes one: state.pt, then meta.json listing it, then LATEST."""
    d = local / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "state.pt").write_bytes(data)
    (d / "meta.json").write_text(json.dumps({"step": step, "files": {"state.pt": {"size": len(data)}}}))
    (local / "LATEST").write_text(d.name)


def test_a_checkpoint_that_says_it_is_whole_is_copied_while_the_rest_of_the_folder_still_changes(tmp_path):
    """dtrain's step-N (meta.json) and HF Trainer's checkpoint-N (trainer_state.json) are copied at the first scan
    that finds them whole, though a log in the same folder is open for writing the whole time; the old rule
    waited for every file to settle, so a folder that never settled was never copied."""
    local, store = tmp_path / "local", ckpt_store(tmp_path)
    local.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(local / "train.log")], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout.readline() == b"open\n"
        m = Mirror(local, store, node=0, interval_s=60, log=lambda _: None)
        step_dir(local, 10, b"s" * 1000)
        hf = local / "hf" / "checkpoint-40"
        hf.mkdir(parents=True)
        (hf / "model.safetensors").write_bytes(b"w" * 500)
        first = m.sync(quick=True)  # HF's folder has no trainer_state.json yet: not whole
        assert first.manifest == 1
        assert sorted(manifest(store, 0, 1)["files"]) == ["step-00000010/meta.json", "step-00000010/state.pt"]
        assert "train.log" in first.waiting and "LATEST" in first.waiting

        (hf / "trainer_state.json").write_text('{"global_step": 40}')
        step_dir(local, 20, b"t" * 1000)
        second = m.sync(quick=True)
        assert second.manifest == 2
        assert sorted(manifest(store, 0, 2)["files"]) == [
            "hf/checkpoint-40/model.safetensors",
            "hf/checkpoint-40/trainer_state.json",
            "step-00000010/meta.json",
            "step-00000010/state.pt",
            "step-00000020/meta.json",
            "step-00000020/state.pt",
        ]
        # a step folder whose meta.json does not match its files (state.pt cut short) is not whole
        (local / "step-00000020" / "state.pt").write_bytes(b"t" * 10)
        third = m.sync(quick=True)
        assert "step-00000020/state.pt" in third.waiting
        out = tmp_path / "out"
        restore(store, out, log=lambda _: None)
        assert (out / "step-00000020" / "state.pt").read_bytes() == b"t" * 1000  # the whole copy, not the cut one
    finally:
        holder.kill()
        holder.wait()


def test_loose_files_replaced_by_a_rename_are_copied_at_once_and_in_place_writes_wait_to_settle(tmp_path):
    """model.pt and optim.pt each saved the safe way (a temporary file, then a rename): whole when renamed. The
    same two files rewritten in place may be caught between the two writes: they wait for the settle rule, and
    until then the copy keeps the last pair, never a new model with an old optimizer."""
    local, store = tmp_path / "local", ckpt_store(tmp_path)
    local.mkdir()
    m = Mirror(local, store, node=0, interval_s=60, log=lambda _: None)

    def save(version: bytes, *, rename: bool) -> None:
        for name in ("model.pt", "optim.pt"):
            if rename:
                (local / f"{name}.tmp").write_bytes(version + name.encode())
                os.replace(local / f"{name}.tmp", local / name)
            else:
                (local / name).write_bytes(version + name.encode())

    save(b"v1", rename=False)
    assert settle(m).manifest == 1  # two files changed in place: the second (settle) scan
    save(b"v2", rename=True)
    assert m.sync(quick=True).manifest == 2  # renamed into place: whole at once
    assert manifest(store, 0, 2)["files"]["optim.pt"]["sha256"] == sha(b"v2optim.pt")

    (local / "model.pt").write_bytes(b"v3model.pt")  # in place, and optim.pt not yet rewritten
    caught = m.sync(quick=True)
    assert caught.manifest is None and caught.waiting == ("model.pt",)
    out = tmp_path / "out"
    restore(store, out, log=lambda _: None)
    assert files_under(out) == {"model.pt": b"v2model.pt", "optim.pt": b"v2optim.pt"}


def test_a_lone_closed_file_is_whole_while_the_job_runs_but_not_after_it_was_killed(tmp_path):
    """A single checkpoint file saved in place is copied at the first scan that finds it closed; after a kill a
    closed file may be one cut off mid-write, so close(final=False) keeps the settle rule for it."""
    local, store = tmp_path / "local", ckpt_store(tmp_path)
    local.mkdir()
    m = Mirror(local, store, node=0, interval_s=60, log=lambda _: None)
    (local / "ckpt.pt").write_bytes(b"v1" * 100)
    assert m.sync(quick=True).manifest == 1
    (local / "ckpt.pt").write_bytes(b"v2" * 100)
    assert m.sync(quick=True).manifest == 2
    (local / "ckpt.pt").write_bytes(b"v3-cut")
    assert m.close(final=False).manifest is None


def test_a_path_marked_by_the_sdk_is_copied_at_once_and_not_after_it_changed(tmp_path, monkeypatch):
    from dtrain import sdk
    from dtrain.common import jobenv

    local, store = tmp_path / "local", ckpt_store(tmp_path)
    monkeypatch.setenv(jobenv.CHECKPOINT_DIR, str(local))
    local.mkdir()
    (local / "progress.json").write_text("{}")  # two loose files changed in place: they would wait
    (local / "notes.txt").write_text("x")
    shard = local / "latest"
    shard.mkdir()
    (shard / "rank0.pt").write_bytes(b"a" * 10)
    (shard / "rank1.pt").write_bytes(b"b" * 10)
    m = Mirror(local, store, node=0, interval_s=60, log=lambda _: None)
    assert m.sync(quick=True).manifest is None

    sdk.checkpoint_saved(shard)
    assert m.sync(quick=True).manifest == 1
    assert sorted(manifest(store, 0, 1)["files"]) == ["latest/rank0.pt", "latest/rank1.pt"]
    (shard / "rank0.pt").write_bytes(b"c" * 10)  # rewritten: not whole until marked again
    assert "latest/rank0.pt" in m.sync(quick=True).waiting
    sdk.checkpoint_saved(shard / "rank0.pt")  # a file too; the folder's own mark no longer matches it
    with pytest.raises(ValueError, match="not under the checkpoint directory"):
        sdk.checkpoint_saved(tmp_path)


def test_the_thread_copies_a_whole_checkpoint_long_before_the_settle_interval(tmp_path):
    """The thread looks every QUICK_SCAN_S for checkpoints that say they are whole: with a 60 s settle interval,
    a step folder is copied within the deadline below (it used to wait for the next 60 s scan at least)."""
    local, store = tmp_path / "local", ckpt_store(tmp_path)
    local.mkdir()
    m = Mirror(local, store, node=0, interval_s=60, log=lambda _: None)
    m.start()
    try:
        step_dir(local, 5, b"s" * 100)
        deadline = time.monotonic() + THREAD_DEADLINE_S
        while not manifests(store) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert manifests(store) == ["node-00000/00000001.json"]
    finally:
        m.close()


def test_lightning_checkpoint_files_are_each_whole_when_closed_even_under_new_names(tmp_path):
    """PyTorch Lightning saves each checkpoint as one `.ckpt` file, written to a temporary file elsewhere and
    moved into place, and most under a new name (`epoch=1-step=20.ckpt`) beside `last.ckpt`: a new name has no
    earlier inode to tell a rename by, so such a folder waited for the settle rule and, saved every few seconds,
    was copied only when the run ended. A closed `.ckpt` is one whole checkpoint: copied at the first scan; one
    open for writing is not, nor, after a kill, one that may have been cut off."""
    local, store, elsewhere = tmp_path / "local", ckpt_store(tmp_path), tmp_path / "tmp"
    local.mkdir()
    elsewhere.mkdir()
    m = Mirror(local, store, node=0, interval_s=60, log=lambda _: None)

    def save(name: str, data: bytes) -> None:
        (elsewhere / "x").write_bytes(data)
        os.replace(elsewhere / "x", local / name)

    save("epoch=0-step=10.ckpt", b"s10")
    save("last.ckpt", b"s10")
    assert m.sync(quick=True).manifest == 1
    save("epoch=1-step=20.ckpt", b"s20")
    save("last.ckpt", b"s20")
    with open(local / "epoch=2-step=30.ckpt", "wb") as half:  # a writer still at it: not taken
        half.write(b"s3")
        half.flush()
        assert m.sync(quick=True).manifest == 2
    files = manifest(store, 0, 2)["files"]
    assert sorted(files) == ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt"]
    assert files["last.ckpt"]["sha256"] == sha(b"s20")
    assert m.close(final=False).manifest is None  # killed: the closed epoch=2-step=30.ckpt may be cut off
