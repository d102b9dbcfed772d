"""The bucket part of the sweep, against gcp-storage-emulator (the session's `gcs_emulator`).

The emulator keeps bucket labels set by PATCH (bucket.patch()), not those sent with the create
request, so the buckets here are created and then labelled: what a real bucket ends up as either way.
"""

from __future__ import annotations

import uuid

import pytest

from dtrain.control.gcp.client import Gcp
from dtrain.control.gcp.sweep import delete_leftovers, find_leftovers

from .conftest import PROJECT, REGION


@pytest.fixture
def gcp_with_storage(server, gcs_emulator, monkeypatch) -> Gcp:
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)  # the endpoint is given explicitly
    return Gcp.connect(
        PROJECT, endpoint=server.endpoint, storage_endpoint=gcs_emulator, credentials=AnonymousCredentials()
    )


def make_bucket(gcp: Gcp, name: str, labels: dict[str, str] | None, objects: int = 0) -> None:
    bucket = gcp.storage().create_bucket(name)
    if labels:
        bucket.labels = labels
        bucket.patch()
    for i in range(objects):
        bucket.blob(f"runs/mnist-1/checkpoints/step-{i:08d}/state.pt").upload_from_string(b"x" * 100)


def test_buckets_are_swept_only_when_asked(gcp_with_storage):
    gcp = gcp_with_storage
    cluster = f"c{uuid.uuid4().hex[:8]}"
    mine, theirs, unlabelled = f"{cluster}-ckpt", f"{cluster}-2-ckpt", f"{cluster}-scratch"
    make_bucket(gcp, mine, {"dtrain-cluster": cluster}, objects=3)
    make_bucket(gcp, theirs, {"dtrain-cluster": f"{cluster}-2"}, objects=1)
    make_bucket(gcp, unlabelled, None)

    assert find_leftovers(gcp, REGION, cluster, include_buckets=False) == []  # keep the checkpoints
    found = find_leftovers(gcp, REGION, cluster, include_buckets=True)
    assert [(x.kind, x.name, x.why) for x in found] == [("bucket", mine, f"label dtrain-cluster={cluster}")]

    results = delete_leftovers(gcp, found)
    assert [(r.ok, r.message) for r in results] == [(True, "deleted (3 objects)")]
    assert find_leftovers(gcp, REGION, cluster, include_buckets=True) == []
    names = {b.name for b in gcp.storage().list_buckets()}
    assert mine not in names and {theirs, unlabelled} <= names
    # A bucket that went in the meantime is not a failure.
    again = delete_leftovers(gcp, found)
    assert [(r.ok, r.message) for r in again] == [(True, "already gone")]
