"""`dtrain eval --cluster`: one process on the cluster's master through its node agent, over real SSH
(the test bed of network namespaces, scripts/testbed.py), on a run every node can reach (a shared
filesystem: the namespaces share this machine's). Needs root, as tests/cluster does.

Also, without a test bed: a run only this machine holds is refused for a cluster, in one line."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cluster.bed import Testbed
from runs import isolated_env

from .conftest import cli, result


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Testbed, Path]]:
    """One host (h0, the master) and a working directory whose dtrain.toml names it cluster `bed`."""
    if reason := Testbed.available():
        pytest.fail(reason)  # CI runs as root with sshd installed: a missing test bed is a broken CI
    testbed = Testbed.create(1, tmp_path_factory.mktemp("bed"))
    try:
        cwd = tmp_path_factory.mktemp("cwd")
        known = testbed.write_known_hosts(testbed.root / "known_hosts")
        toml = testbed.cluster_toml("bed", sys.executable, known_hosts=known)
        (cwd / "dtrain.toml").write_text(toml.replace('backend = "hosts"\n', 'backend = "hosts"\nshared_fs = true\n'))
        yield testbed, cwd
    finally:
        testbed.destroy()


def env(cwd: Path) -> dict[str, str]:
    return isolated_env(cwd, XDG_CONFIG_HOME=str(cwd / "config"), XDG_CACHE_HOME=str(cwd / "xdg-cache"))


@pytest.mark.root
def test_eval_on_the_clusters_master(bed: tuple[Testbed, Path], mnist_run: Path):
    testbed, cwd = bed
    run = cwd / "shared" / mnist_run.name
    # Without the records of evaluations other tests ran on this session's run: this one's stands alone.
    shutil.copytree(mnist_run, run, ignore=shutil.ignore_patterns("eval"))
    r = cli(cwd, "eval", str(run), "--cluster", "bed", env=env(cwd))
    assert r.code == 0, r.out + r.err
    # Its output came from node h0, through the node agent.
    assert "[h0] evaluating on 1000 images of fashion-mnist test[:1000]" in r.out, r.out
    (record_file,) = (run / "eval").glob("eval-*.json")
    record = json.loads(record_file.read_text())
    assert record["state"] == "completed" and record["where"] == "bed"
    assert record["metrics"]["accuracy"] == result(mnist_run)["accuracy"]
    # The code went where a training job's goes: <workdir>/runs/<eval id>/code on the node.
    synced = testbed.hosts[0].workdir / "runs" / record["id"] / "code" / "dtrain" / "evaluate" / "__main__.py"
    assert synced.is_file()


def test_a_run_on_this_machine_is_refused_for_a_cluster(mnist_run: Path, tmp_path: Path):
    node = 'name = "n0"\naddress = "10.255.0.1"\nmaster = true\n'
    (tmp_path / "dtrain.toml").write_text(f'[clusters.far]\nbackend = "hosts"\n\n[[clusters.far.nodes]]\n{node}')
    r = cli(tmp_path, "eval", str(mnist_run), "--cluster", "far")
    assert r.code == 2, r.out + r.err
    assert r.error_line() == (
        f"error: run {mnist_run} is on this machine, out of reach of cluster 'far': evaluate it here (leave out "
        "--cluster), or keep runs in a gs:// bucket (or set shared_fs = true in [clusters.far])"
    )
    assert not (mnist_run / "eval").exists() or not any(
        json.loads(p.read_text()).get("where") == "far" for p in (mnist_run / "eval").glob("*.json")
    )
