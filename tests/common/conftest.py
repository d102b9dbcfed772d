"""A small file system that fills up: a tmpfs of a stated size, mounted for one test."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


class Tmpfs:
    def __init__(self, path: Path, size: str) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)

    def resize(self, size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", str(self.path)], check=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Tmpfs]]:
    """Mounts a tmpfs of the size asked for (mount's syntax: 64k, 2m) under tmp_path; unmounted
    when the test ends, however it ends."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mounted: list[Tmpfs] = []

    def mount(size: str) -> Tmpfs:
        mounted.append(Tmpfs(tmp_path / f"disk{len(mounted)}", size))
        return mounted[-1]

    try:
        yield mount
    finally:
        for fs in mounted:
            fs.unmount()
