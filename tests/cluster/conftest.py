"""Fixtures for tests that need several hosts: a test bed of network namespaces running sshd (scripts/testbed.py).

- ``testbed``: a 2-host ``Testbed`` (h0 is the master, h1 a worker) under a tmp dir, built once per session (CI
  runs every module of this folder in one session, the default tests and the slow ones apart) and destroyed at its
  end; skips, with the reason, where one cannot be built (not root, no sshd, no netns). Each module gets it as a
  fresh one would be: at the end of a module the servers it started in the hosts (an emulator) are stopped and
  the hosts' work directories emptied, so the next module finds only the hosts' sshd.
- ``known_hosts``: a known_hosts file listing the test bed's host keys.

To use the module itself (``Testbed``, ``Host``) or the ``ssh_argv(bed, host, known_hosts)`` helper from a test file
here, import them from ``tests/cluster/bed.py``: ``from .bed import Testbed, ssh_argv``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from .bed import Testbed


@pytest.fixture(scope="session")
def _session_testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    if reason := Testbed.available():
        pytest.skip(reason)
    bed = Testbed.create(2, tmp_path_factory.mktemp("testbed"))
    try:
        yield bed
    finally:
        bed.destroy()


@pytest.fixture(scope="module")
def testbed(_session_testbed: Testbed) -> Iterator[Testbed]:
    """Two hosts, h0 and h1, each with its own sshd; as built, for every module (see the module docstring)."""
    bed = _session_testbed
    started = len(bed._procs)  # the hosts' sshd, and what earlier modules left (nothing)
    yield bed
    for proc in bed._procs[started:]:  # servers this module started in the hosts (Testbed._spawn)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the namespace's own session (Testbed.popen)
        proc.wait()
    del bed._procs[started:]
    for host in bed.hosts:
        for entry in host.workdir.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


@pytest.fixture(scope="session")
def known_hosts(_session_testbed: Testbed) -> Path:
    """A known_hosts file with every host's key (inside the test bed's root dir, so it goes with it)."""
    return _session_testbed.write_known_hosts(_session_testbed.root / "known_hosts")
