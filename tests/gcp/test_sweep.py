"""find_leftovers / delete_leftovers: what `dtrain down` sweeps after terraform destroy."""

from __future__ import annotations

from dtrain.control.gcp.sweep import KIND_ORDER, Leftover, delete_leftovers, find_leftovers

from .compute_fake import permission_denied
from .conftest import REGION

LABELS = {"dtrain-cluster": "demo"}


def leave_a_cluster_behind(world) -> None:
    """What a half-finished destroy of cluster `demo` can leave (named as infra/ names things),
    next to things that are not its."""
    world.add_network("dtrain-demo", description="dtrain cluster demo")
    world.add_subnetwork(REGION, "dtrain-demo", "dtrain-demo")
    world.add_subnetwork("europe-west4", "dtrain-demo-eu", "dtrain-demo")  # on our network: must go too
    world.add_router(REGION, "dtrain-demo-nat", "dtrain-demo", nat_subnetworks=["dtrain-demo"])
    world.add_firewall("dtrain-demo-internal", "dtrain-demo", description="Traffic between dtrain cluster demo nodes")
    world.add_firewall("dtrain-demo-ssh", "dtrain-demo", description="SSH to dtrain cluster demo nodes")
    world.add_firewall("demo-iap", "default", description="IAP to dtrain-cluster=demo")  # ours, on another network
    world.add_disk(f"{REGION}-a", "demo-data", labels=LABELS)
    world.add_instance(
        f"{REGION}-a",
        "demo-master",
        labels=LABELS,
        network="dtrain-demo",
        subnetwork="dtrain-demo",
        extra_disks=["demo-data"],
        external_ip="34.1.1.1",
    )
    world.add_instance(f"{REGION}-c", "demo-worker-0", labels=LABELS, network="dtrain-demo", subnetwork="dtrain-demo")
    world.add_address(REGION, "demo-master-ip", labels=LABELS)
    world.add_disk(f"{REGION}-b", "demo-orphan", labels=LABELS)
    # Not ours: a cluster whose name starts with ours, a same-named cluster in another region, the
    # default network, an unlabelled VM with a similar name.
    world.add_network("default")
    world.add_firewall("default-allow-ssh", "default")
    world.add_network("dtrain-demo-2", description="dtrain cluster demo-2")
    world.add_subnetwork(REGION, "dtrain-demo-2", "dtrain-demo-2")
    world.add_router(REGION, "dtrain-demo-2-nat", "dtrain-demo-2", nat_subnetworks=["dtrain-demo-2"])
    world.add_firewall("dtrain-demo-2-ssh", "dtrain-demo-2", description="SSH to dtrain cluster demo-2 nodes")
    world.add_instance(f"{REGION}-a", "demo-2-master", labels={"dtrain-cluster": "demo-2"}, network="dtrain-demo-2")
    world.add_instance("europe-west4-a", "demo-master", labels=LABELS)
    world.add_instance(f"{REGION}-a", "demo-scratch")


MINE = [
    ("instance", "demo-master", f"{REGION}-a"),
    ("instance", "demo-worker-0", f"{REGION}-c"),
    ("disk", "demo-data", f"{REGION}-a"),
    ("disk", "demo-master", f"{REGION}-a"),  # boot disks (labelled like their VM)
    ("disk", "demo-orphan", f"{REGION}-b"),
    ("disk", "demo-worker-0", f"{REGION}-c"),
    ("address", "demo-master-ip", REGION),
    ("router", "dtrain-demo-nat", REGION),
    ("firewall", "demo-iap", "global"),
    ("firewall", "dtrain-demo-internal", "global"),
    ("firewall", "dtrain-demo-ssh", "global"),
    ("subnetwork", "dtrain-demo-eu", "europe-west4"),
    ("subnetwork", "dtrain-demo", REGION),
    ("network", "dtrain-demo", "global"),
]


def test_finds_what_is_left_in_dependency_order(gcp, world):
    leave_a_cluster_behind(world)
    found = find_leftovers(gcp, REGION, "demo", include_buckets=False)
    assert [(x.kind, x.name, x.location) for x in found] == MINE
    why = {(x.kind, x.name): x.why for x in found}
    assert why[("instance", "demo-master")] == "label dtrain-cluster=demo"
    assert why[("firewall", "dtrain-demo-ssh")] == "on network dtrain-demo"
    assert why[("router", "dtrain-demo-nat")] == "on network dtrain-demo"
    assert why[("firewall", "demo-iap")] == "description names cluster demo"
    assert why[("network", "dtrain-demo")] == "name dtrain-demo"
    assert str(found[0]) == "instance demo-master (us-central1-a)"


def test_find_never_deletes(gcp, world):
    """`keep`: listing is read-only; everything is still there afterwards."""
    leave_a_cluster_behind(world)
    tables = (world.instances, world.disks, world.addresses, world.routers, world.firewalls, world.subnetworks,
              world.networks)  # fmt: skip
    before = [sorted(t) for t in tables]
    find_leftovers(gcp, REGION, "demo", include_buckets=False)
    assert [m for m, _, _ in world.requests if m != "GET"] == []
    assert [sorted(t) for t in tables] == before


def test_delete_then_a_second_sweep_finds_nothing(gcp, world):
    leave_a_cluster_behind(world)
    found = find_leftovers(gcp, REGION, "demo", include_buckets=False)
    seen = []
    results = delete_leftovers(gcp, found, on_result=seen.append)
    assert sorted(seen, key=str) == sorted(results, key=str)  # reported as each one ends
    assert [r.leftover for r in results] == found
    assert all(r.ok for r in results), [str(r) for r in results if not r.ok]
    messages = {r.leftover.name: r.message for r in results if r.leftover.kind == "disk"}
    # Boot disks go with their VM (autoDelete); the data disk and the orphan need their own delete.
    assert messages == {
        "demo-master": "already gone",
        "demo-worker-0": "already gone",
        "demo-data": "deleted",
        "demo-orphan": "deleted",
    }
    assert find_leftovers(gcp, REGION, "demo", include_buckets=False) == []
    # What was not ours is untouched.
    assert set(world.networks) == {"default", "dtrain-demo-2"}
    assert set(world.firewalls) == {"default-allow-ssh", "dtrain-demo-2-ssh"}
    assert list(world.routers) == [(REGION, "dtrain-demo-2-nat")]
    assert list(world.subnetworks) == [(REGION, "dtrain-demo-2")]
    assert sorted(world.instances) == [
        ("europe-west4-a", "demo-master"),
        (f"{REGION}-a", "demo-2-master"),
        (f"{REGION}-a", "demo-scratch"),
    ]
    # Dependency order on the wire: every VM delete before any disk delete, ..., the network last.
    deletes = [p for m, p, _ in world.requests if m == "DELETE"]
    kinds = [_kind_of(p) for p in deletes]
    assert kinds == sorted(kinds, key=KIND_ORDER.index)
    # Operations were waited on at our endpoint (not through the library's own poller).
    assert world.called("POST", r"/operations/[^/]+/wait$") >= len(deletes) - 2


def _kind_of(path: str) -> str:
    segment = path.split("/")[-2]
    return segment[:-2] if segment == "addresses" else segment[:-1]


def test_failures_are_reported_per_item_and_the_rest_goes_on(gcp, world):
    leave_a_cluster_behind(world)
    world.op_failures[("firewall", "dtrain-demo-ssh")] = "The firewall is locked by a policy"
    orphan = "projects/dtrain-test/zones/us-central1-b/disks/demo-orphan"
    world.fail("DELETE", r"/disks/demo-orphan$", permission_denied("compute.disks.delete", orphan))
    found = find_leftovers(gcp, REGION, "demo", include_buckets=False)
    listed = delete_leftovers(gcp, found)
    assert [r.leftover for r in listed] == found  # every item has a result, in order
    failed = {(r.leftover.kind, r.leftover.name): r.message for r in listed if not r.ok}
    assert set(failed) == {("firewall", "dtrain-demo-ssh"), ("disk", "demo-orphan"), ("network", "dtrain-demo")}
    assert failed[("firewall", "dtrain-demo-ssh")] == (
        "not deleted: RESOURCE_OPERATION_FAILED: The firewall is locked by a policy"
    )
    assert failed[("disk", "demo-orphan")] == (
        "not deleted: permission compute.disks.delete denied in project dtrain-test: ask for "
        "roles/compute.instanceAdmin.v1 (gcloud projects add-iam-policy-binding dtrain-test "
        "--member=user:YOU --role=roles/compute.instanceAdmin.v1)"
    )
    # The network is still used by the firewall that could not go: the API's 400, as one line.
    assert failed[("network", "dtrain-demo")] == (
        "not deleted: the API rejected the request: The network resource 'projects/dtrain-test/global/networks/"
        "dtrain-demo' is already being used by 'projects/dtrain-test/global/firewalls/dtrain-demo-ssh'"
    )
    # A second sweep lists exactly what is left.
    left = find_leftovers(gcp, REGION, "demo", include_buckets=False)
    assert [(x.kind, x.name) for x in left] == [
        ("disk", "demo-orphan"),
        ("firewall", "dtrain-demo-ssh"),
        ("network", "dtrain-demo"),
    ]


def test_operation_that_never_finishes_times_out_per_item(gcp, world):
    world.add_network("dtrain-demo", description="dtrain cluster demo")
    world.add_firewall("dtrain-demo-ssh", "dtrain-demo")
    world.add_firewall("dtrain-demo-internal", "dtrain-demo")
    world.polls_to_finish = 10**6
    found = [x for x in find_leftovers(gcp, REGION, "demo", include_buckets=False) if x.kind == "firewall"]
    results = delete_leftovers(gcp, found, timeout_s=0.3)
    assert [r.ok for r in results] == [False, False]
    assert results[0].message.startswith("not deleted: still running after 0s (operation operation-")


def test_already_gone_counts_as_done(gcp, world):
    results = delete_leftovers(gcp, [Leftover("instance", "demo-master", f"{REGION}-a", "label")])
    assert [(r.ok, r.message) for r in results] == [(True, "already gone")]


def test_label_less_resources_are_matched_by_whole_name(gcp, world):
    """Networks carry no labels: `dtrain-<name>` exactly, or a description naming the cluster as
    a whole word; never a network of cluster demo-2 or demo.old when sweeping demo."""
    world.add_network("dtrain-demo")  # no description (made by hand, or an older infra/)
    world.add_network("dtrain-demo-2", description="dtrain cluster demo-2")
    world.add_network("dtrain-demo-x")  # no description: not provably ours
    world.add_network("lab-net", description="shared with dtrain cluster demo.old")
    world.add_network("scratch", description="made for dtrain-cluster=demo by hand")
    found = {x.name: x.why for x in find_leftovers(gcp, REGION, "demo", include_buckets=False)}
    assert found == {"dtrain-demo": "name dtrain-demo", "scratch": "description names cluster demo"}
