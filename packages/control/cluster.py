"""The cluster model every backend produces: a list of nodes, one of them the master, and what a
launcher needs to know about them. Backends (dtrain.control.backends) differ only in how the list is
made and destroyed. Also the checks shared by backends' tables (keys, types, image references).

Nothing here touches the network; dtrain.control.ssh does.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import UserError

if TYPE_CHECKING:
    from dtrain.control.slurm.spec import SlurmSpec

DEFAULT_RDZV_PORT = 29400
DEFAULT_RDZV_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    address: str  # the cluster address other nodes reach it at
    user: str = ""  # "" : ssh's own default (your user name, or ~/.ssh/config)
    port: int = 22
    key: str = ""  # private key file; "" : ssh's defaults and agent
    gpus: int = 0
    master: bool = False
    python: str = "python3"  # the interpreter on the node that has torch (synced mode)
    workdir: str = "dtrain"  # per-run directories go under it; relative to the SSH user's home
    interface: str = ""  # NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for this node
    ssh_host: str = ""  # where to SSH to when it is not `address` (a public IP, a ~/.ssh/config alias)
    docker: str = "docker"  # the Docker CLI on the node (container mode), e.g. "sudo docker"
    proxy_command: str = ""  # ssh's ProxyCommand to reach it (a gcp node without an external IP: IAP)

    @property
    def destination(self) -> str:
        host = self.ssh_host or self.address
        return f"{self.user}@{host}" if self.user else host

    def describe(self) -> str:
        return f"{self.name} ({self.destination}:{self.port})"


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    backend: str
    nodes: tuple[Node, ...]  # the master first
    rdzv_port: int = DEFAULT_RDZV_PORT
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT_S
    known_hosts: Path = dataclasses.field(default_factory=lambda: default_known_hosts())
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # set for the job on every node
    shared_fs: bool = False  # --output is a path every node sees (NFS): no gs:// needed
    default_output: str = ""  # where runs go when --output is not given (gcp: the cluster's bucket)
    image: str = ""  # container mode: every node runs the job in this image (docker run); "": synced mode
    needs_image: bool = False  # the nodes have no Python with torch: synced mode cannot work
    launcher: str = "ssh"  # how jobs start: "ssh" (dtrain.control.remote), "local" (no SSH) or "slurm"
    slurm: SlurmSpec | None = None  # the cluster's Slurm (launcher "slurm"): dtrain.control.slurm
    # Each node's estimated USD per hour, by name (gcp: dtrain.control.gcp.prices); None: no price is
    # known (a user's own machines or Slurm cluster).
    node_usd_per_hour: Mapping[str, float] | None = None
    # What the cluster's launcher needs from its table that the nodes do not say (a Kubernetes namespace, a pod's
    # resources): the backend's to fill and its launcher's to read, so a new pair of them needs no field here.
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def master(self) -> Node:
        return self.nodes[0]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise UserError(f"cluster {self.name!r} has no node {name!r} (nodes: {', '.join(n.name for n in self.nodes)})")

    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)


def config_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dtrain"


def default_known_hosts() -> Path:
    """The host keys dtrain trusts: its own file, so that accepting a node never edits ~/.ssh."""
    return config_dir() / "known_hosts"


IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._:/@-]*[A-Za-z0-9_.-]$|^[a-z0-9]$")


def check_image(image: str, where: str) -> str:
    """A Docker image reference (REGISTRY/PATH:TAG or @sha256:...), as `docker pull` takes it."""
    if not IMAGE_RE.match(image) or "//" in image:
        raise UserError(
            f"{where}: image {image!r} is not an image reference: expected e.g. "
            "us-central1-docker.pkg.dev/PROJECT/REPO/dtrain-train:src-0123456789ab (dtrain build prints it)"
        )
    return image


def typed(value: Any, tp: type, key: str, where: str) -> Any:
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if not ok:
        name = {int: "an integer", str: "a string", bool: "true or false"}.get(tp, tp.__name__)
        raise UserError(f"{where}: {key} must be {name}, got {value!r}")
    return value


_DURATION_RE = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def duration(value: Any, key: str, where: str) -> float:
    """A duration from a cluster table, in seconds: an integer (seconds) or "90s", "30m", "2h", "1h30m"."""
    if isinstance(value, int) and not isinstance(value, bool):
        seconds = value
    elif isinstance(value, str) and (m := _DURATION_RE.match(value.strip())) and any(m.groups()):
        h, mi, s = (int(g or 0) for g in m.groups())
        seconds = h * 3600 + mi * 60 + s
    else:
        raise UserError(f'{where}: {key} must be a duration like "30m", "2h", "90s" or seconds, got {value!r}')
    if seconds <= 0:
        raise UserError(f"{where}: {key} must be more than 0 seconds, got {value!r}")
    return float(seconds)


ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def env_table(value: Any, where: str) -> dict[str, str]:
    """A table's `env` (NAME = "value", set for the job on every node), checked: one line naming a bad entry."""
    if not isinstance(value, dict):
        raise UserError(f'{where}: env must be a table of NAME = "value", got {type(value).__name__}')
    for k, v in value.items():
        if not ENV_NAME_RE.match(k) or not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise UserError(f"{where}: env.{k} must be a variable name with a string value")
    return {k: str(v) for k, v in value.items()}


def check_keys(table: Mapping[str, Any], known: set[str], where: str) -> None:
    for k in table:
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
            raise UserError(f"{where}: unknown key {k!r} ({hint})")
