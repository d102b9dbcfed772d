"""A user's own program in the training image on the real Slurm bed (tests/slurm/conftest.py), as on the clusters
`dtrain up` makes (Docker on every node, no torch): every host runs its own dockerd, started over SSH so it lives
in the host's network and mount namespaces (its /var/lib/slurm, where the jobs' directories are, is the host's
own), with the CPU training image of this checkout loaded into it. Cluster `bed` names the image and each node's
docker command.

Checked: a command once per node in the image, with the project's requirements installed by the image's Python
(once per node) and the node variables; a torchrun DDP script with its own checkpoint file, requeued by Slurm
mid-run (`scontrol requeue`: SIGTERM to the job, which reaches the agent inside each container), resumed from its
own checkpoint (put back by the agent inside) to the weights of an uninterrupted run; no container left on any
host.

Needs root (network namespaces, dockerd), docker.io, Debian's slurm-wlm and munge.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from projects import make_ddp_project, write_wheel
from runs import CLI

from .conftest import REPO, Env

sys.path.insert(0, str(REPO / "tests" / "docker"))
import imagetest as d  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.slow]

FAST = {"DTRAIN_INTERNAL_MIRROR_INTERVAL_S": "0.5", "DTRAIN_INTERNAL_STOP_GRACE_S": "5"}
DDP_ARGS = ["--steps", "40", "--ckpt-every", "5", "--sleep", "0.3"]


def sock(host) -> str:
    return f"unix:///run/dtd-{host.namespace}.sock"


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """This checkout's CPU training image (built by `dtrain build`, a cache hit when unchanged), saved to a tar."""
    daemon = d.Daemon()
    if reason := daemon.start():
        pytest.skip(reason)
    try:
        if reason := d.base_image() or d.stage_wheel():
            pytest.skip(reason)
        tag, _ = d.build_train_image()
        tar = tmp_path_factory.mktemp("image") / "train.tar"
        d.docker("save", "-o", str(tar), tag, timeout=600)
        yield tag, tar
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def docked(bed: Env, image: tuple[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A dockerd on h0 and h1 (in each host's namespaces) holding the image, and a project whose dtrain.toml is
    the bed's with the image and each node's docker command in cluster `bed`."""
    tag, tar = image
    hosts = [bed.sb.host("h0"), bed.sb.host("h1")]
    for h in hosts:
        # An SSH session's /sys is its network namespace's: cgroup2 is mounted in the host's own mount namespace.
        bed.sb.ssh(h, "mountpoint -q /sys/fs/cgroup || mount -t cgroup2 none /sys/fs/cgroup")
        bed.sb.ssh(h, f"setsid {d.DOCKERD} --data-root {h.dir}/docker --exec-root /run/dtd-{h.namespace} "
                      f"-H {sock(h)} --pidfile /run/dtd-{h.namespace}.pid --bridge=none --iptables=false "
                      f"--ip-masq=false --ip-forward=false > {h.dir}/dockerd.log 2>&1 < /dev/null &")  # fmt: skip
    try:
        for h in hosts:
            deadline = time.monotonic() + d.START_TIMEOUT_S
            while not d.daemon_up(sock(h)):
                assert time.monotonic() < deadline, (h.dir / "dockerd.log").read_text()[-3000:]
                time.sleep(0.3)
            d.docker("-H", sock(h), "load", "-i", str(tar), timeout=600)
        project = make_ddp_project(tmp_path_factory.mktemp("slurm-image-project") / "proj")
        write_wheel(project / "wheels", "dtrain_image_dep", "0.1", "VALUE = 9\n")
        (project / "requirements.txt").write_text("--no-index\n--find-links wheels\ndtrain-image-dep==0.1\n")
        lines = []
        for line in (bed.cwd / "dtrain.toml").read_text().splitlines():
            lines.append(line)
            if line == "[clusters.bed]":
                lines.append(f"image = {json.dumps(tag)}")
            if line.startswith("name = ") and json.loads(line.split("=", 1)[1]) in ("h0", "h1"):
                h = bed.sb.host(json.loads(line.split("=", 1)[1]))
                lines.append(f"docker = {json.dumps(f'{d.DOCKER} -H {sock(h)}')}")
        (project / "dtrain.toml").write_text("\n".join(lines) + "\n")
        yield {"project": project, "hosts": hosts, "image": tag}
    finally:
        for h in hosts:
            bed.sb.ssh(h, f"kill $(cat /run/dtd-{h.namespace}.pid) 2>/dev/null; true", check=False)
        for h in hosts:
            deadline = time.monotonic() + 30
            while d.daemon_up(sock(h)) and time.monotonic() < deadline:
                time.sleep(0.5)


def dtrain(bed: Env, docked: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=docked["project"], env={**bed.env(), **FAST}, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def containers(docked: dict) -> dict[str, list[str]]:
    return {h.name: d.docker("-H", sock(h), "ps", "-a", "--format", "{{.Names}}").stdout.split()
            for h in docked["hosts"]}  # fmt: skip


def no_containers_within(docked: dict, seconds: float) -> dict[str, list[str]]:
    deadline = time.monotonic() + seconds
    left = containers(docked)
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.5)
        left = containers(docked)
    return left


def test_a_command_runs_in_the_image_on_every_slurm_node_with_its_requirements(bed: Env, docked: dict) -> None:
    check = ("import os, torch, dtrain_image_dep; print('IN', os.path.exists('/.dockerenv'), "
             "dtrain_image_dep.VALUE, os.environ['NODE_RANK'], os.environ['NNODES'])")  # fmt: skip
    r = dtrain(bed, docked, "train", "--cluster", "bed", "--nodes", "2", "--output", str(bed.runs), "--",
               "python", "-c", check)  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr
    assert sorted(re.findall(r"IN True 9 (\d) 2", r.stdout)) == ["0", "1"], r.stdout[-4000:]
    # The nodes' disks are their own: each made the environment with the image's Python.
    assert len(set(re.findall(r"\[(h\d)\] dtrain: requirements installed on \1", r.stdout))) == 2, r.stdout
    # The batch step recorded the run (in the shared runs folder) from a container of the image.
    (rid,) = re.findall(r"starting \S+ run (\S+) on cluster bed", r.stdout)
    status = json.loads((bed.runs / rid / "status.json").read_text())
    assert status["state"] == "completed" and status["exit_code"] == 0, status
    assert no_containers_within(docked, 10) == {"h0": [], "h1": []}


def test_a_ddp_script_in_the_image_requeued_mid_run_resumes_from_its_own_checkpoint(bed: Env, docked: dict) -> None:
    common = ["--cluster", "bed", "--nodes", "2", "--nproc", "1", "--output", str(bed.runs),
              "--checkpoint-dir", "checkpoints"]  # fmt: skip
    whole = dtrain(bed, docked, "train", "train.py", *common, "--", *DDP_ARGS)
    assert whole.returncode == 0, whole.stdout[-4000:] + whole.stderr
    (expected,) = re.findall(r"final weights (\[.*\])", whole.stdout)

    r = dtrain(bed, docked, "submit", "train.py", *common, "--name", "ddp-image", "--", *DDP_ARGS)
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stdout + r.stderr
    job = r.stdout.strip()
    row = bed.wait(job, lambda j: j["state"] == "RUNNING", what="RUNNING")
    run = Path(row["url"])
    node_logs = [bed.sb.private(h, f"/var/lib/slurm/dtrain/runs/{run.name}/logs/{h.name}.log") for h in docked["hosts"]]
    deadline = time.monotonic() + 300
    while not any(" step 15 " in p.read_text() for p in node_logs if p.exists()):
        assert time.monotonic() < deadline, "the job never reached step 15"
        time.sleep(0.2)
    bed.sb.ssh(bed.sb.host("h0"), f"scontrol requeue {job}")
    row = bed.wait(job, lambda j: j["state"] == "COMPLETED", what="COMPLETED after the requeue")
    assert row["restarts"] == 1, row
    out = dtrain(bed, docked, "logs", job, "--cluster", "bed", timeout=120).stdout
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", out)]
    assert len(resumed) == 2 and len(set(resumed)) == 1 and resumed[0] >= 10, out[-4000:]
    print(f"resumed at step {resumed[0]} after the requeue")
    assert "checkpoint directory restored from the run" in out
    (got,) = re.findall(r"final weights (\[.*\])", out)
    assert got == expected
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "completed" and status["starts"] == 2 and status["exit_code"] == 0, status
    assert no_containers_within(docked, 10) == {"h0": [], "h1": []}
