"""Small file helpers the node-side modules share (code sync, requirements, checkpoint copies). Standard
library only: they run on nodes that may have nothing else."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1 << 20  # read files in pieces this big: memory stays flat whatever their size


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file's bytes, read in CHUNK pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created if missing) for the block: one process at a time."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
