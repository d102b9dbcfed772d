"""A fake Compute Engine (compute_fake.py) with a small world, and a Gcp pointed at it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("google.cloud.compute_v1", reason="needs google-cloud-compute (pip install 'dtrain[gcp]')")

from dtrain.control.gcp import client, sweep  # noqa: E402

from .compute_fake import ComputeWorld, FakeComputeServer  # noqa: E402

PROJECT = "dtrain-test"
REGION = "us-central1"


@pytest.fixture
def world() -> ComputeWorld:
    """us-central1 (zones a, b, c, f) and europe-west4 (a); generous quotas; nvidia-l4 in
    us-central1-a and -c (and europe-west4-a), nvidia-tesla-t4 in us-central1-b and -f."""
    w = ComputeWorld(PROJECT)
    w.add_region(REGION, [f"{REGION}-{z}" for z in "abcf"])
    w.add_region("europe-west4", ["europe-west4-a"])
    for metric, limit in [
        ("CPUS", 96),
        ("PREEMPTIBLE_CPUS", 0),
        ("INSTANCES", 100),
        ("IN_USE_ADDRESSES", 8),
        ("NVIDIA_L4_GPUS", 8),
        ("PREEMPTIBLE_NVIDIA_L4_GPUS", 0),
        ("NVIDIA_T4_GPUS", 4),
        ("G2_CPUS", 96),
        ("SSD_TOTAL_GB", 4096),
    ]:
        w.set_quota(metric, limit, 0, region=REGION)
    w.set_quota("GPUS_ALL_REGIONS", 8, 0)
    w.set_quota("CPUS_ALL_REGIONS", 200, 0)
    for zone in (f"{REGION}-a", f"{REGION}-c", "europe-west4-a"):
        w.offer(zone, "nvidia-l4", 8)
    for zone in (f"{REGION}-b", f"{REGION}-f"):
        w.offer(zone, "nvidia-tesla-t4", 4)
    return w


@pytest.fixture
def server(world: ComputeWorld) -> Iterator[FakeComputeServer]:
    with world.serve() as srv:
        yield srv


@pytest.fixture
def gcp(server: FakeComputeServer, monkeypatch: pytest.MonkeyPatch) -> client.Gcp:
    from google.auth.credentials import AnonymousCredentials

    # The fake's operations finish after a couple of polls; no need to pace them a second apart.
    monkeypatch.setattr(sweep, "OPERATION_POLL_S", 0.01)
    # Transient errors are retried for RETRY_DEADLINE_S (30 s); tests that inject them need less.
    monkeypatch.setattr(client, "RETRY_DEADLINE_S", 0.5)
    return client.Gcp.connect(
        PROJECT, endpoint=server.endpoint, api_endpoint=server.endpoint, credentials=AnonymousCredentials()
    )


@pytest.fixture
def cluster_ctx(gcp, tmp_path, monkeypatch: pytest.MonkeyPatch):
    """(extra dtrain.toml lines) -> lifecycle.Context of cluster "demo" in us-central1-a, against the fake."""
    from dtrain.control.gcp import lifecycle
    from dtrain.control.settings import cluster_config

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    for name in ("DTRAIN_GCP_COMPUTE_ENDPOINT", "DTRAIN_GCP_API_ENDPOINT"):
        monkeypatch.setenv(name, gcp.endpoint)

    def make(extra: str = "") -> lifecycle.Context:
        toml = tmp_path / "dtrain.toml"
        toml.write_text(
            f'[clusters.demo]\nbackend = "gcp"\nproject = "{gcp.project}"\nzone = "{REGION}-a"\n'
            f'ssh_source_ranges = ["203.0.113.7/32"]\n{extra}'
        )
        return lifecycle.context(cluster_config(toml, "demo"))

    return make
