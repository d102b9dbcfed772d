"""Every environment variable the workload side reads, in one place.

torchrun (and any launcher that speaks its protocol) describes the process's place in the job
through RANK/WORLD_SIZE/...; without them the workload runs as a single process. The rest are
dtrain's own knobs for the workload side, documented in docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping
from pathlib import Path

# DTRAIN_* variables that are not settings: read here by the workloads, or by scripts/. The CLI,
# which rejects unknown DTRAIN_* names as typos, lets these through.
NON_SETTING_ENV = frozenset(
    {
        "DTRAIN_OFFLINE",  # never try downloads
        "DTRAIN_CACHE_DIR",  # downloads and prepared data
        "DTRAIN_TORCH",  # scripts/setup.sh: which torch build to install
        "DTRAIN_STRICT_SKIPS",  # scripts/test.sh: 0 lets tests skip for reasons CI does not accept
        "DTRAIN_TEST_DEADLINE_S",  # scripts/test.sh: the test run's deadline
        "DTRAIN_TEST_DEADLINE_GRACE_S",  # scripts/test.sh: how long a test may run past it
        "DTRAIN_TEST_SHARDS",  # scripts/test.sh: how many pytest sessions run the suite side by side
        "DTRAIN_TEST_DURATIONS_OUT",  # scripts/test.sh: where to keep each test's seconds
    }
)


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    run_id: str  # torchrun's --rdzv-id; "none" when not set
    restart_count: int
    hostname: str
    under_launcher: bool  # False: a plain `python -m ...` with no torchrun around it
    socket_ifnames: dict[str, str]  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME as given

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv:
        e = os.environ if environ is None else environ
        under = "RANK" in e and "WORLD_SIZE" in e
        return cls(
            rank=int(e.get("RANK", 0)),
            local_rank=int(e.get("LOCAL_RANK", 0)),
            world_size=int(e.get("WORLD_SIZE", 1)),
            local_world_size=int(e.get("LOCAL_WORLD_SIZE", 1)),
            master_addr=e.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(e.get("MASTER_PORT", 29500)),
            run_id=e.get("TORCHELASTIC_RUN_ID", "none"),
            restart_count=int(e.get("TORCHELASTIC_RESTART_COUNT", 0)),
            hostname=socket.gethostname(),
            under_launcher=under,
            socket_ifnames={k: e[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if e.get(k)},
        )


def data_dir(workload: str) -> str:
    """DTRAIN_<WORKLOAD>_DATA_DIR: where to look for data when no --data-dir was given."""
    return os.environ.get(f"DTRAIN_{workload.upper()}_DATA_DIR", "")


def cache_dir() -> Path:
    """Downloads and prepared data: $DTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/dtrain, else ~/.cache/dtrain."""
    if os.environ.get("DTRAIN_CACHE_DIR"):
        return Path(os.environ["DTRAIN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dtrain"


def offline() -> bool:
    """True if downloads must not be tried (DTRAIN_OFFLINE=1, or HF_HUB_OFFLINE=1 as users already set it)."""
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("DTRAIN_OFFLINE", "HF_HUB_OFFLINE"))


def debug() -> bool:
    """DTRAIN_DEBUG=1: keep torchrun's own logs (the CLI's --debug sets it for the job)."""
    return os.environ.get("DTRAIN_DEBUG", "").lower() in ("1", "true", "yes")


def console_is_terminal() -> bool | None:
    """The launcher sets DTRAIN_INTERNAL_TTY=1 when its own stdout is a terminal, so rank 0 can draw a
    live progress bar even though torchrun's pipes sit in between. None: let rich decide."""
    v = os.environ.get("DTRAIN_INTERNAL_TTY")
    return None if v is None else v == "1"


def fault_pause_before_commit() -> float:
    """Fault injection for tests: seconds the checkpoint writer sleeps after writing a checkpoint's
    files and before its manifest, so a test can kill the process mid-save. 0 in normal use."""
    return float(os.environ.get("DTRAIN_INTERNAL_FAULT_PAUSE_BEFORE_COMMIT", "0") or 0)


def progress_events() -> bool:
    """DTRAIN_INTERNAL_PROGRESS=1: rank 0 prints its progress as machine-readable lines (the SSH
    launcher reads them and draws the bar on the user's terminal)."""
    return os.environ.get("DTRAIN_INTERNAL_PROGRESS") == "1"
