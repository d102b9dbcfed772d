"""Declared features (dtrain.control.launchers.Feature): what each launcher can do, and one `require` that refuses
a command needing what its cluster lacks, in one line naming the cluster and the feature, before any node is
touched."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
from runs import cli, isolated_env

from dtrain.common.errors import ExitCode, UserError
from dtrain.control import launchers, nodes, nodestate
from dtrain.control.backends.hosts import hosts_cluster
from dtrain.control.backends.local import local_cluster
from dtrain.control.launchers import Feature

F = Feature
NODES = [{"name": "n0", "address": "10.255.0.1"}, {"name": "n1", "address": "10.255.0.2"}]
QUEUE_HINT = ('jobs queue on Slurm clusters (backend = "slurm", a hosts cluster with slurm = true, or gcp); on this '
              "one use `dtrain train`")  # fmt: skip


def hosts(tmp_path: Path, **spec: object):
    return hosts_cluster("lab", {"nodes": NODES, **spec}, "dtrain.toml", tmp_path)


def test_each_launcher_declares_its_features(tmp_path: Path) -> None:
    here, ssh = local_cluster(), hosts(tmp_path)
    assert launchers.get("local").features(here) == {F.LOCAL, F.GPU_QUERY, F.EVAL}
    assert launchers.get("ssh").features(ssh) == {F.SSH, F.NODE_CHECKS, F.GPU_QUERY, F.EVAL, F.CONTAINERS}
    slurm = hosts(tmp_path, slurm=True)  # dtrain's own Slurm on the hosts: every node is checked
    assert slurm.launcher == "slurm" and launchers.has(slurm, F.QUEUE) and launchers.has(slurm, F.TIME_LIMIT)
    assert launchers.has(slurm, F.NODE_CHECKS) and not launchers.has(slurm, F.LOCAL)
    import dataclasses

    theirs = dataclasses.replace(slurm, slurm=dataclasses.replace(slurm.slurm, managed=False))
    assert not launchers.has(theirs, F.NODE_CHECKS) and launchers.has(theirs, F.QUEUE)  # a user's: its login


def test_require_names_the_cluster_and_the_feature(tmp_path: Path) -> None:
    launchers.require(local_cluster(), F.EVAL)  # declared: nothing happens
    with pytest.raises(UserError) as e:
        launchers.require(hosts(tmp_path), F.QUEUE)
    assert str(e.value) == f"cluster 'lab' lacks a job queue: {QUEUE_HINT}"
    with pytest.raises(UserError) as e:
        launchers.require(local_cluster(), F.TIME_LIMIT, "--time")
    assert str(e.value) == (
        "--time needs a job time limit, and this machine has none: leave it out, or run on a Slurm cluster "
        "(--cluster NAME)"
    )
    with pytest.raises(UserError, match=r"^--queue needs a job queue, and cluster 'lab' has none: leave it out$"):
        launchers.require(hosts(tmp_path), F.QUEUE, "--queue", "leave it out")


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """A cluster whose launcher declares nothing (a new launcher, Kubernetes say, before it grows features)."""
    import dataclasses

    mod = types.ModuleType("dtrain_test_bare_launcher")

    class Bare:
        name, place = "bare", "cluster {name!r}"

        def features(self, cluster: object) -> frozenset[Feature]:
            return frozenset()

    mod.LAUNCHER = Bare()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(launchers.REGISTRY, "bare", mod.__name__)
    return dataclasses.replace(hosts(tmp_path), name="k", launcher="bare")


def test_a_launcher_without_features_is_refused_never_run_here(bare, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before features were declared, `over_ssh = False` meant "this machine": a new launcher's gpus and node
    states ran nvidia-smi on the laptop. Now each is refused in one line; nothing starts a process."""
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("ran a process here"))
    cases = [
        (lambda: nodes.gpus(bare), "dtrain gpus needs a query of its nodes' GPUs, and cluster 'k' has none"),
        (lambda: nodestate.node_states(bare), "reading the nodes' states needs a query of its nodes' GPUs"),
        (lambda: nodes.ssh_to(bare, False, "dtrain doctor"), "dtrain doctor needs nodes reached over SSH"),
        (lambda: launchers.job_cluster(bare, image="reg.example/p/i:1"), "--image needs containers"),
        (lambda: launchers.job_cluster(bare, time="10"), "--time needs a job time limit"),
    ]
    from dtrain.control.slurm.session import Session

    cases.append((lambda: Session(bare), "cluster 'k' lacks a job queue"))
    for call, start in cases:
        with pytest.raises(UserError) as e:
            call()
        assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)


TOML = '[clusters.lab]\nbackend = "hosts"\nnodes = [{name = "n0", address = "10.255.0.1"}]\n'


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (("submit", "train.py"), f"error: this machine lacks a job queue: {QUEUE_HINT}"),
        (("submit", "train.py", "--cluster", "lab"), f"error: cluster 'lab' lacks a job queue: {QUEUE_HINT}"),
        (("jobs", "--cluster", "lab"), f"error: cluster 'lab' lacks a job queue: {QUEUE_HINT}"),
        (("cancel", "7", "--cluster", "lab"), f"error: cluster 'lab' lacks a job queue: {QUEUE_HINT}"),
        (("train", "train.py", "--cluster", "lab", "--time", "10"),
         "error: --time needs a job time limit, and cluster 'lab' has none: leave it out, or run on a Slurm cluster "
         "(--cluster NAME)"),
        (("train", "mnist", "--image", "reg.example/p/i:1"),
         "error: --image needs containers, and this machine has none: add --cluster NAME (a hosts, gcp or Slurm "
         "cluster); on this machine use `docker compose --profile cpu up` or docker run (see compose.yaml)"),
        (("doctor",), "error: dtrain doctor needs nodes reached over SSH, and this machine has none: pass --cluster "
                      "NAME (a [clusters.NAME] in dtrain.toml)"),
        (("exec", "all", "--", "true"),
         "error: dtrain exec needs nodes reached over SSH, and this machine has none: pass --cluster NAME (a "
         "[clusters.NAME] in dtrain.toml)"),
    ],
)  # fmt: skip
def test_each_command_refuses_in_one_line(tmp_path: Path, args: tuple[str, ...], line: str) -> None:
    (tmp_path / "dtrain.toml").write_text(TOML)
    (tmp_path / "train.py").write_text("print('never run')\n")
    r = cli(tmp_path, *args, env=isolated_env(tmp_path))
    assert r.error_line() == line
    assert r.code == ExitCode.USAGE and not (tmp_path / "runs").exists()
