"""Fixtures for tests that need several hosts: a test bed of network namespaces running sshd (scripts/testbed.py).

- ``testbed`` (module scope): a 2-host ``Testbed`` (h0 is the master, h1 a worker) under a tmp dir, destroyed
  afterwards; skips, with the reason, where one cannot be built (not root, no sshd, no netns).
- ``known_hosts`` (module scope): a known_hosts file listing the test bed's host keys.

To use the module itself (``Testbed``, ``Host``) or the ``ssh_argv(bed, host, known_hosts)`` helper from a test file
here, import them from ``tests/cluster/bed.py``: ``from .bed import Testbed, ssh_argv``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .bed import Testbed


@pytest.fixture(scope="module")
def testbed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Testbed]:
    """Two hosts, h0 and h1, each with its own sshd; always destroyed at the end of the module."""
    if reason := Testbed.available():
        pytest.skip(reason)
    bed = Testbed.create(2, tmp_path_factory.mktemp("testbed"))
    try:
        yield bed
    finally:
        bed.destroy()


@pytest.fixture(scope="module")
def known_hosts(testbed: Testbed) -> Path:
    """A known_hosts file with every host's key (inside the test bed's root dir, so it goes with it)."""
    return testbed.write_known_hosts(testbed.root / "known_hosts")
