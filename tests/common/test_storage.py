"""The store contract, run against a local directory and a real GCS emulator, plus each side's errors."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dtrain.common import storage
from dtrain.common.errors import ExitCode, UserError
from dtrain.common.storage import DiskFull, GCSStore, LocalStore, Store, is_remote, open_store


@pytest.fixture(params=["local", "gcs"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(str(tmp_path / "root"))
    return open_store(request.getfixturevalue("gcs_bucket"))


def _fill(store: Store) -> None:
    for rel in ["a/b/1", "a/b/2/x", "a/bc/3", "a/b.txt", "top"]:
        store.write_bytes(rel, rel.encode())


# --- the contract, for both backends ---


def test_roundtrip_and_overwrite(store: Store) -> None:
    store.write_bytes("ckpt/step-00000001/state.pt", b"\x00\x01binary\xff")
    assert store.read_bytes("ckpt/step-00000001/state.pt") == b"\x00\x01binary\xff"
    store.write_bytes("ckpt/LATEST", b"step-00000001")
    store.write_bytes("ckpt/LATEST", b"step-2")
    assert store.read_bytes("ckpt/LATEST") == b"step-2"
    assert store.list() == ["ckpt/LATEST", "ckpt/step-00000001/state.pt"]


def test_empty_object(store: Store) -> None:
    store.write_bytes("empty", b"")
    assert store.read_bytes("empty") == b""
    assert store.size("empty") == 0
    assert store.exists("empty")


def test_exists_and_size(store: Store) -> None:
    store.write_bytes("d/f.bin", b"x" * 1234)
    assert store.exists("d/f.bin")
    assert store.size("d/f.bin") == 1234
    assert not store.exists("d/missing")
    assert not store.exists("d")  # only files exist, as on GCS
    with pytest.raises(FileNotFoundError, match="missing"):
        store.size("d/missing")


def test_read_missing_names_the_url(store: Store) -> None:
    with pytest.raises(FileNotFoundError) as e:
        store.read_bytes("no/such/file")
    assert str(e.value) == store.join("no/such/file")


def test_list_is_recursive_relative_and_sorted(store: Store) -> None:
    _fill(store)
    assert store.list() == ["a/b.txt", "a/b/1", "a/b/2/x", "a/bc/3", "top"]
    assert store.list("a/b") == ["a/b/1", "a/b/2/x"]  # a directory: not a/bc/3, not a/b.txt
    assert store.list("a/b/") == ["a/b/1", "a/b/2/x"]
    assert store.list("a/b/2") == ["a/b/2/x"]
    assert store.list("top") == ["top"]  # a file lists itself
    assert store.list("a/b/1") == ["a/b/1"]
    assert store.list("a/x") == []
    assert store.list("nothing/here") == []


def test_list_of_an_empty_store(store: Store) -> None:
    assert store.list() == []


def test_delete_file_prefix_and_missing(store: Store) -> None:
    _fill(store)
    store.delete("a/b/1")
    assert store.list() == ["a/b.txt", "a/b/2/x", "a/bc/3", "top"]
    store.delete("a/b")
    assert store.list() == ["a/b.txt", "a/bc/3", "top"]  # a/bc and a/b.txt untouched
    store.delete("a/b")
    store.delete("never/there")
    assert store.list() == ["a/b.txt", "a/bc/3", "top"]
    store.delete("")
    assert store.list() == []


def test_child_and_join(store: Store) -> None:
    run = store.child("runs/r1")
    assert run.url == store.join("runs/r1")
    assert run.join("checkpoints/LATEST") == store.join("runs/r1/checkpoints/LATEST")
    run.write_bytes("checkpoints/LATEST", b"step-1")
    assert store.read_bytes("runs/r1/checkpoints/LATEST") == b"step-1"
    assert run.list() == ["checkpoints/LATEST"]
    assert store.list() == ["runs/r1/checkpoints/LATEST"]


def test_paths_are_normalised_and_cannot_escape(store: Store) -> None:
    store.write_bytes("./a//b", b"1")
    assert store.list() == ["a/b"]
    assert store.join("a/b/") == store.join("a/b")
    with pytest.raises(ValueError, match="leaves the store"):
        store.read_bytes("../outside")


def test_check_writable_ok(store: Store) -> None:
    store.check_writable()
    assert store.list() == []  # no probe left behind


# --- open_store and URLs ---


def test_open_store_local_resolves_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = open_store("runs/../runs/r1")
    assert isinstance(s, LocalStore)
    assert s.url == str(tmp_path.resolve() / "runs" / "r1")
    assert s.join("checkpoints/LATEST") == str(tmp_path.resolve() / "runs/r1/checkpoints/LATEST")
    assert not is_remote(s.url)


def test_open_store_gcs_url_shape(gcs_bucket: str) -> None:
    bucket = gcs_bucket.removeprefix("gs://").split("/")[0]
    s = open_store(f"gs://{bucket}/runs/r1/")
    assert isinstance(s, GCSStore)
    assert s.url == f"gs://{bucket}/runs/r1"
    assert s.join("checkpoints/LATEST") == f"gs://{bucket}/runs/r1/checkpoints/LATEST"
    assert open_store(f"gs://{bucket}").url == f"gs://{bucket}"
    assert is_remote(s.url)


def test_store_at_bucket_root(gcs_bucket: str) -> None:
    bucket = gcs_bucket.removeprefix("gs://").split("/")[0]
    root = open_store(f"gs://{bucket}")
    root.write_bytes("x/y", b"1")
    open_store(gcs_bucket).write_bytes("z", b"2")
    assert root.list() == ["some/prefix/z", "x/y"]
    assert root.list("x") == ["x/y"]


@pytest.mark.parametrize("url", ["gs://", "gs:///runs", "gs://Upper_Case/x", "gs://ab"])
def test_malformed_gs_url_is_a_user_error(url: str) -> None:
    with pytest.raises(UserError, match="gs://BUCKET|bad bucket name") as e:
        open_store(url)
    assert e.value.exit_code == ExitCode.USAGE


def test_other_schemes_are_a_user_error() -> None:
    with pytest.raises(UserError, match="unsupported storage URL"):
        open_store("s3://bucket/x")


# --- local specifics ---


def test_local_write_keeps_old_content_when_replace_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = open_store(str(tmp_path))
    s.write_bytes("ckpt/LATEST", b"step-1")

    def broken_replace(src: object, dst: object) -> None:
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk went away"):
        s.write_bytes("ckpt/LATEST", b"step-2")
    assert s.read_bytes("ckpt/LATEST") == b"step-1"
    assert os.listdir(tmp_path / "ckpt") == ["LATEST"]  # the temp file was removed


@pytest.mark.root
def test_local_write_on_a_full_disk(tmpfs) -> None:
    disk = tmpfs("64k").path
    s = open_store(str(disk))
    s.write_bytes("ckpt/LATEST", b"step-1")
    with pytest.raises(DiskFull) as e:
        s.write_bytes("ckpt/LATEST", bytes(100_000))
    free = shutil.disk_usage(disk).free
    assert (e.value.path, e.value.needed, e.value.free) == (str(disk / "ckpt" / "LATEST"), 100_000, free)
    assert e.value.errno == errno.ENOSPC and isinstance(e.value, OSError)
    assert (
        str(e.value)
        == f"[Errno 28] no space left on device for {disk}/ckpt/LATEST: 100,000 bytes needed, {free:,} free"
    )
    assert s.read_bytes("ckpt/LATEST") == b"step-1"
    assert os.listdir(disk / "ckpt") == ["LATEST"]  # the partial temp file was removed


def test_local_write_killed_midway_leaves_old_content(tmp_path: Path) -> None:
    # A real SIGKILL after the temp file is written and before the rename.
    code = textwrap.dedent(f"""
        import os, signal
        from dtrain.common.storage import open_store
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)
        open_store({str(tmp_path)!r}).write_bytes("ckpt/LATEST", b"step-2")
    """)
    s = open_store(str(tmp_path))
    s.write_bytes("ckpt/LATEST", b"step-1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr.decode()
    leftovers = sorted(os.listdir(tmp_path / "ckpt"))
    assert len(leftovers) == 2 and leftovers[0].startswith(storage._TMP_PREFIX)
    assert (tmp_path / "ckpt" / leftovers[0]).read_bytes() == b"step-2"
    assert s.read_bytes("ckpt/LATEST") == b"step-1"
    assert s.list() == ["ckpt/LATEST"]  # the orphaned temp file is invisible
    s.delete("ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_local_written_files_get_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        open_store(str(tmp_path)).write_bytes("f", b"1")
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o644


def test_local_check_writable_creates_the_directory(tmp_path: Path) -> None:
    s = open_store(str(tmp_path / "new" / "run"))
    s.check_writable()
    assert (tmp_path / "new" / "run").is_dir()
    assert os.listdir(tmp_path / "new" / "run") == []


def test_local_check_writable_on_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=r"afile: it is a file, not a directory") as e:
        open_store(str(tmp_path / "afile")).check_writable()
    assert e.value.exit_code == ExitCode.USAGE


def test_local_check_writable_under_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="part of that path is a file"):
        open_store(str(tmp_path / "afile" / "run")).check_writable()


def test_local_check_writable_permission_denied(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code = textwrap.dedent(f"""
        from dtrain.common.errors import UserError
        from dtrain.common.storage import open_store
        try:
            open_store({str(locked / "run")!r}).check_writable()
        except UserError as e:
            print(e)
    """)
    cmd = [sys.executable, "-c", code]
    if os.geteuid() == 0:  # root ignores permission bits unless it gives up CAP_DAC_OVERRIDE
        if shutil.which("setpriv") is None:
            pytest.skip("as root, needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        drop = "-dac_override,-dac_read_search"
        cmd = ["setpriv", f"--inh-caps={drop}", f"--bounding-set={drop}", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == (
        f"cannot write to {locked / 'run'}: permission denied; choose a directory you can write to"
    )
    assert os.listdir(locked) == []


def test_module_import_does_not_load_the_google_sdk() -> None:
    code = "import sys, dtrain.common.storage; print(any(m.startswith('google') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


# --- GCS specifics ---


def test_gcs_large_upload_uses_chunks(gcs_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Over 8 MiB the library switches to a resumable upload, sent here in 1 MiB chunks.
    monkeypatch.setattr(storage, "_CHUNK_SIZE", 1024 * 1024)
    data = os.urandom(9 * 1024 * 1024 + 17)
    s = open_store(gcs_bucket)
    s.write_bytes("big/state.pt", data)
    assert s.size("big/state.pt") == len(data)
    assert s.read_bytes("big/state.pt") == data


def test_gcs_client_is_shared(gcs_bucket: str) -> None:
    a, b = open_store(gcs_bucket), open_store(gcs_bucket + "/x")
    assert isinstance(a, GCSStore) and isinstance(b, GCSStore)
    assert a._client is b._client is a.child("y")._client


def test_gcs_missing_bucket(gcs_bucket: str) -> None:
    s = open_store("gs://dtrain-no-such-bucket-4f2a/runs")
    with pytest.raises(UserError, match="bucket gs://dtrain-no-such-bucket-4f2a does not exist") as e:
        s.check_writable()
    assert e.value.exit_code == ExitCode.USAGE


def test_gcs_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("google.cloud.storage", reason="needs google-cloud-storage")
    with socket.socket() as sock:  # a port that nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(storage, "_CHECK_RETRY_S", 0.5)
    with pytest.raises(UserError, match="cannot reach Google Cloud Storage") as e:
        open_store("gs://some-bucket/x").check_writable()
    assert e.value.exit_code == ExitCode.FAILURE


def test_gcs_missing_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("google.cloud.storage", reason="needs google-cloud-storage")
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-such-key.json"))
    with pytest.raises(UserError, match="gcloud auth application-default login"):
        open_store("gs://some-bucket/x")


def test_gcs_without_the_sdk() -> None:
    # A fresh interpreter, since an already imported google.cloud.storage cannot be unimported.
    code = textwrap.dedent("""
        import sys
        sys.modules["google.cloud.storage"] = None  # makes `from google.cloud import storage` fail
        from dtrain.common.errors import UserError
        from dtrain.common.storage import open_store
        try:
            open_store("gs://some-bucket/x")
        except UserError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "gs:// URLs need google-cloud-storage: pip install 'dtrain[gcp]'"
