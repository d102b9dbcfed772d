"""One file API for a local directory and a gs://bucket/prefix URL.

The checkpointer writes a checkpoint's files, then meta.json, then LATEST, and a reader that
runs at any moment (another rank, a resumed job) must see each object either whole or not at
all. So `write_bytes` is an atomic replace: locally a temp file in the same directory, fsynced
and renamed over the target; on GCS a single upload, which only becomes visible when complete.
The order of writes is the caller's: this module promises atomicity per object, nothing more.

google-cloud-storage is imported only when a gs:// store is opened, so that this module
works (for local paths) without the Google SDK installed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dtrain.common.errors import ExitCode, UserError

if TYPE_CHECKING:
    from google.cloud import storage as gcs

_TMP_PREFIX = ".dtrain-tmp-"  # in-flight local writes; list() hides them

# Resumable uploads are sent, and retried, one chunk at a time: a 16 MiB chunk bounds what a
# flaky link re-sends. Must be a multiple of 256 KiB. Smaller objects (<= 8 MiB) go in one request.
_CHUNK_SIZE = 16 * 1024 * 1024
_TIMEOUT_S = 120.0  # per HTTP request (connect and read), not per transfer
# appends to a gs:// object (append_bytes): the parts uploaded before a compose, and when to rewrite
# the object whole (GCS refuses a composite of more than 1,024 components).
_APPEND_PART = ".dtrain-append-"
APPEND_COMPACT_AT = 1000
# check_writable runs before training starts; a missing network should fail it in seconds,
# not after the library's default two minutes of retries.
_CHECK_RETRY_S = 10.0

_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_NEEDED_PERMISSIONS = (
    "storage.objects.create",
    "storage.objects.delete",  # also needed to overwrite an object (LATEST)
    "storage.objects.get",
    "storage.objects.list",
)


class DiskFull(OSError):
    """A local write that found no space left (ENOSPC, or EDQUOT: over quota). Carries what a
    one-line message needs: the file, the bytes it needed, and the bytes free once the partial
    file was removed."""

    def __init__(self, path: str, needed: int, free: int) -> None:
        super().__init__(errno.ENOSPC, f"no space left on device for {path}: {needed:,} bytes needed, {free:,} free")
        self.path, self.needed, self.free = path, needed, free


class Store(Protocol):
    """Files addressed by '/'-separated paths relative to `url`.

    Only files exist (as on GCS): `exists`, `size` and `read_bytes` are about files, and a
    directory is just a prefix of file paths. `list(p)` and `delete(p)` take `p` as a file or
    a directory: they match `p` itself and everything under `p/`, never `p` + other characters.
    """

    url: str

    def join(self, rel: str) -> str: ...
    def child(self, rel: str) -> Store: ...
    def write_bytes(self, rel: str, data: bytes) -> None: ...
    def append_bytes(self, rel: str, data: bytes) -> None: ...
    def read_bytes(self, rel: str, start: int = 0) -> bytes: ...
    def exists(self, rel: str) -> bool: ...
    def size(self, rel: str) -> int: ...
    def list(self, rel_prefix: str = "") -> list[str]: ...
    def delete(self, rel_prefix: str) -> None: ...
    def check_writable(self) -> None: ...


def is_remote(url: str) -> bool:
    return url.startswith("gs://")


def open_store(url: str) -> Store:
    """A store for a local path (relative paths resolve against the working directory) or gs://bucket[/prefix]."""
    if is_remote(url):
        bucket, _, prefix = url[len("gs://") :].partition("/")
        if not bucket:
            raise UserError(f"bad storage URL {url!r}: expected gs://BUCKET[/PREFIX]")
        if not _BUCKET_RE.fullmatch(bucket):
            raise UserError(
                f"bad bucket name {bucket!r} in {url!r}: use 3-222 lowercase letters, digits, '-', '_' or '.'"
            )
        return GCSStore(bucket, _clean(prefix))
    if "://" in url:
        raise UserError(f"unsupported storage URL {url!r}: use a local path or gs://BUCKET[/PREFIX]")
    return LocalStore(Path(url).expanduser().resolve())


def _clean(rel: str) -> str:
    """Normalise a relative path to 'a/b/c' ('' for the root); refuse paths that leave the store."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"path {rel!r} leaves the store")
    return "/".join(parts)


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    def _path(self, rel: str) -> Path:
        rel = _clean(rel)
        return self.root / rel if rel else self.root

    def join(self, rel: str) -> str:
        return str(self._path(rel))

    def child(self, rel: str) -> LocalStore:
        return LocalStore(self._path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        target = self._path(rel)
        try:
            self._replace(target, data)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise DiskFull(str(target), len(data), _free_bytes(target.parent)) from e

    @staticmethod
    def _replace(target: Path, data: bytes) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{_TMP_PREFIX}{secrets.token_hex(4)}-{target.name}")
        # os.open with 0o666 (not mkstemp's 0o600) so the file gets the usual umask mode.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # The rename is durable only once the directory entry is on disk.
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def append_bytes(self, rel: str, data: bytes) -> None:
        """Add `data` at the end (creating the file): a reader sees the file grow, never rewritten."""
        target = self._path(rel)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("ab") as f:
                f.write(data)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise DiskFull(str(target), len(data), _free_bytes(target.parent)) from e

    def read_bytes(self, rel: str, start: int = 0) -> bytes:
        try:
            with self._path(rel).open("rb") as f:
                f.seek(start)
                return f.read()
        except FileNotFoundError:
            raise FileNotFoundError(self.join(rel)) from None

    def exists(self, rel: str) -> bool:
        return self._path(rel).is_file()

    def size(self, rel: str) -> int:
        path = self._path(rel)
        if not path.is_file():
            raise FileNotFoundError(str(path))
        return path.stat().st_size

    def list(self, rel_prefix: str = "") -> list[str]:
        base = self._path(rel_prefix)
        if base.is_file():
            return [_clean(rel_prefix)]
        found = []
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                if not name.startswith(_TMP_PREFIX):
                    found.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(found)

    def delete(self, rel_prefix: str) -> None:
        path = self._path(rel_prefix)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass

    def check_writable(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"cannot write to {self.url}: it is a file, not a directory; choose another location")
        probe = self.root / f"{_TMP_PREFIX}probe-{secrets.token_hex(4)}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except (FileExistsError, NotADirectoryError):
            raise UserError(
                f"cannot write to {self.url}: part of that path is a file, not a directory; choose another location"
            ) from None
        except PermissionError:
            raise UserError(
                f"cannot write to {self.url}: permission denied; choose a directory you can write to"
            ) from None
        except OSError as e:  # read-only file system, disk full, ...
            raise UserError(f"cannot write to {self.url}: {e.strerror}; choose another location") from None


def _free_bytes(path: Path) -> int:
    """Bytes free on the file system holding `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@functools.cache
def _client_for(pid: int, emulator_host: str | None) -> gcs.Client:
    # One client per process, shared by threads (the library documents this as safe). The pid
    # is part of the key because a client must not be carried across os.fork().
    try:
        import google.auth.exceptions
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
    except ImportError:
        raise UserError("gs:// URLs need google-cloud-storage: pip install 'dtrain[gcp]'") from None
    if emulator_host:
        # The library sends requests to STORAGE_EMULATOR_HOST by itself; it needs no credentials.
        project = os.environ.get("GOOGLE_CLOUD_PROJECT", "dtrain-local")
        return storage.Client(project=project, credentials=AnonymousCredentials())
    try:
        return storage.Client()
    except google.auth.exceptions.DefaultCredentialsError:
        raise UserError(
            "no Google Cloud credentials found for gs:// storage: run "
            "`gcloud auth application-default login` or set GOOGLE_APPLICATION_CREDENTIALS to a key file"
        ) from None


def _client() -> gcs.Client:
    return _client_for(os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST"))


class GCSStore:
    def __init__(self, bucket: str, prefix: str = "") -> None:
        self._client = _client()
        self._bucket = self._client.bucket(bucket)
        self.bucket_name = bucket
        self.prefix = prefix
        self.url = f"gs://{bucket}/{prefix}" if prefix else f"gs://{bucket}"

    def __repr__(self) -> str:
        return f"GCSStore({self.url!r})"

    def _name(self, rel: str) -> str:
        return "/".join(p for p in (self.prefix, _clean(rel)) if p)

    def join(self, rel: str) -> str:
        rel = _clean(rel)
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> GCSStore:
        return GCSStore(self.bucket_name, self._name(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        from google.cloud.storage.retry import DEFAULT_RETRY

        blob = self._bucket.blob(self._name(rel), chunk_size=_CHUNK_SIZE)
        # Overwriting with the same bytes is idempotent, so retrying is safe. Passed explicitly
        # because google-cloud-storage 2.x retried uploads only with if_generation_match set.
        blob.upload_from_string(data, content_type="application/octet-stream", timeout=_TIMEOUT_S, retry=DEFAULT_RETRY)

    def append_bytes(self, rel: str, data: bytes) -> None:
        """Add `data` at the end of an object without rewriting it: the new bytes are uploaded as an
        object of their own, then composed onto the end server-side (objects.compose), so a reader
        sees one object that grows. A composite object may have at most 1,024 components; past
        APPEND_COMPACT_AT the object is rewritten once (downloaded and uploaded whole), which resets
        the count. One writer per object (rank 0)."""
        from google.cloud.storage.retry import DEFAULT_RETRY

        blob = self._bucket.blob(self._name(rel))
        if not blob.exists(timeout=_TIMEOUT_S):
            self.write_bytes(rel, data)
            return
        part = self._bucket.blob(f"{self._name(rel)}{_APPEND_PART}{secrets.token_hex(4)}")
        part.upload_from_string(data, content_type="application/octet-stream", timeout=_TIMEOUT_S, retry=DEFAULT_RETRY)
        try:
            blob.compose([blob, part], timeout=_TIMEOUT_S)
        finally:
            with contextlib.suppress(Exception):
                part.delete(timeout=_TIMEOUT_S)
        if (blob.component_count or 0) >= APPEND_COMPACT_AT:
            self.write_bytes(rel, self.read_bytes(rel))

    def read_bytes(self, rel: str, start: int = 0) -> bytes:
        from google.api_core.exceptions import NotFound, RequestRangeNotSatisfiable

        try:
            return self._bucket.blob(self._name(rel)).download_as_bytes(start=start or None, timeout=_TIMEOUT_S)
        except NotFound:
            raise FileNotFoundError(self.join(rel)) from None
        except RequestRangeNotSatisfiable:  # asked from the end: nothing new
            return b""

    def exists(self, rel: str) -> bool:
        return self._bucket.blob(self._name(rel)).exists(timeout=_TIMEOUT_S)

    def size(self, rel: str) -> int:
        blob = self._bucket.get_blob(self._name(rel), timeout=_TIMEOUT_S)
        if blob is None:
            raise FileNotFoundError(self.join(rel))
        return blob.size

    def _blobs(self, rel_prefix: str) -> list[gcs.Blob]:
        name = self._name(rel_prefix)
        blobs = self._client.list_blobs(self._bucket, prefix=name, timeout=_TIMEOUT_S)
        if not name:
            return list(blobs)
        # The server matches characters, not path components: drop "a/bc" when asked for "a/b".
        return [b for b in blobs if b.name == name or b.name.startswith(name + "/")]

    def list(self, rel_prefix: str = "") -> list[str]:
        skip = len(self.prefix) + 1 if self.prefix else 0
        # Names ending in "/" are folder placeholders made by the console, not files; an append's
        # part object is not a file either.
        return sorted(
            b.name[skip:] for b in self._blobs(rel_prefix) if not b.name.endswith("/") and _APPEND_PART not in b.name
        )

    def delete(self, rel_prefix: str) -> None:
        from google.api_core.exceptions import NotFound

        for blob in self._blobs(rel_prefix):
            with contextlib.suppress(NotFound):  # someone else deleted it meanwhile: fine
                blob.delete(timeout=_TIMEOUT_S)

    def check_writable(self) -> None:
        import google.auth.exceptions
        import requests
        from google.api_core.exceptions import Forbidden, NotFound, RetryError
        from google.cloud.storage.retry import DEFAULT_RETRY

        bucket = f"gs://{self.bucket_name}"
        try:
            # Asks what we may do without writing anything (a probe object could be stuck
            # under a retention policy).
            granted = self._bucket.test_iam_permissions(
                list(_NEEDED_PERMISSIONS),
                timeout=_TIMEOUT_S,
                retry=DEFAULT_RETRY.with_timeout(_CHECK_RETRY_S),
            )
        except NotFound:
            raise UserError(
                f"bucket {bucket} does not exist: create it (gcloud storage buckets create {bucket}) or fix the URL"
            ) from None
        except Forbidden:
            raise UserError(
                f"no access to bucket {bucket}: grant your account roles/storage.objectAdmin on it"
            ) from None
        except google.auth.exceptions.RefreshError:
            raise UserError(
                f"Google Cloud credentials were rejected while checking {bucket}: "
                "run `gcloud auth application-default login` or fix GOOGLE_APPLICATION_CREDENTIALS"
            ) from None
        except (RetryError, requests.RequestException, google.auth.exceptions.TransportError) as e:
            cause = e.cause if isinstance(e, RetryError) and e.cause else e
            raise UserError(
                f"cannot reach Google Cloud Storage to check {bucket} ({type(cause).__name__}): "
                "check the network and try again",
                exit_code=ExitCode.FAILURE,
            ) from None
        missing = sorted(set(_NEEDED_PERMISSIONS) - set(granted))
        if missing:
            raise UserError(
                f"cannot write to {self.url}: missing {', '.join(missing)}; "
                f"grant your account roles/storage.objectAdmin on {bucket}"
            )
