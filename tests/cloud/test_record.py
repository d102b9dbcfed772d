"""The cluster record `dtrain up` writes, and the gcp backend's node list made from it."""

from __future__ import annotations

import copy
import json
import os

import pytest

from dtrain.common.errors import UserError
from dtrain.control.backends import resolve
from dtrain.control.gcp.record import key_path, read_record, record_path, remove_record, write_record
from dtrain.control.settings import get_cluster, load_settings

RECORD = {
    "name": "demo",
    "backend": "gcp",
    "project": "proj-123456",
    "region": "us-central1",
    "zone": "us-central1-a",
    "bucket": "gs://proj-123456-dtrain-demo",
    "registry": "us-central1-docker.pkg.dev/proj-123456/dtrain-demo",
    "ssh_user": "dtrain",
    "nodes": [
        {"name": "demo-worker-0", "role": "worker", "internal_ip": "10.42.0.3", "external_ip": "", "gpus": 1},
        {"name": "demo-master", "role": "master", "internal_ip": "10.42.0.2", "external_ip": "34.1.2.3", "gpus": 1},
    ],
}


@pytest.fixture
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


def test_write_read_roundtrip_is_atomic_and_private(config_home):
    path = write_record(copy.deepcopy(RECORD))
    assert path == record_path("demo")
    assert read_record("demo") == RECORD
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert [p.name for p in path.parent.iterdir()] == ["record.json"]  # no temp file left
    remove_record("demo")
    assert read_record("demo") is None


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.pop("zone"), "'zone' is missing"),
        (lambda r: r.update(nodes=[]), "has no nodes"),
        (lambda r: r["nodes"][1].update(role="worker"), "exactly one master"),
        (lambda r: r["nodes"][0].update(internal_ip="not-an-ip"), "is not an IP address"),
        (lambda r: r["nodes"][0].update(gpus="1"), "nodes[0].gpus is missing or not an integer"),
        (lambda r: r["nodes"][0].update(role="boss"), "role must be master or worker"),
    ],
)
def test_bad_records_are_refused(config_home, mutate, message):
    rec = copy.deepcopy(RECORD)
    mutate(rec)
    with pytest.raises(UserError) as e:
        write_record(rec)
    assert message in str(e.value)
    # a corrupt file on disk is refused with the fix
    record_path("demo").parent.mkdir(parents=True, exist_ok=True)
    record_path("demo").write_text(json.dumps(rec))
    with pytest.raises(UserError) as e2:
        read_record("demo")
    assert message in str(e2.value)


def test_gcp_backend_makes_nodes_from_the_record(config_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gcloud = tmp_path / "bin" / "gcloud"  # only looked for, never run here
    gcloud.parent.mkdir()
    gcloud.write_text("#!/bin/sh\nexit 1\n")
    gcloud.chmod(0o755)
    monkeypatch.setenv("PATH", f"{gcloud.parent}:{os.environ['PATH']}")
    (tmp_path / "dtrain.toml").write_text(
        '[clusters.demo]\nbackend = "gcp"\nproject = "proj-123456"\nssh_source_ranges = ["203.0.113.7/32"]\n'
        "rdzv_port = 29500\n"
    )
    settings = load_settings(None, {"run.cluster": "demo"})
    with pytest.raises(UserError, match="is not up .* run dtrain up --cluster demo"):
        resolve(get_cluster(settings))
    write_record(copy.deepcopy(RECORD))
    with pytest.raises(UserError, match="SSH key .* is missing"):
        resolve(get_cluster(settings))
    key_path("demo").write_text("not really a key")
    cluster = resolve(get_cluster(settings))
    assert cluster.backend == "gcp"
    assert [n.name for n in cluster.nodes] == ["demo-master", "demo-worker-0"]  # the master first
    master, worker = cluster.nodes
    assert master.master and not worker.master
    assert (master.address, master.ssh_host, master.user) == ("10.42.0.2", "34.1.2.3", "dtrain")
    # No external address: reached through IAP, by name (issue 16: the internal one is not reachable
    # from outside the VPC).
    assert (worker.ssh_host, worker.address) == ("demo-worker-0", "10.42.0.3")
    assert worker.proxy_command == (
        f"{gcloud} compute start-iap-tunnel demo-worker-0 %p --listen-on-stdin --project=proj-123456 "
        "--zone=us-central1-a --verbosity=warning"
    )
    assert master.proxy_command == ""
    assert master.key == str(key_path("demo"))
    assert cluster.rdzv_port == 29500
    assert cluster.known_hosts == key_path("demo").parent / "known_hosts"
    assert cluster.default_output == "gs://proj-123456-dtrain-demo/runs"
    # infra/'s nodes have Docker, not torch: the job needs an image, by default the last one built
    assert cluster.needs_image and cluster.image == ""
    (key_path("demo").parent / "image").write_text("us-central1-docker.pkg.dev/p/r/dtrain-train@sha256:" + "a" * 64)
    assert resolve(get_cluster(settings)).image.endswith("@sha256:" + "a" * 64)


def test_training_on_a_gcp_cluster_without_an_image_says_how_to_get_one(config_home, tmp_path, monkeypatch):
    from runs import cli, isolated_env

    (tmp_path / "dtrain.toml").write_text('[clusters.demo]\nbackend = "gcp"\nproject = "proj-123456"\n')
    write_record(copy.deepcopy(RECORD))
    key_path("demo").write_text("key")
    r = cli(
        tmp_path, "train", "mnist", "--cluster", "demo", env=isolated_env(tmp_path, XDG_CONFIG_HOME=str(config_home))
    )
    assert r.code == 2
    # The same line as for a user's program (launchers.job_cluster)
    assert "cluster 'demo' runs jobs in a container image and has none: run dtrain build --cluster demo" in (
        r.error_line()
    )


def test_gcp_cluster_table_rejects_hosts_keys(config_home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dtrain.toml").write_text('[clusters.demo]\nbackend = "gcp"\ninventory = "hosts.toml"\n')
    with pytest.raises(UserError, match="unknown key 'inventory'"):
        load_settings(None, {})


def test_dtrain_build_makes_its_push_the_clusters_default_image(config_home):
    from dtrain.control.events import Collector
    from dtrain.control.gcp.record import cluster_dir
    from dtrain.control.images import remember_image

    ref = "us-central1-docker.pkg.dev/proj-123456/dtrain-demo/dtrain-train-gpu@sha256:" + "b" * 64
    assert not remember_image("demo", ref, gpu=True, events=Collector())  # no record: not a cluster dtrain up made
    write_record(copy.deepcopy(RECORD))  # its nodes have GPUs
    events = Collector()
    assert not remember_image(
        "demo", ref.replace("-gpu", ""), gpu=False, events=events
    )  # a CPU image for GPU nodes: no
    assert not (cluster_dir("demo") / "image").exists()
    assert "has GPU nodes: this image is not made its default" in events.events[0].message
    assert remember_image("demo", ref, gpu=True, events=Collector())
    assert (cluster_dir("demo") / "image").read_text().strip() == ref


def test_runs_of_a_gcp_cluster_are_listed_from_its_bucket(config_home, tmp_path, monkeypatch, gcs_emulator):
    """`dtrain runs` with run.cluster naming a gcp cluster reads the cluster's bucket, as `train` writes there
    (settings.run_output, the one home of that rule); --output still wins, and a cluster not up gives ./runs."""
    import json as _json

    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from runs import cli, isolated_env

    from dtrain.common.storage import open_store
    from dtrain.control.settings import run_output

    (tmp_path / "dtrain.toml").write_text(
        '[run]\ncluster = "demo"\n\n[clusters.demo]\nbackend = "gcp"\nproject = "proj-123456"\n'
        'ssh_source_ranges = ["203.0.113.7/32"]\n'
    )
    monkeypatch.chdir(tmp_path)
    assert run_output(load_settings(None, {})) == "runs"  # not up: no record
    write_record(copy.deepcopy(RECORD))
    key_path("demo").write_text("not really a key")
    assert run_output(load_settings(None, {})) == "gs://proj-123456-dtrain-demo/runs"
    assert run_output(load_settings(None, {"run.output": "elsewhere"})) == "elsewhere"

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    storage.Client(project="p", credentials=AnonymousCredentials()).create_bucket("proj-123456-dtrain-demo")
    run = open_store("gs://proj-123456-dtrain-demo/runs/fit-20261125-120000-abcd")
    run.write_bytes("config.json", _json.dumps({"workload": "fit", "kind": "program", "created": 1.0}).encode())
    run.write_bytes("status.json", _json.dumps({"state": "completed", "exit_code": 0, "updated": 2.0}).encode())
    env = isolated_env(tmp_path, XDG_CONFIG_HOME=str(config_home), STORAGE_EMULATOR_HOST=gcs_emulator)
    r = cli(tmp_path, "runs", "--json", env=env)
    assert r.code == 0, r.err
    (row,) = _json.loads(r.out)
    assert (row["run_id"], row["workload"], row["status"]) == ("fit-20261125-120000-abcd", "fit", "completed")


def test_a_users_program_on_a_cluster_that_runs_jobs_in_an_image_is_one_line(config_home, tmp_path, monkeypatch):
    """The clusters `dtrain up` makes run jobs in an image. Without one yet, a user's program is refused with
    the way to get one, with or without Slurm, before any node (or Slurm's login node) is reached, and no run is
    made."""
    from runs import cli, isolated_env

    (tmp_path / "dtrain.toml").write_text(
        '[clusters.demo]\nbackend = "gcp"\nproject = "proj-123456"\nssh_source_ranges = ["203.0.113.7/32"]\n'
    )
    (tmp_path / "train.py").write_text("print('never')\n")
    monkeypatch.chdir(tmp_path)
    key_path("demo").parent.mkdir(parents=True, exist_ok=True)
    env = isolated_env(tmp_path, XDG_CONFIG_HOME=str(config_home))
    for record, verbs in (({}, ("train",)), ({"slurm": True}, ("train", "submit"))):
        write_record({**copy.deepcopy(RECORD), **record})
        key_path("demo").write_text("not really a key")
        for verb in verbs:
            r = cli(tmp_path, verb, "train.py", "--cluster", "demo", env=env)
            assert r.code == 2, r.err
            assert r.error_line() == (
                "error: cluster 'demo' runs jobs in a container image and has none: run dtrain build --cluster "
                'demo, or set image = "..." in [clusters.demo], or pass --image'
            )
    assert not (tmp_path / "runs").exists()
