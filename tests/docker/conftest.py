"""Fixtures for the image tests: the Docker daemon (reused, or started as root and stopped at the end), the
locally made base image and the CPU training image built once per session (tests/docker/imagetest.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator

import imagetest as d
import pytest


@pytest.fixture(scope="session")
def dockerd() -> Iterator[d.Daemon]:
    daemon = d.Daemon()
    if reason := daemon.start():
        pytest.skip(reason)
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.fixture(scope="session")
def base_image(dockerd: d.Daemon) -> str:
    if reason := d.base_image():
        pytest.skip(reason)
    return d.BASE_TAG


@pytest.fixture(scope="session")
def train_image(base_image: str) -> str:
    """dtrain-train:src-<hash> of this checkout, built with `dtrain build --no-push` (a cache hit when the
    sources have not changed)."""
    if reason := d.stage_wheel():
        pytest.skip(reason)
    tag, _out = d.build_train_image()
    return tag


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Debian's docker-registry (the CNCF distribution registry) on 0.0.0.0:<port>; yields 127.0.0.1:<port>."""
    binary = shutil.which("docker-registry")
    if not binary:
        pytest.skip("needs docker-registry (apt-get install docker-registry)")
    root = tmp_path_factory.mktemp("registry")
    port = d.free_port()
    (root / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
        f"http:\n  addr: 0.0.0.0:{port}\n"
    )
    log = open(root / "registry.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([binary, "serve", str(root / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (root / "registry.log").read_text()
                time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
