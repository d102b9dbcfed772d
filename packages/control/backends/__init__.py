"""Cluster backends: how a `[clusters.NAME]` table becomes a list of nodes and, for backends that
make machines, how they are brought up and torn down.

A backend is one module in this package that defines `BACKEND`, an object with:

    name        the value of `backend = "..."` in dtrain.toml
    keys        the table keys it accepts (besides `backend`)
    check(cfg)          -> None      a bad table is one UserError line naming the key (settings calls it
                                     for every table when dtrain.toml is read): the one place a table is
                                     validated, so what `config show` prints, up/status/preflight accept
    cluster(cfg)        -> Cluster   the node list, master first (what launch, doctor, gpus, exec use)

and, where it provisions machines (`provisions = True`):

    preflight(cfg, *, events)                      -> gcp.lifecycle.PreflightReport
    up(cfg, *, events, handle, confirm, ...)       -> gcp.lifecycle.UpResult
    down(cfg, *, events, handle, confirm, ...)     -> gcp.lifecycle.DownResult
    status(cfg)                                    -> gcp.lifecycle.StatusResult
    ensure_running(cfg, *, events, handle)         -> bool: a stopped cluster (autostop) started, and its
                                                      record's addresses refreshed; whether it started any

The `...` are the commands' own flags as keyword arguments (next_zone, keep, ...; no options object).

Adding a backend is one module and one line in REGISTRY; nothing outside this package branches on
a backend's name. Modules are imported when first used, so a backend's cloud SDK costs nothing to a
command that does not touch it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dtrain.common.errors import UserError

if TYPE_CHECKING:
    from dtrain.control.cluster import Cluster
    from dtrain.control.settings import ClusterConfig

REGISTRY: dict[str, str] = {
    "local": "dtrain.control.backends.local",
    "hosts": "dtrain.control.backends.hosts",
    "gcp": "dtrain.control.backends.gcp",
    "slurm": "dtrain.control.backends.slurm",
    "kubernetes": "dtrain.control.backends.kubernetes",
}


class Backend(Protocol):
    name: str
    keys: frozenset[str]
    provisions: bool

    def check(self, cfg: ClusterConfig) -> None: ...

    def cluster(self, cfg: ClusterConfig) -> Cluster: ...


def names() -> list[str]:
    return list(REGISTRY)


def get(name: str) -> Backend:
    """The backend registered as `name`; a clear error naming the known ones otherwise."""
    module = REGISTRY.get(name)
    if module is None:
        known = " | ".join(f'"{n}"' for n in REGISTRY)
        raise UserError(f"unknown cluster backend {name!r}: use backend = {known}")
    return importlib.import_module(module).BACKEND


def resolve(cfg: ClusterConfig) -> Cluster:
    """The node list of a cluster table, from its backend."""
    return get(cfg.backend).cluster(cfg)


def provisioning(cfg: ClusterConfig, verb: str) -> Any:
    """The backend of `cfg` if it makes machines (up/down/status/preflight), else a one-line error."""
    backend = get(cfg.backend)
    if not backend.provisions:
        makers = ", ".join(n for n in REGISTRY if get(n).provisions)
        which = f"cluster {cfg.name!r} uses the {cfg.backend} backend" if cfg.name else "no cluster was named"
        raise UserError(
            f"{which}: {verb} works on clusters dtrain makes ({makers}); pass --cluster NAME of such a "
            "[clusters.NAME] in dtrain.toml"
        )
    return backend


def start_if_stopped(cfg: ClusterConfig, *, events: Any, handle: Any) -> bool:
    """Start the cluster of `cfg` if its backend made it and it is stopped (autostop, or stopped by hand); whether
    anything was started (its nodes' addresses may have changed). The one place every command that runs work
    on a cluster (dtrain.control.launch.resolve) starts it."""
    backend = get(cfg.backend)
    return bool(backend.provisions and backend.ensure_running(cfg, events=events, handle=handle))


def base_dir(cfg: ClusterConfig) -> Path:
    """Where relative paths in a cluster's table are relative to: its config file's directory."""
    return Path(cfg.source).resolve().parent if cfg.source else Path.cwd()


def where(cfg: ClusterConfig) -> str:
    """How errors name a table: `dtrain.toml [clusters.lab]`."""
    return f"{cfg.source or 'dtrain.toml'} [clusters.{cfg.name}]"
