"""What starting a job on this machine needs: the GPUs here (nvidia-smi, no torch), the process count
(dtrain.common.nproc) and torchrun's restart setting.

A job on this machine (a user's program or a built-in, the same way) is started by
dtrain.control.userjob.run_program_here (dtrain.control.launchers.here): torchrun on localhost in a session of
its own, stopped through the caller's Handle (SIGTERM and the stop file, SIGKILL after the grace period),
watched for hangs (dtrain.control.hangwatch), and given dtrain's variables (dtrain.common.jobenv).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from dtrain.common.nproc import MAX_PROCS_PER_CORE, auto_nproc, processes  # noqa: F401  # their home: common

# torchrun's restarts (--max-restarts) with a fresh rendezvous store each time. By default (torch >= 2.4) the
# workers of every restart share the agent's one TCPStore, unprefixed: a restarted rank can read its peer's
# gloo address from the previous generation before the peer rewrites it, and fails with "Connection refused"
# (2 of 4 restarts of the torchrun script in tests/control/test_local_hangs.py). With this, rank 0 hosts a new
# store for every start.
RESTARTABLE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
POLL_S = 0.2


def count_gpus() -> int:
    """GPUs visible to this machine, without importing torch: ask nvidia-smi."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return min(n, len([v for v in visible.split(",") if v.strip()])) if visible else n
