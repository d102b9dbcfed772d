"""The `local` backend: this machine as a one-node cluster, reached without SSH. It is what a command
runs on when no cluster is named (the newcomer's first `dtrain train mnist`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dtrain.control.backends import where
from dtrain.control.cluster import Cluster, Node, check_keys

if TYPE_CHECKING:
    from dtrain.control.settings import ClusterConfig


class Local:
    name = "local"
    keys: frozenset[str] = frozenset()
    provisions = False

    def check(self, cfg: ClusterConfig) -> None:
        check_keys(cfg.spec, set(self.keys), where(cfg))

    def cluster(self, cfg: ClusterConfig) -> Cluster:
        return local_cluster()


def local_cluster() -> Cluster:
    """This machine as a one-node cluster."""
    return Cluster(
        name="local",
        backend="local",
        nodes=(Node(name="local", address="127.0.0.1", master=True),),
        launcher="local",
    )


BACKEND = Local()
