"""The cluster model: a list of nodes, one of them the master. The backends differ only in how the
list is made: `local` is this machine, `hosts` reads an inventory (inline in dtrain.toml or in a
file of its own), `gcp` asks Compute Engine for the VMs `dtrain up` made.

An inventory, in dtrain.toml or as the whole of a file named by `inventory = "hosts.toml"`:

    [clusters.lab]
    backend = "hosts"
    user = "train"                 # defaults for every node; a node may override each of them
    key = "~/.ssh/id_ed25519"
    python = "/opt/dtrain/bin/python"
    rdzv_port = 29400

    [[clusters.lab.nodes]]
    name = "n0"
    address = "10.0.0.10"          # the cluster address: rendezvous, --local-addr, port checks
    master = true
    gpus = 1

    [[clusters.lab.nodes]]
    name = "n1"
    address = "10.0.0.11"

Nothing here touches the network; cli/ssh.py does.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

from dtrain.common.errors import UserError

DEFAULT_RDZV_PORT = 29400
DEFAULT_RDZV_TIMEOUT_S = 120
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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


# Keys of a node; each but name/address/master may also be set once for all nodes.
NODE_KEYS = {f.name: f for f in dataclasses.fields(Node)}
NODE_TYPES = typing.get_type_hints(Node)
NODE_DEFAULT_KEYS = set(NODE_KEYS) - {"name", "address", "master", "ssh_host"}
CLUSTER_KEYS = {"rdzv_port", "rdzv_timeout", "known_hosts", "env", "shared_fs", "nodes", "image"}
IMAGE_RE = re.compile(r"^[a-z0-9][a-z0-9._:/@-]*[A-Za-z0-9_.-]$|^[a-z0-9]$")
HOSTS_KEYS = NODE_DEFAULT_KEYS | CLUSTER_KEYS | {"inventory"}


def hosts_cluster(name: str, spec: Mapping[str, Any], src: str, base_dir: Path) -> Cluster:
    """The `hosts` backend: the node list from [clusters.NAME] (`spec`, from file `src`) or from
    the inventory file it names (relative paths are relative to `base_dir`)."""
    where = f"{src} [clusters.{name}]"
    check_keys(spec, HOSTS_KEYS | {"backend"}, where)
    spec = {k: v for k, v in spec.items() if k != "backend"}
    if "inventory" in spec:
        inv = Path(os.path.expanduser(_typed(spec["inventory"], str, "inventory", where)))
        inv = inv if inv.is_absolute() else base_dir / inv
        if "nodes" in spec:
            raise UserError(f"{where}: give the nodes inline or in inventory = {str(inv)!r}, not both")
        data = _read_inventory(inv)
        check_keys(data, HOSTS_KEYS - {"inventory"}, f"inventory {inv}")
        # The cluster table's own settings are defaults the inventory may refine.
        spec = {**{k: v for k, v in spec.items() if k != "inventory"}, **data}
        where, base_dir = f"inventory {inv}", inv.parent
    return _build_cluster(name, "hosts", spec, where, base_dir)


def _read_inventory(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fp:
            return tomllib.load(fp)
    except FileNotFoundError:
        raise UserError(f"inventory {path} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"inventory {path}: invalid TOML: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"inventory {path}: cannot read it: {e}") from None


def _build_cluster(name: str, backend: str, spec: Mapping[str, Any], where: str, base_dir: Path) -> Cluster:
    defaults = {k: spec[k] for k in NODE_DEFAULT_KEYS if k in spec}
    raw_nodes = spec.get("nodes")
    if not raw_nodes:
        raise UserError(f"{where}: no nodes: add [[clusters.{name}.nodes]] tables with a name and an address")
    if not isinstance(raw_nodes, list) or not all(isinstance(n, dict) for n in raw_nodes):
        raise UserError(f"{where}: nodes must be an array of tables ([[nodes]]), got {type(raw_nodes).__name__}")
    nodes = [_node(i, {**defaults, **raw}, where, base_dir) for i, raw in enumerate(raw_nodes)]
    _check_unique(nodes, where)
    masters = [n for n in nodes if n.master]
    if len(masters) > 1:
        raise UserError(f"{where}: more than one master ({', '.join(n.name for n in masters)}): mark exactly one")
    master = masters[0] if masters else nodes[0]  # none marked: the first node leads
    ordered = (dataclasses.replace(master, master=True), *[n for n in nodes if n is not master])

    rdzv_port = _typed(spec.get("rdzv_port", DEFAULT_RDZV_PORT), int, "rdzv_port", where)
    if not 1 <= rdzv_port <= 65535:
        raise UserError(f"{where}: rdzv_port must be a TCP port (1-65535), got {rdzv_port}")
    rdzv_timeout = _typed(spec.get("rdzv_timeout", DEFAULT_RDZV_TIMEOUT_S), int, "rdzv_timeout", where)
    if rdzv_timeout < 5:
        raise UserError(f"{where}: rdzv_timeout must be at least 5 seconds, got {rdzv_timeout}")
    known = spec.get("known_hosts")
    known_path = default_known_hosts()
    if known is not None:
        known_path = Path(os.path.expanduser(_typed(known, str, "known_hosts", where)))
        known_path = known_path if known_path.is_absolute() else base_dir / known_path
    env = spec.get("env", {})
    if not isinstance(env, dict):
        raise UserError(f'{where}: env must be a table of NAME = "value", got {type(env).__name__}')
    for k, v in env.items():
        if not ENV_NAME_RE.match(k) or not isinstance(v, (str, int, float)) or isinstance(v, bool):
            raise UserError(f"{where}: env.{k} must be a variable name with a string value")
    shared_fs = _typed(spec.get("shared_fs", False), bool, "shared_fs", where)
    image = check_image(_typed(spec.get("image", ""), str, "image", where), where) if spec.get("image") else ""
    return Cluster(
        name=name,
        backend=backend,
        nodes=ordered,
        rdzv_port=rdzv_port,
        rdzv_timeout=rdzv_timeout,
        known_hosts=known_path,
        env={k: str(v) for k, v in env.items()},
        shared_fs=shared_fs,
        image=image,
    )


def check_image(image: str, where: str) -> str:
    """A Docker image reference (REGISTRY/PATH:TAG or @sha256:...), as `docker pull` takes it."""
    if not IMAGE_RE.match(image) or "//" in image:
        raise UserError(
            f"{where}: image {image!r} is not an image reference: expected e.g. "
            "us-central1-docker.pkg.dev/PROJECT/REPO/dtrain-train:src-0123456789ab (dtrain build prints it)"
        )
    return image


def _node(i: int, raw: Mapping[str, Any], where: str, base_dir: Path) -> Node:
    label = f"node {raw['name']!r}" if isinstance(raw.get("name"), str) else f"node #{i + 1}"
    unknown = set(raw) - set(NODE_KEYS)
    if unknown:
        bad = sorted(unknown)[0]
        close = difflib.get_close_matches(bad, list(NODE_KEYS), n=1)
        hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(NODE_KEYS)}"
        raise UserError(f"{where}: {label}: unknown key {bad!r} ({hint})")
    for required in ("name", "address"):
        if not raw.get(required):
            raise UserError(f"{where}: {label} has no {required}")
    values: dict[str, Any] = {}
    for key in NODE_KEYS:
        if key in raw:
            values[key] = _typed(raw[key], NODE_TYPES[key], key, f"{where}: {label}")
    node_name, address = values["name"], values["address"]
    if not NAME_RE.match(node_name):
        raise UserError(f"{where}: {label}: name must be letters, digits, '.', '_' or '-' (up to 63)")
    if not _is_address(address):
        raise UserError(f"{where}: {label}: address {address!r} is not an IP address or host name")
    if not 1 <= values.get("port", 22) <= 65535:
        raise UserError(f"{where}: {label}: port must be 1-65535, got {values['port']}")
    if values.get("gpus", 0) < 0:
        raise UserError(f"{where}: {label}: gpus must be >= 0, got {values['gpus']}")
    if values.get("key"):
        key = Path(os.path.expanduser(values["key"]))
        key = key if key.is_absolute() else base_dir / key
        if not key.is_file():
            raise UserError(f"{where}: {label}: SSH key {key} not found")
        values["key"] = str(key)
    return Node(**values)


def _check_unique(nodes: list[Node], where: str) -> None:
    seen_names: dict[str, Node] = {}
    seen_addrs: dict[str, Node] = {}
    for n in nodes:
        if n.name in seen_names:
            raise UserError(f"{where}: node {n.name!r} is listed twice")
        addr = _canonical(n.address)
        if addr in seen_addrs:
            raise UserError(
                f"{where}: node {n.name!r} has the same address {n.address} as node {seen_addrs[addr].name!r}"
            )
        seen_names[n.name], seen_addrs[addr] = n, n


def _canonical(address: str) -> str:
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return address.lower().rstrip(".")


def _is_address(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
        return True
    except ValueError:
        return bool(HOSTNAME_RE.match(address))


def _typed(value: Any, tp: type, key: str, where: str) -> Any:
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if not ok:
        name = {int: "an integer", str: "a string", bool: "true or false"}.get(tp, tp.__name__)
        raise UserError(f"{where}: {key} must be {name}, got {value!r}")
    return value


def check_keys(table: Mapping[str, Any], known: set[str], where: str) -> None:
    for k in table:
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(sorted(known))}"
            raise UserError(f"{where}: unknown key {k!r} ({hint})")


def local_cluster() -> Cluster:
    """This machine as a one-node cluster (what `local` means to commands that take a cluster)."""
    return Cluster(name="local", backend="local", nodes=(Node(name="local", address="127.0.0.1", master=True),))


def resolve(cfg: Any) -> Cluster:
    """The node list of a [clusters.NAME] (a settings.ClusterConfig)."""
    backend = getattr(cfg.backend, "value", cfg.backend)
    if backend == "local":
        return local_cluster()
    if backend == "hosts":
        src = cfg.source or "dtrain.toml"
        return hosts_cluster(cfg.name, cfg.spec, src, Path(src).resolve().parent)
    if backend == "gcp":
        src = cfg.source or "dtrain.toml"
        return gcp_cluster(cfg.name, cfg.spec, src)
    raise UserError(f"cluster {cfg.name!r}: unknown backend {backend!r}")


def _built_image(name: str) -> str:
    """The image `dtrain build --cluster NAME` last pushed for this cluster, or ""."""
    from dtrain.cli.record import cluster_dir

    try:
        return (cluster_dir(name) / "image").read_text().strip()
    except FileNotFoundError:
        return ""


# A record's node may also set these (an image whose Python is elsewhere, a second NIC for NCCL).
RECORD_NODE_OVERRIDES = ("python", "workdir", "interface")


def gcp_cluster(name: str, spec: Mapping[str, Any], src: str) -> Cluster:
    """The `gcp` backend: the nodes `dtrain up` recorded from Terraform's `cluster` output."""
    from dtrain.cli.gcp_config import gcp_spec
    from dtrain.cli.record import cluster_dir, key_path, read_record

    where = f"{src} [clusters.{name}]"
    gs = gcp_spec(name, spec, where)
    rec = read_record(name)
    if rec is None:
        raise UserError(f"cluster {name!r} is not up (no record of it on this machine): run dtrain up --cluster {name}")
    key = key_path(name)
    if not key.is_file():
        raise UserError(f"cluster {name!r}: its SSH key {key} is missing: run dtrain up --cluster {name} again")
    nodes = tuple(
        Node(
            name=n["name"],
            address=n["internal_ip"],
            ssh_host=n["external_ip"] or n["internal_ip"],
            user=rec["ssh_user"],
            key=str(key),
            gpus=n["gpus"],
            master=n["role"] == "master",
            **{k: n[k] for k in RECORD_NODE_OVERRIDES if n.get(k)},
        )
        for n in sorted(rec["nodes"], key=lambda n: n["role"] != "master")
    )
    image = check_image(gs.image, where) if gs.image else _built_image(name)
    return Cluster(
        name=name,
        backend="gcp",
        image=image,
        nodes=nodes,
        rdzv_port=gs.rdzv_port,
        rdzv_timeout=gs.rdzv_timeout,
        known_hosts=cluster_dir(name) / "known_hosts",
        env=dict(gs.env),
        default_output=f"{rec['bucket'].rstrip('/')}/runs",
        # infra/'s images have Docker but no torch: jobs run from an image, unless the record names
        # a Python for the nodes (nodes prepared by hand, or the tests' stand-in).
        needs_image=not any(n.get("python") for n in rec["nodes"]),
    )
