"""Container mode without Docker: the `docker run` line the node agent builds (secrets by name only, mounts,
GPUs, the user), the job spec the launcher sends, the inventory's `image` and `docker` keys, and --image's
errors. The real runs are in test_container_mode.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runs import cli, isolated_env

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.nodeagent import INNER_SPEC_ENV, container_argv, job_container_name
from dtrain.control.backends.hosts import hosts_cluster
from dtrain.control.cluster import Cluster, Node
from dtrain.control.remote import NodeWork, node_paths, node_spec


def cluster(image: str = "reg.example/p/dtrain-train:src-0123456789ab") -> Cluster:
    nodes = (
        Node(name="n0", address="10.0.0.10", master=True, interface="eth1", docker="sudo docker"),
        Node(name="n1", address="10.0.0.11", gpus=2),
    )
    return Cluster(name="lab", backend="hosts", nodes=nodes, env={"NCCL_DEBUG": "WARN"}, image=image)


def spec(node: int, *, gpus: int = 0, paths: dict[str, str] | None = None, **kw) -> dict:
    c = cluster(**kw)
    work = NodeWork(tail=["-m", "dtrain.mnist.train", "--epochs", "1"], mounts=tuple(sorted((paths or {}).items())))
    return node_spec(c, c.nodes[node], work, run_id="mnist-20260101-000000-abcd", nproc=2, threads=4, gpus=gpus)


def test_node_spec_in_container_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Doctor's all-reduce (a module under torchrun, no checkpoint files) in an image: the same container as a
    program's (nodeagent.program_container), its torchrun in the agent inside."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    s = spec(0, paths={"/data/fmnist": "ro"})
    c = s["container"]
    assert s["argv"] is None and s["env"]["HF_TOKEN"] == "hf_secret_value"
    assert c["image"] == "reg.example/p/dtrain-train:src-0123456789ab"
    assert c["name"] == "dtrain-mnist-20260101-000000-abcd-n0" and c["docker"] == ["sudo", "docker"]
    # An agent inside the container runs torchrun (dtrain.common.launch) and watches its ranks for hangs; its
    # spec comes by name, like the job's environment, and holds no value of that environment.
    assert c["args"] == ["-m", "dtrain.common.nodeagent", "run", "--spec-env", INNER_SPEC_ENV]
    inner = json.loads(s["env"][INNER_SPEC_ENV])
    torchrun = inner["argv"][3:]
    assert inner["argv"][:3] == ["python3", "-m", "dtrain.common.launch"] and inner["env"] == {}
    assert inner["hang"] == {"timeout_s": None} and "hf_secret_value" not in s["env"][INNER_SPEC_ENV]
    assert "files" not in inner and inner["signal_group"] is False
    assert torchrun[:2] == ["--nnodes", "2"] and torchrun[-4:] == ["-m", "dtrain.mnist.train", "--epochs", "1"]
    assert "--local-addr" in torchrun and "10.0.0.10" in torchrun and "is_host=1,join_timeout=120" in torchrun
    assert c["cwd"] == "runs/mnist-20260101-000000-abcd"
    assert ["runs/mnist-20260101-000000-abcd", "", "rw"] in c["mounts"]
    assert ["/data/fmnist", "", "ro"] in c["mounts"] and ["hf-cache", "/hf-cache", "rw"] in c["mounts"]
    assert c["gpus"] is False and spec(1, gpus=2)["container"]["gpus"] is True
    # Synced mode: the node's python runs the same torchrun from the synced code.
    synced = spec(0, image="")
    assert "container" not in synced and synced["argv"][:3] == ["python3", "-m", "dtrain.common.launch"]
    assert synced["argv"][3:] == torchrun and synced["env"]["GLOO_SOCKET_IFNAME"] == "eth1"
    assert synced["env"]["NCCL_DEBUG"] == "WARN" and synced["env"]["OMP_NUM_THREADS"] == "4"


def test_a_command_is_its_argv_and_its_group_is_signalled() -> None:
    """`dtrain eval`'s one process on the master: no torchrun, its process group stopped as one."""
    c = cluster(image="")
    s = node_spec(c, c.nodes[0], NodeWork(tail=["py", "-m", "x", "--a"], torchrun=False), run_id="r", nproc=1,
                  threads=2)  # fmt: skip
    assert s["argv"] == ["py", "-m", "x", "--a"] and s["signal_group"] is True and s["cwd"] == "."


def test_docker_run_line_carries_secrets_by_name_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    s = spec(1, gpus=2, paths={"/srv/data": "ro"})
    argv = container_argv(s["container"], sorted(s["env"]), tmp_path, 1001, 1002)
    line = " ".join(argv)
    assert "hf_secret_value" not in line
    assert argv[:9] == ["docker", "run", "--rm", "--name", "dtrain-mnist-20260101-000000-abcd-n1", "--init",
                        "--network", "host", "--ipc"]  # fmt: skip
    assert "--gpus all" in line and "--user 1001:1002" in line
    assert "-e HF_TOKEN" in line and "-e NCCL_DEBUG" in line and "-e OMP_NUM_THREADS" in line
    assert f"-v {tmp_path}/runs/mnist-20260101-000000-abcd:{tmp_path}/runs/mnist-20260101-000000-abcd:rw" in line
    assert f"-v {tmp_path}/cache:/cache:rw" in line and "-v /srv/data:/srv/data:ro" in line
    assert argv[argv.index("reg.example/p/dtrain-train:src-0123456789ab") + 1 :] == s["container"]["args"]
    # As root on the node too, the job runs as the node's user; a container spec without "user": "host" runs
    # as the image's own (non-root) user there (no --user).
    assert "--user 0:0" in " ".join(container_argv(s["container"], [], tmp_path, 0, 0))
    assert "--user" not in container_argv({**s["container"], "user": ""}, [], tmp_path, 0, 0)


def test_named_paths_replace_builtin_mounts() -> None:
    c = spec(0, paths={"/data": "ro"})["container"]
    assert [m for m in c["mounts"] if (m[1] or m[0]) == "/data"] == [["/data", "", "ro"]]
    assert node_paths({"data_dir": "/d", "output": "gs://b/runs", "model": "tiny-llama"}, "gs://b/runs/x") == {
        "/d": "ro"
    }
    assert node_paths({"output": "/nfs/runs"}, "/nfs/runs/x") == {"/nfs/runs": "rw"}
    assert job_container_name("run:1", "n/0") == "dtrain-run-1-n-0"


def test_inventory_image_and_docker_keys(tmp_path: Path) -> None:
    nodes = [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2", "docker": "podman"}]
    spec_ = {"image": "reg.example/p/img:1", "docker": "sudo docker", "nodes": nodes}
    c = hosts_cluster("lab", spec_, "dtrain.toml", tmp_path)
    assert c.image == "reg.example/p/img:1" and [n.docker for n in c.nodes] == ["sudo docker", "podman"]
    with pytest.raises(UserError, match="image 'Not An Image' is not an image reference"):
        hosts_cluster("lab", {**spec_, "image": "Not An Image"}, "dtrain.toml", tmp_path)


def test_image_needs_a_cluster(tmp_path: Path) -> None:
    r = cli(tmp_path, "train", "mnist", "--image", "reg.example/p/img:1", env=isolated_env(tmp_path))
    assert r.code == ExitCode.USAGE
    assert r.error_line() == (
        "error: --image needs containers, and this machine has none: add --cluster NAME (a hosts, gcp or Slurm "
        "cluster); on this machine use `docker compose --profile cpu up` or docker run (see compose.yaml)"
    )


def test_healthcheck_reads_the_process_table() -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "docker" / "healthcheck.py"
    mod_spec = importlib.util.spec_from_file_location("dtrain_healthcheck", path)
    hc = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(hc)
    launcher = "/opt/venv/bin/python3 -m dtrain.common.launch --nnodes=2 -m dtrain.mnist.train"
    worker = "/opt/venv/bin/python3 -u -m dtrain.mnist.train --epochs 1"
    assert hc.check({1: (0, "S", "docker-init --"), 7: (1, "S", launcher), 9: (7, "R", worker)}) == (
        True,
        "torchrun running with 1 worker(s)",
    )
    assert hc.check({1: (0, "S", "docker-init --"), 7: (1, "S", launcher), 9: (7, "Z", worker)})[0] is False
    assert hc.check({1: (0, "S", "docker-init --")}) == (False, "torchrun (dtrain.common.launch) is not running")


def test_a_users_program_in_container_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's agent runs `docker run IMAGE python3 -m dtrain.common.nodeagent run --spec-env ...`; the agent
    inside gets the synced-mode spec (the program, its checkpoint directory and its copy) through one variable,
    and the job's secrets and that spec reach the container by name only. The run directory and the image's
    environments are mounted at their own paths, and the program runs as the node's user."""
    import json

    from dtrain.common.nodeagent import INNER_SPEC_ENV
    from dtrain.common.storage import open_store
    from dtrain.control import launchers
    from dtrain.control.program import Job, Program
    from dtrain.control.remote_program import program_spec
    from dtrain.control.userjob import Target

    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    c = cluster()
    job = Job(name="train", program=Program(kind="script", target="train.py", args=("--lr", "3")),
              workdir=tmp_path, checkpoint_dir="ckpts")  # fmt: skip
    rid = "train-20260101-000000-abcd"
    t = Target(rid, open_store(str(tmp_path / "runs" / rid)), 0, False)
    plan = launchers.Plan(job=job, target=t, cluster=c, nproc=1, grace_s=20.0)
    s = program_spec(plan, t, c, c.nodes[1], rank=1, nproc=1, threads=2, restore=True, gpus=2)
    box = s["container"]
    assert s["argv"] is None and box["gpus"] is True and box["user"] == "host" and box["entrypoint"] == "python3"
    assert box["args"] == ["-m", "dtrain.common.nodeagent", "run", "--spec-env", INNER_SPEC_ENV]
    assert s["grace_s"] == 20.0 + 30.0  # the inner agent's grace, then its last checkpoint copy
    inner = json.loads(s["env"][INNER_SPEC_ENV])
    assert inner["env"] == {} and "container" not in inner  # the values reach the container by name only
    assert inner["argv"][:3] == ["python3", "-m", "dtrain.common.launch"] and inner["argv"][-3:] == [
        "train.py",
        "--lr",
        "3",
    ]
    assert inner["files"]["checkpoint_dir"] == "work/ckpts" and inner["files"]["mirror"]["restore"] is True
    assert s["env"]["HF_TOKEN"] == "hf_secret_value" and s["env"]["DTRAIN_NODE_RANK"] == "1"

    (tmp_path / "runs" / rid).mkdir(parents=True, exist_ok=True)
    argv = container_argv(box, sorted(s["env"]), tmp_path, 0, 0)
    line = " ".join(argv)
    assert "hf_secret_value" not in line and "--lr" not in line  # neither a secret nor the spec on a command line
    assert (
        f"-v {tmp_path}/runs/{rid}:{tmp_path}/runs/{rid}:rw" in line
        and f"-v {tmp_path}/envs:{tmp_path}/envs:ro" in line
    )
    assert f"-w {tmp_path}/runs/{rid}" in line and f"-e {INNER_SPEC_ENV}" in line
    assert "--user 0:0" in line  # as root too: the user's files stay the node user's, not the image's
    assert argv[-7:] == ["--entrypoint", "python3", c.image, *box["args"]][-7:]
