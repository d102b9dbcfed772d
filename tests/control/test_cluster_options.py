"""Cluster.options: what a backend's table says that its launcher needs and the node list does not (a Kubernetes
namespace, a pod's resources). It is the one generic seam between a backend and its launcher, so that a new pair
of them is two modules and their REGISTRY lines, with no field added to Cluster for it."""

from __future__ import annotations

from pathlib import Path

from dtrain.control import launchers
from dtrain.control.backends.hosts import hosts_cluster
from dtrain.control.cluster import Cluster

NODES = [{"name": "n0", "address": "10.255.0.1"}]


def test_a_cluster_has_no_options_unless_its_backend_gives_them(tmp_path: Path) -> None:
    assert hosts_cluster("lab", {"nodes": NODES}, "dtrain.toml", tmp_path).options == {}


def test_options_survive_the_cluster_as_one_job_sees_it(tmp_path: Path) -> None:
    """launchers.job_cluster replaces the image (--image): the launcher still gets the table's options."""
    import dataclasses

    base = hosts_cluster("lab", {"nodes": NODES}, "dtrain.toml", tmp_path)
    cluster = dataclasses.replace(base, options={"namespace": "team-a", "cpus": 4})
    seen = launchers.job_cluster(cluster, image="registry.example/dtrain:1")
    assert isinstance(seen, Cluster) and seen.image == "registry.example/dtrain:1"
    assert seen.options == {"namespace": "team-a", "cpus": 4}
