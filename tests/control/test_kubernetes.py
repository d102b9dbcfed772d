"""The kubernetes backend and launcher (dtrain.control.backends.kubernetes, dtrain.control.launchers.kubernetes),
through the real CLI: `dtrain train` writes a Kubeflow PyTorchJob into the run (a bucket: the GCS emulator) and says
how to apply it, and nothing claims it ran. The manifest is read back with the official Kubeflow Training SDK's
models (kubeflow-training, pinned in the dev extras): its deserialization, as TrainingClient does it, must round-trip
it field for field. No API server can run here: what kubelet and the operator would do to it is done by the test
(the operator's variables, kubelet's $(NAME) expansion), and the agent's torchrun line is checked by torchrun's own
parser."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from runs import cli, isolated_env

from dtrain.common.errors import ExitCode
from dtrain.common.storage import open_store

IMAGE = "registry.example/team/dtrain-train:src-0123456789ab"


def project(tmp_path: Path, bucket: str = "", **keys: Any) -> Path:
    table = {"backend": "kubernetes", "image": IMAGE, "namespace": "ml", **keys}
    if bucket:
        table["bucket"] = bucket

    def toml(v: Any) -> str:
        return (
            "{ " + ", ".join(f"{json.dumps(k)} = {toml(x)}" for k, x in v.items()) + " }"
            if isinstance(v, dict)
            else json.dumps(v)
        )

    lines = ["[clusters.k8s]", *(f"{k} = {toml(v)}" for k, v in table.items())]
    (tmp_path / "dtrain.toml").write_text("\n".join(lines) + "\n")
    return tmp_path


def run_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    import os

    return isolated_env(tmp_path, STORAGE_EMULATOR_HOST=os.environ.get("STORAGE_EMULATOR_HOST", ""), **extra)


def expand(text: str, env: dict[str, str]) -> str:
    """kubelet's expansion of $(NAME) in a container's command, args and env values (k8s.io/kubernetes
    third_party/forked/golang/expansion): `$$` is `$`, a known $(NAME) its value, anything else as it is."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif (m := re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)").match(text, i)) and m.group(1) in env:
            out.append(env[m.group(1)])
            i = m.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def sdk_round_trip(manifest: dict[str, Any]) -> Any:
    """The manifest as the Kubeflow Training SDK reads a PyTorchJob (TrainingClient.get_job: its ApiClient's
    deserialize into KubeflowOrgV1PyTorchJob), and back: a key the models do not know would be dropped."""
    from kubeflow.training.api_client import ApiClient
    from kubeflow.training.models import KubeflowOrgV1PyTorchJob
    from kubeflow.training.utils.utils import FakeResponse

    client = ApiClient()
    job = client.deserialize(FakeResponse(manifest), "KubeflowOrgV1PyTorchJob")
    assert isinstance(job, KubeflowOrgV1PyTorchJob)
    assert client.sanitize_for_serialization(job) == manifest
    return job


def operator_env(job: Any, role: str, index: int) -> dict[str, str]:
    """What training-operator v1.9 sets on a pod of the job (pkg/controller.v1/pytorch/envvar.go, master.go): the
    Master's service name and its pytorchjob-port, the pod's node rank (a Worker's index + 1), nnodes, nproc."""
    specs = job.spec.pytorch_replica_specs
    (port,) = [
        p.container_port for p in specs["Master"].template.spec.containers[0].ports if p.name == "pytorchjob-port"
    ]
    nnodes = sum(s.replicas for s in specs.values())
    rank = index if role == "Master" else index + 1
    master = f"{job.metadata.name}-master-0"
    return {"MASTER_ADDR": master, "PET_MASTER_ADDR": master, "MASTER_PORT": str(port), "PET_MASTER_PORT": str(port),
            "PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": job.spec.nproc_per_node, "PET_NODE_RANK": str(rank),
            "RANK": str(rank), "WORLD_SIZE": str(nnodes * int(job.spec.nproc_per_node)),
            "DTRAIN_POD_NAME": f"{job.metadata.name}-{role.lower()}-{index}"}  # fmt: skip


def pod(job: Any, role: str, index: int) -> tuple[list[str], dict[str, str], dict[str, Any]]:
    """One pod's container as kubelet starts it: its argv, its environment, and the node agent's spec in it."""
    (c,) = job.spec.pytorch_replica_specs[role].template.spec.containers
    env = operator_env(job, role, index)
    plain = {e.name: expand(e.value, env) for e in c.env if e.value is not None}
    argv = [expand(a, {**plain, **env}) for a in [*c.command, *c.args]]
    assert argv[:2] == ["/bin/sh", "-c"] and argv[3] == "dtrain-agent"
    return argv, {**plain, **env}, json.loads(argv[4])


def yaml_of(url: str, rel: str) -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(open_store(url).read_bytes(rel))


def read_manifest(url: str) -> dict[str, Any]:
    return yaml_of(url, "kubernetes/pytorchjob.yaml")


def test_train_writes_a_pytorchjob_the_sdk_reads_and_starts_nothing(tmp_path: Path, gcs_bucket: str) -> None:
    import torch.distributed.run as torchrun

    root = project(tmp_path, gcs_bucket, nodes=3, gpus_per_node=2, cpus=8, memory="32Gi")
    r = cli(root, "train", "mnist", "--cluster", "k8s", "--epochs", "1", env=run_env(tmp_path))
    assert r.code == ExitCode.USAGE, r.err  # not 0: the training did not run
    (url,) = re.findall(r"gcloud storage cat (gs://\S+)/kubernetes/pytorchjob.yaml \| kubectl apply -f -", r.out)
    assert url.startswith(f"{gcs_bucket}/runs/mnist-"), r.out
    assert "not started: dtrain does not apply or watch Kubernetes jobs" in r.out, r.out
    assert "completed" not in r.out + r.err and "failed" not in r.out + r.err
    run_id = url.rsplit("/", 1)[-1]

    manifest = read_manifest(url)
    job = sdk_round_trip(manifest)
    # The check can fail: a key the models do not know is dropped on the way back, a required one is missing.
    with pytest.raises(AssertionError):
        sdk_round_trip({**manifest, "spec": {**manifest["spec"], "nprocsPerNode": "2"}})
    with pytest.raises(ValueError, match="run_policy"):
        sdk_round_trip({**manifest, "spec": {k: v for k, v in manifest["spec"].items() if k != "runPolicy"}})
    assert (job.api_version, job.kind, job.metadata.namespace) == ("kubeflow.org/v1", "PyTorchJob", "ml")
    assert job.metadata.name == run_id and job.metadata.labels["dtrain/cluster"] == "k8s"
    assert job.spec.nproc_per_node == "2"  # one process per GPU
    specs = job.spec.pytorch_replica_specs
    assert {k: s.replicas for k, s in specs.items()} == {"Master": 1, "Worker": 2}
    for role, spec in specs.items():
        assert spec.restart_policy == "Never", role  # --max-restarts 0
        (c,) = spec.template.spec.containers
        assert (c.name, c.image) == ("pytorch", IMAGE)
        # this machine's emulator (a loopback address) would be the pod itself there
        assert "STORAGE_EMULATOR_HOST" not in {e.name for e in c.env}
        assert c.resources.limits == {"nvidia.com/gpu": "2", "cpu": "8", "memory": "32Gi"}
        assert c.resources.requests == {"cpu": "8", "memory": "32Gi"}

    # Each pod as kubelet starts it, with the operator's variables: the environment contract, the node agent, and
    # under it torchrun with the c10d rendezvous on the Master's name and port (the operator's MASTER_ADDR/PORT).
    for role, index, rank in (("Master", 0, 0), ("Worker", 1, 2)):
        argv, env, spec = pod(job, role, index)
        assert argv[2].endswith("exec python3 -m dtrain.common.nodeagent run --spec-env DTRAIN_INTERNAL_AGENT_SPEC")
        contract = {**env, **spec["env"]}
        assert contract["DTRAIN_RUN"] == run_id and contract["DTRAIN_RUN_URL"] == url
        assert contract["DTRAIN_NODE_RANK"] == str(rank) == env["PET_NODE_RANK"]
        assert (contract["DTRAIN_NNODES"], contract["DTRAIN_NPROC_PER_NODE"]) == ("3", "2")
        assert (contract["DTRAIN_MASTER_ADDR"], contract["DTRAIN_MASTER_PORT"]) == (env["MASTER_ADDR"], "29400")
        mirror = spec["files"]["mirror"]  # each pod's copy of its checkpoint directory, in the run's bucket
        assert (mirror["store"], int(mirror["node"]), mirror["restore"]) == (f"{url}/ckpt", rank, False)
        assert bool(spec["files"]["forward"]) == (rank == 0)  # rank 0 forwards the metrics to the run
        head, module = spec["argv"][:3], spec["argv"].index("-m", 3)
        assert head == ["python3", "-m", "dtrain.common.launch"]
        args = torchrun.parse_args(spec["argv"][3:])
        assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("3", "2", "c10d")
        assert args.rdzv_endpoint == f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}" and args.rdzv_id == run_id
        assert args.rdzv_conf.startswith(f"is_host={int(role == 'Master')},")
        assert args.local_addr == env["DTRAIN_POD_NAME"] and spec["ifname_for"] == env["DTRAIN_POD_NAME"]
        assert spec["argv"][module + 1] == "dtrain.mnist.train" and "--epochs" in spec["argv"]
        # people read the pods' output (kubectl logs): no progress or resource lines meant for a launcher
        assert env["DTRAIN_INTERNAL_PROGRESS"] == "0" and spec["resources"] == {"interval_s": 0}

    # The run's record: manifests written, not started; no exit code, no start counted.
    run = open_store(url)
    status = json.loads(run.read_bytes("status.json"))
    assert status["state"] == "not-started" and status["starts"] == 0 and "exit_code" not in status
    assert status["kubernetes"] == {
        "kind": "PyTorchJob",
        "name": run_id,
        "manifest": f"{url}/kubernetes/pytorchjob.yaml",
    }
    (row,) = [json.loads(x) for x in run.read_bytes("events.jsonl").decode().splitlines()]
    assert row["event"] == "manifests" and "does not apply or watch" in row["message"]
    assert sorted(run.list("")) == ["events.jsonl", "kubernetes/pytorchjob.yaml", "status.json"]


def test_a_program_keeps_its_arguments_and_restarts_from_its_copy(tmp_path: Path, gcs_bucket: str) -> None:
    """A user's script with arguments kubelet would otherwise expand ($(HOME)) or YAML would misread (": ", quotes):
    they reach the program as typed. --max-restarts becomes the pods' restart policy and the job's backoff limit,
    and a restarted pod puts the checkpoint directory's copy back. Secrets stay out of the manifest."""
    root = project(tmp_path, gcs_bucket, nproc=3)
    (root / "train.py").write_text("print('hi')\n")
    odd = 'a: "b" $(HOME) $x \\ #c'
    env = run_env(tmp_path, WANDB_API_KEY="secret-key-123", WANDB_PROJECT="proj")
    r = cli(root, "train", "train.py", "--cluster", "k8s", "--max-restarts", "2", "--", "--name", odd, env=env)
    assert r.code == ExitCode.USAGE, r.err
    assert "left out of the manifest (secrets; give the pods a Kubernetes Secret): WANDB_API_KEY" in r.out, r.out
    assert "your working directory is not synced" in r.out, r.out
    (url,) = re.findall(r"gcloud storage cat (gs://\S+)/kubernetes/pytorchjob.yaml", r.out)
    text = open_store(url).read_bytes("kubernetes/pytorchjob.yaml").decode()
    assert "secret-key-123" not in text and "WANDB_PROJECT" in text
    job = sdk_round_trip(read_manifest(url))
    assert list(job.spec.pytorch_replica_specs) == ["Master"] and job.spec.nproc_per_node == "3"
    assert job.spec.run_policy.backoff_limit == 2
    master = job.spec.pytorch_replica_specs["Master"]
    assert master.restart_policy == "OnFailure" and master.template.spec.containers[0].resources is None
    _argv, _env, spec = pod(job, "Master", 0)
    assert spec["argv"][-3:] == ["train.py", "--name", odd]
    assert spec["files"]["mirror"]["restore"] is True and spec["cwd"] == "work"
    config = json.loads(open_store(url).read_bytes("config.json"))  # a program's run: its job, for --resume
    assert config["kind"] == "program" and config["world_size"] == 3


def test_a_run_that_pods_cannot_reach_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    root = project(tmp_path)  # no bucket: runs would go to ./runs on this machine
    r = cli(root, "train", "mnist", "--cluster", "k8s")
    assert r.code == ExitCode.USAGE and r.err.count("\n") == 1, r.err
    assert r.error_line().startswith("error: a run on Kubernetes cluster 'k8s' needs a bucket its pods reach"), r.err
    assert not (root / "runs").exists()


def test_without_an_image_it_says_where_to_get_one(tmp_path: Path) -> None:
    (tmp_path / "dtrain.toml").write_text('[clusters.k8s]\nbackend = "kubernetes"\nbucket = "gs://bkt"\n')
    r = cli(tmp_path, "train", "mnist", "--cluster", "k8s")
    assert r.code == ExitCode.USAGE and r.err.count("\n") == 1, r.err
    assert "cluster 'k8s' runs jobs in a container image and has none" in r.error_line(), r.err


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["submit", "mnist"], "error: cluster 'k8s' lacks a job queue: "),
        (["jobs"], "error: cluster 'k8s' lacks a job queue: "),
        (["cancel", "123"], "error: cluster 'k8s' lacks a job queue: "),
        (["logs", "123"], "error: cluster 'k8s' lacks a job queue: "),
        (["gpus"], "error: dtrain gpus needs a query of its nodes' GPUs, and cluster 'k8s' has none: "),
        (["doctor"], "error: dtrain doctor needs nodes reached over SSH, and cluster 'k8s' has none: "),
        (["exec", "master-0", "--", "true"], "error: "),
        (["eval", "some-run"], "error: dtrain eval --cluster needs evaluation on its nodes, and cluster 'k8s' has "),
        (["train", "mnist", "--time", "1:00:00"], "error: --time needs a job time limit, and cluster 'k8s' has none"),
    ],
)
def test_what_it_cannot_do_is_refused_in_one_line(tmp_path: Path, args: list[str], line: str) -> None:
    root = project(tmp_path)
    if args[0] == "eval":  # a run found here (./runs): the refusal is of evaluating it on the cluster
        (root / "runs" / "some-run").mkdir(parents=True)
        (root / "runs" / "some-run" / "config.json").write_text('{"workload": "mnist", "config": {}}')
    cut = args.index("--") if "--" in args else len(args)
    r = cli(root, *args[:cut], "--cluster", "k8s", *args[cut:])
    assert r.code == ExitCode.USAGE, (r.out, r.err)
    assert r.err.count("\n") == 1 and "Traceback" not in r.err, r.err
    assert r.error_line().startswith(line), r.err
    if args[0] != "eval":  # nothing was written for it
        assert not (root / "runs").exists()
    if args[0] == "exec":
        assert "cluster 'k8s'" in r.error_line() and "nodes reached over SSH" in r.error_line(), r.err


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        (
            {"namespace": "Team_A"},
            "namespace must be a Kubernetes name (lower-case letters, digits, '-'), got 'Team_A'",
        ),
        ({"nodes": 0}, "nodes must be from 1 to 1000, got 0"),
        ({"gpus_per_node": "2"}, "gpus_per_node must be an integer, got '2'"),
        ({"memory": "lots"}, 'memory must be a Kubernetes quantity like "16Gi" or "512Mi", got \'lots\''),
        ({"bucket": "s3://b"}, "bucket must be a gs:// URL the pods can reach (bucket = \"gs://NAME\"), got 's3://b'"),
        ({"rdzv_port": 70000}, "rdzv_port must be a TCP port (1-65535), got 70000"),
        ({"image": "Not An Image"}, "image 'Not An Image' is not an image reference"),
        ({"replicas": 2}, "unknown key 'replicas'"),
        ({"env": {"1X": "y"}}, "env.1X must be a variable name with a string value"),
    ],
)
def test_a_bad_table_is_one_line_naming_the_key(tmp_path: Path, keys: dict[str, Any], line: str) -> None:
    root = project(tmp_path, **keys)
    r = cli(root, "config", "show")
    assert r.code == ExitCode.USAGE, (r.out, r.err)
    assert r.err.count("\n") == 1 and "Traceback" not in r.err, r.err
    assert r.error_line().startswith(f"error: dtrain.toml [clusters.k8s]: {line}"), r.err


def test_the_yaml_is_the_data(tmp_path: Path) -> None:
    """The manifest's YAML is written without a YAML library; PyYAML reads back exactly the data."""
    yaml = pytest.importorskip("yaml")
    from dtrain.control.launchers.kubernetes import to_yaml

    data = {"a": {"b": [1, {"c": "x: y", "d": []}, "- z"], "e": {}, "f": True, "g": None},
            "nvidia.com/gpu": 2, "odd key": "#no comment", "s": "line\nbreak \"q\" 'q' \\ $(X) é"}  # fmt: skip
    assert yaml.safe_load(to_yaml(data)) == data


def test_job_names_are_dns_labels() -> None:
    from dtrain.control.launchers.kubernetes import job_name

    assert job_name("mnist-20261128-001952-3fa9", 0) == "mnist-20261128-001952-3fa9"
    assert job_name("mnist-20261128-001952-3fa9", 2) == "mnist-20261128-001952-3fa9-r2"
    assert job_name("7_My.Job-20261128", 0) == "dtrain-7-my-job-20261128"
    long = job_name("x" * 80, 1)
    assert len(long + "-worker-999") <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", long), long
    assert long != job_name("x" * 81, 1)


POD_PROGRAM = """\
import json, os, pathlib
import torch, torch.distributed as dist

dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
ckpt = pathlib.Path(os.environ["DTRAIN_CHECKPOINT_DIR"])
ckpt.mkdir(parents=True, exist_ok=True)
names = ("DTRAIN_RUN", "DTRAIN_NODE_RANK", "DTRAIN_NNODES", "GROUP_RANK", "WORLD_SIZE")
row = {"sum": total.item(), "cwd": os.getcwd(), **{n: os.environ.get(n) for n in names}}
(ckpt / f"rank-{dist.get_rank()}.json").write_text(json.dumps(row))
dist.destroy_process_group()
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs root and unshare (util-linux) "
                    "for each pod's private /etc/hosts (a mount namespace)")  # fmt: skip
def test_the_pods_command_lines_train_and_copy_their_checkpoints_to_the_bucket(tmp_path: Path, gcs_bucket: str):
    """What no API server here can do, done by hand: each pod of a 2-node job (Master, Worker) started as kubelet
    would start it, with the operator's variables, on this machine: its own /etc/hosts naming both pods (a mount
    namespace; the cluster's DNS), its own scratch folder (the emptyDir), the image's working directory holding the
    program. They rendezvous on the Master's name, all-reduce across 2 x 2 ranks, and each pod's node agent copies
    its checkpoint directory to the run's bucket, where the contract's values are read back."""
    from dtrain.common.mirror import restore

    code = tmp_path / "image-workdir"
    code.mkdir()
    (code / "train.py").write_text(POD_PROGRAM)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "p").mkdir()
    root = project(tmp_path / "p", gcs_bucket, nodes=2, nproc=2, rdzv_port=port)
    shutil.copy(code / "train.py", root / "train.py")
    r = cli(root, "train", "train.py", "--cluster", "k8s", env=run_env(tmp_path))
    assert r.code == ExitCode.USAGE, r.err
    (url,) = re.findall(r"gcloud storage cat (gs://\S+)/kubernetes/pytorchjob.yaml", r.out)
    job = sdk_round_trip(read_manifest(url))
    name = job.metadata.name
    (tmp_path / "hosts").write_text(f"127.0.0.1 localhost\n127.0.0.1 {name}-master-0 {name}-worker-0\n")
    pods = []
    for role in ("Master", "Worker"):
        argv, env, _spec = pod(job, role, 0)
        scratch = tmp_path / f"{role}-emptydir"
        scratch.mkdir()
        argv[2] = argv[2].replace("/dtrain/", f"{scratch}/")  # the pod's emptyDir, mounted at /dtrain there
        hosts = f'mount --bind {tmp_path / "hosts"} /etc/hosts && exec "$0" "$@"'
        environ = {**isolated_env(tmp_path), **env, "STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"],
                   "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # fmt: skip
        unshare = ["unshare", "-m", "--propagation", "private", "sh", "-c", hosts, *argv]
        pods.append(subprocess.Popen(unshare, cwd=code, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True))  # fmt: skip
    outs = [p.communicate(timeout=240)[0] for p in pods]
    assert [p.returncode for p in pods] == [0, 0], outs
    got = tmp_path / "restored"
    assert restore(open_store(f"{url}/ckpt"), got) is not None, outs
    rows = {p.name: json.loads(p.read_text()) for p in sorted(got.glob("rank-*.json"))}
    assert sorted(rows) == [f"rank-{i}.json" for i in range(4)], outs
    run_id = url.rsplit("/", 1)[-1]
    for i in range(4):
        row = rows[f"rank-{i}.json"]
        assert row["sum"] == 10.0 and (row["WORLD_SIZE"], row["DTRAIN_NNODES"], row["DTRAIN_RUN"]) == ("4", "2", run_id)
        assert row["DTRAIN_NODE_RANK"] == row["GROUP_RANK"] == str(i // 2), row  # the operator's rank is torchrun's
        assert Path(row["cwd"]).resolve() == code.resolve()  # the program runs in the image's working directory


def test_each_resume_is_a_new_job_that_puts_the_checkpoints_back(tmp_path: Path, gcs_bucket: str) -> None:
    """`--resume` renders another PyTorchJob beside the first (kubectl apply of the same name would only patch a
    finished job): its own name and file, DTRAIN_RESTART_COUNT counting the manifests before it, the checkpoint
    directory put back from the run's copy. The record still says not started, with the newest manifest."""
    root = project(tmp_path, gcs_bucket)
    (root / "train.py").write_text("print('hi')\n")
    first = cli(root, "train", "train.py", "--cluster", "k8s", env=run_env(tmp_path))
    (url,) = re.findall(r"gcloud storage cat (gs://\S+)/kubernetes/pytorchjob.yaml", first.out)
    run_id = url.rsplit("/", 1)[-1]
    for n in (1, 2):
        r = cli(root, "train", "--resume", url, "--cluster", "k8s", env=run_env(tmp_path))
        assert r.code == ExitCode.USAGE, r.err
        assert f"gcloud storage cat {url}/kubernetes/pytorchjob-r{n}.yaml | kubectl apply -f -" in r.out, r.out
        job = sdk_round_trip(yaml_of(url, f"kubernetes/pytorchjob-r{n}.yaml"))
        assert job.metadata.name == f"{run_id}-r{n}"
        _argv, env, spec = pod(job, "Master", 0)
        assert env["DTRAIN_RESTART_COUNT"] == str(n) and spec["files"]["mirror"]["restore"] is True
        assert spec["argv"][-1] == "train.py"
    run = open_store(url)
    status = json.loads(run.read_bytes("status.json"))
    assert (status["state"], status["starts"], status["kubernetes"]["name"]) == ("not-started", 0, f"{run_id}-r2")
    assert [json.loads(x)["event"] for x in run.read_bytes("events.jsonl").decode().splitlines()] == ["manifests"] * 3
    assert [n for n in run.list("") if n.startswith("kubernetes/")] == [
        "kubernetes/pytorchjob-r1.yaml",
        "kubernetes/pytorchjob-r2.yaml",
        "kubernetes/pytorchjob.yaml",
    ]


def test_rendering_needs_neither_torch_nor_the_sdk_nor_a_yaml_library(tmp_path: Path, gcs_bucket: str) -> None:
    """`dtrain train --cluster k8s` renders and writes the manifest in a CLI process that imports (or even tries)
    none of torch, the Kubernetes client, the Kubeflow SDK or PyYAML: they are the tests' only."""
    heavy = ("torch", "kubernetes", "kubeflow", "yaml")
    probe = (
        "import json, sys\n"
        f"heavy = {heavy!r}\n"
        "tried = []\n"
        "class Record:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if any(name == h or name.startswith(h + '.') for h in heavy):\n"
        "            tried.append(name)\n"
        "sys.meta_path.insert(0, Record())\n"
        "from dtrain.cli.main import run\n"
        "code = run(['train', 'mnist', '--cluster', 'k8s'])\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in heavy)\n"
        "print('\\nPROBE ' + json.dumps([code, loaded, sorted(set(tried))]))\n"
    )
    root = project(tmp_path, gcs_bucket)
    p = subprocess.run([sys.executable, "-c", probe], cwd=root, env=run_env(tmp_path), capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert "kubectl apply -f -" in p.stdout, p.stdout + p.stderr
    assert json.loads(p.stdout.rsplit("PROBE ", 1)[1]) == [int(ExitCode.USAGE), [], []]
