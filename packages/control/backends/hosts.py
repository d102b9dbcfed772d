"""The `hosts` backend: machines the user already has, listed in an inventory (inline in dtrain.toml or in a
file of its own). dtrain reaches them over SSH; nothing is created or destroyed.

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

or `inventory = "hosts.toml"`, a file holding the same keys. With `slurm = true`, dtrain sets up Slurm on
these nodes (`dtrain slurm setup`) and jobs go through it (dtrain.control.slurm); every node then needs
the same workdir and python.
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
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

from dtrain.common.errors import UserError
from dtrain.control.backends import base_dir, where
from dtrain.control.cluster import (
    DEFAULT_RDZV_PORT,
    DEFAULT_RDZV_TIMEOUT_S,
    Cluster,
    Node,
    check_image,
    check_keys,
    default_known_hosts,
    env_table,
    typed,
)

if TYPE_CHECKING:
    from dtrain.control.settings import ClusterConfig

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)

# Keys of a node; each but name/address/master may also be set once for all nodes.
NODE_KEYS = {f.name: f for f in dataclasses.fields(Node)}
NODE_TYPES = typing.get_type_hints(Node)
NODE_DEFAULT_KEYS = set(NODE_KEYS) - {"name", "address", "master", "ssh_host"}
CLUSTER_KEYS = {
    "rdzv_port",
    "rdzv_timeout",
    "known_hosts",
    "env",
    "shared_fs",
    "nodes",
    "image",
    "slurm",
    "stall_after",
}
HOSTS_KEYS = NODE_DEFAULT_KEYS | CLUSTER_KEYS | {"inventory"}


def hosts_cluster(name: str, spec: Mapping[str, Any], src: str, base_dir: Path) -> Cluster:
    """The `hosts` backend: the node list from [clusters.NAME] (`spec`, from file `src`) or from
    the inventory file it names (relative paths are relative to `base_dir`)."""
    where = f"{src} [clusters.{name}]"
    check_keys(spec, HOSTS_KEYS | {"backend"}, where)
    spec = {k: v for k, v in spec.items() if k != "backend"}
    if "inventory" in spec:
        inv = Path(os.path.expanduser(typed(spec["inventory"], str, "inventory", where)))
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

    rdzv_port = typed(spec.get("rdzv_port", DEFAULT_RDZV_PORT), int, "rdzv_port", where)
    if not 1 <= rdzv_port <= 65535:
        raise UserError(f"{where}: rdzv_port must be a TCP port (1-65535), got {rdzv_port}")
    rdzv_timeout = typed(spec.get("rdzv_timeout", DEFAULT_RDZV_TIMEOUT_S), int, "rdzv_timeout", where)
    if rdzv_timeout < 5:
        raise UserError(f"{where}: rdzv_timeout must be at least 5 seconds, got {rdzv_timeout}")
    known = spec.get("known_hosts")
    known_path = default_known_hosts()
    if known is not None:
        known_path = Path(os.path.expanduser(typed(known, str, "known_hosts", where)))
        known_path = known_path if known_path.is_absolute() else base_dir / known_path
    env = env_table(spec.get("env", {}), where)
    shared_fs = typed(spec.get("shared_fs", False), bool, "shared_fs", where)
    image = check_image(typed(spec.get("image", ""), str, "image", where), where) if spec.get("image") else ""
    slurm = None
    if typed(spec.get("slurm", False), bool, "slurm", where):
        from dtrain.control.slurm.spec import SlurmSpec

        # Slurm starts a job's script in one directory, with one command line, on whichever nodes it picks.
        for key in ("workdir", "python"):
            other = next((n for n in ordered if getattr(n, key) != getattr(master, key)), None)
            if other is not None:
                raise UserError(
                    f"{where}: with slurm = true every node needs the same {key}: node {other.name} has "
                    f"{getattr(other, key)!r}, the master {master.name} {getattr(master, key)!r}"
                )
        slurm = SlurmSpec(login=ordered[0], managed=True, **stall_option(spec, where))
    return Cluster(
        name=name,
        backend=backend,
        nodes=ordered,
        rdzv_port=rdzv_port,
        rdzv_timeout=rdzv_timeout,
        known_hosts=known_path,
        env=env,
        shared_fs=shared_fs,
        image=image,
        launcher="slurm" if slurm else "ssh",
        slurm=slurm,
    )


def stall_option(spec: Mapping[str, Any], where: str) -> dict[str, float]:
    """The table's stall_after (a duration), as SlurmSpec's keyword; {} when it is not set."""
    from dtrain.control.cluster import duration

    return {"stall_after": duration(spec["stall_after"], "stall_after", where)} if "stall_after" in spec else {}


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
            values[key] = typed(raw[key], NODE_TYPES[key], key, f"{where}: {label}")
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


class Hosts:
    name = "hosts"
    keys = frozenset(HOSTS_KEYS)
    provisions = False

    def check(self, cfg: ClusterConfig) -> None:
        check_keys(cfg.spec, HOSTS_KEYS, where(cfg))

    def cluster(self, cfg: ClusterConfig) -> Cluster:
        return hosts_cluster(cfg.name, cfg.spec, cfg.source or "dtrain.toml", base_dir(cfg))


BACKEND = Hosts()
