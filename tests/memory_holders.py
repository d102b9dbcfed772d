"""Processes that hold a known amount of resident memory, for the resource curves' tests (dtrain.common.resources)."""

from __future__ import annotations

import os
import subprocess
import sys

MIB = 1 << 20
# Holds argv[1] MiB (every page touched, so resident), says "ready", then waits to be killed.
HOLD = (
    "import sys, time; b = bytearray(int(sys.argv[1]) << 20); b[::4096] = b'x' * len(b[::4096]); "
    "print('ready', flush=True); time.sleep(60)"
)


def hold(mb: int, **env: str) -> subprocess.Popen:
    """A process holding `mb` MiB, with `env` added to this one's environment (RANK=... makes it a rank)."""
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(mb)], env={**os.environ, **env}, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p
