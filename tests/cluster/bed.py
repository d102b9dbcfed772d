"""The test bed module (scripts/testbed.py, not a package) for tests in tests/cluster, and ssh helpers.

Test files import from here: ``from .bed import Testbed, ssh_argv``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTBED_PY = REPO / "scripts" / "testbed.py"


def _load():
    """Imports scripts/testbed.py once, as module ``dtrain_testbed`` (registered first: dataclasses need it)."""
    if "dtrain_testbed" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dtrain_testbed", TESTBED_PY)
        module = importlib.util.module_from_spec(spec)
        sys.modules["dtrain_testbed"] = module
        spec.loader.exec_module(module)
    return sys.modules["dtrain_testbed"]


testbed = _load()
Testbed = testbed.Testbed
Host = testbed.Host


def ssh_argv(bed: Testbed, host: Host, known_hosts: Path | str) -> list[str]:
    """``ssh`` to ``host`` as root with the test bed's key, checking its host key strictly against ``known_hosts``.

    Append the remote command to the returned list.
    """
    return ["ssh", "-i", str(bed.key), "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", f"root@{host.address}"]  # fmt: skip
