"""preflight: quotas, accelerator offer per zone, ranked zones, against the fake Compute API."""

from __future__ import annotations

import pytest

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.gcp.preflight import preflight

from .conftest import PROJECT, REGION

QUOTAS = f"https://console.cloud.google.com/iam-admin/quotas?project={PROJECT}"


def run(gcp, zone=f"{REGION}-a", accelerator="nvidia-l4", gpus=4, cpus=32, spot=False, instances=4, **kw):
    return preflight(gcp, REGION, zone, accelerator, gpus, cpus, spot, instances, **kw)


def test_everything_fits(gcp, world):
    report = run(gcp)
    assert report.ok, report.problems
    assert report.zones == [f"{REGION}-a", f"{REGION}-c"]
    checked = {q.metric: q for q in report.quotas}
    assert set(checked) == {"CPUS", "INSTANCES", "IN_USE_ADDRESSES", "NVIDIA_L4_GPUS", "GPUS_ALL_REGIONS"}
    assert checked["NVIDIA_L4_GPUS"].needed == 4 and checked["GPUS_ALL_REGIONS"].scope == "global"
    assert "nvidia-l4 offered in us-central1: us-central1-a, us-central1-c" in report.checked()
    # Five calls, each answered in one page or followed through the pager.
    assert world.called("GET", r"/regions/us-central1$") == 1
    assert world.called("GET", r"/projects/dtrain-test$") == 1
    assert world.called("GET", r"/aggregated/acceleratorTypes$") >= 1
    assert world.called("GET", r"/zones/[^/]+/acceleratorTypes$") == 0


def test_regional_gpu_quota_exhausted(gcp, world):
    world.set_quota("NVIDIA_L4_GPUS", 1, 0, region=REGION)
    report = run(gcp)
    assert not report.ok
    assert report.problems == [
        f"request NVIDIA_L4_GPUS >= 4 in us-central1 (limit 1, in use 0, this cluster needs 4): {QUOTAS}"
    ]


def test_gpu_quota_counts_what_is_already_in_use(gcp, world):
    world.set_quota("NVIDIA_L4_GPUS", 8, 6, region=REGION)
    report = run(gcp)
    assert report.problems == [
        f"request NVIDIA_L4_GPUS >= 10 in us-central1 (limit 8, in use 6, this cluster needs 4): {QUOTAS}"
    ]


def test_spot_uses_preemptible_quota_where_granted(gcp, world):
    world.set_quota("NVIDIA_L4_GPUS", 0, 0, region=REGION)  # standard quota does not matter for spot
    world.set_quota("PREEMPTIBLE_NVIDIA_L4_GPUS", 2, 1, region=REGION)
    report = run(gcp, spot=True)
    assert report.problems == [
        f"request PREEMPTIBLE_NVIDIA_L4_GPUS >= 5 in us-central1 (limit 2, in use 1, this cluster needs 4): {QUOTAS}"
    ]


def test_spot_falls_back_to_standard_quota_without_a_preemptible_grant(gcp, world):
    world.set_quota("NVIDIA_L4_GPUS", 2, 0, region=REGION)  # PREEMPTIBLE_NVIDIA_L4_GPUS is 0 in the world
    report = run(gcp, spot=True)
    assert report.problems == [
        f"request NVIDIA_L4_GPUS >= 4 in us-central1 (limit 2, in use 0, this cluster needs 4): {QUOTAS}"
    ]
    assert "no PREEMPTIBLE_NVIDIA_L4_GPUS quota granted in us-central1: spot VMs use NVIDIA_L4_GPUS" in report.notes


def test_an_on_demand_master_among_spot_workers_counts_against_standard_quota(gcp, world):
    # 4 nodes with 1 L4 and 8 vCPUs each: the master (on-demand, master_spot = false) on the standard
    # quotas, the 3 Spot workers on the PREEMPTIBLE_ ones.
    world.set_quota("NVIDIA_L4_GPUS", 0, 0, region=REGION)
    world.set_quota("PREEMPTIBLE_NVIDIA_L4_GPUS", 8, 0, region=REGION)
    world.set_quota("PREEMPTIBLE_G2_CPUS", 64, 0, region=REGION)
    report = run(gcp, spot=True, cpus=32, machine_family="g2", on_demand_instances=1)
    assert report.problems == [
        f"request NVIDIA_L4_GPUS >= 1 in us-central1 (limit 0, in use 0, this cluster needs 1): {QUOTAS}"
    ]
    needs = {(q.metric, q.needed) for q in report.quotas}
    assert {("G2_CPUS", 8), ("PREEMPTIBLE_G2_CPUS", 24), ("PREEMPTIBLE_NVIDIA_L4_GPUS", 3)} <= needs
    # Without a PREEMPTIBLE_ grant every node is on the standard quota, as before.
    world.set_quota("NVIDIA_L4_GPUS", 4, 0, region=REGION)
    world.set_quota("PREEMPTIBLE_NVIDIA_L4_GPUS", 0, 0, region=REGION)
    report = run(gcp, spot=True, cpus=32, machine_family="g2", on_demand_instances=1)
    assert report.problems == []
    assert ("NVIDIA_L4_GPUS", 4) in {(q.metric, q.needed) for q in report.quotas}


def test_gpus_all_regions(gcp, world):
    world.set_quota("GPUS_ALL_REGIONS", 1, 0)
    report = run(gcp)
    assert report.problems == [
        f"request GPUS_ALL_REGIONS >= 4 for all regions (limit 1, in use 0, this cluster needs 4): {QUOTAS}"
    ]


def test_cpus_and_spot_cpus(gcp, world):
    world.set_quota("CPUS", 24, 8, region=REGION)
    assert run(gcp, cpus=32).problems == [
        f"request CPUS >= 40 in us-central1 (limit 24, in use 8, this cluster needs 32): {QUOTAS}"
    ]
    world.set_quota("PREEMPTIBLE_CPUS", 16, 0, region=REGION)
    assert run(gcp, cpus=32, spot=True).problems == [
        f"request PREEMPTIBLE_CPUS >= 32 in us-central1 (limit 16, in use 0, this cluster needs 32): {QUOTAS}"
    ]


def test_several_problems_are_all_listed(gcp, world):
    world.set_quota("NVIDIA_L4_GPUS", 1, 0, region=REGION)
    world.set_quota("IN_USE_ADDRESSES", 8, 7, region=REGION)
    report = run(gcp, zone=f"{REGION}-b")
    assert [p.split(" ")[1] for p in report.problems[:2]] == ["IN_USE_ADDRESSES", "NVIDIA_L4_GPUS"]
    assert report.problems[2].startswith("nvidia-l4 is not offered in us-central1-b")


def test_metric_missing_from_the_region_is_limit_zero(gcp, world):
    del world.regions[REGION]["quotas"]["NVIDIA_L4_GPUS"]
    report = run(gcp, gpus=1, instances=1)
    assert report.problems == [
        f"request NVIDIA_L4_GPUS >= 1 in us-central1 (limit 0, in use 0, this cluster needs 1): {QUOTAS}"
    ]


def test_accelerator_not_offered_in_the_zone_lists_the_zones_that_offer_it(gcp):
    report = run(gcp, zone=f"{REGION}-b")
    assert report.problems == [
        "nvidia-l4 is not offered in us-central1-b; zones in us-central1 that offer it: us-central1-a, us-central1-c"
    ]
    assert report.zones == [f"{REGION}-a", f"{REGION}-c"]  # europe-west4-a offers it too, but is elsewhere


def test_zones_are_ranked_chosen_first_then_by_name(gcp, world):
    world.offer(f"{REGION}-f", "nvidia-l4", 8)
    assert run(gcp, zone=f"{REGION}-c").zones == [f"{REGION}-c", f"{REGION}-a", f"{REGION}-f"]
    world.zones[f"{REGION}-a"]["status"] = "DOWN"
    assert run(gcp, zone=f"{REGION}-c").zones == [f"{REGION}-c", f"{REGION}-f"]


def test_maximum_cards_per_instance(gcp, world):
    world.offer(f"{REGION}-a", "nvidia-l4", 1)
    report = run(gcp, gpus=4, instances=2)  # 2 per VM
    assert report.problems == [
        "nvidia-l4 allows at most 1 per VM in us-central1-a, the cluster asks for 2: "
        "use fewer GPUs per node and more nodes"
    ]
    assert report.zones == [f"{REGION}-c"]
    assert run(gcp, gpus=4, instances=4).zones == [f"{REGION}-a", f"{REGION}-c"]


def test_accelerator_offered_nowhere_in_the_region(gcp):
    report = run(gcp, accelerator="nvidia-h100-80gb", gpus=8, instances=1)
    assert "nvidia-h100-80gb is not offered in us-central1-a; no zone in us-central1 offers it" in report.problems
    assert report.zones == []


def test_cpu_only_cluster_asks_nothing_about_gpus(gcp, world):
    report = run(gcp, zone=f"{REGION}-b", accelerator=None, gpus=0, cpus=8, instances=2)
    assert report.ok, report.problems
    assert report.zones == [f"{REGION}-b", f"{REGION}-a", f"{REGION}-c", f"{REGION}-f"]
    assert world.called("GET", "acceleratorTypes") == 0
    assert world.called("GET", r"/projects/dtrain-test$") == 0


def test_zone_outside_the_region(gcp):
    report = run(gcp, zone="europe-west4-a")
    assert report.problems[0] == (
        "zone europe-west4-a is not a zone of us-central1 that is up "
        "(zones: us-central1-a, us-central1-b, us-central1-c, us-central1-f): set zone = one of them"
    )


def test_unknown_region(gcp):
    with pytest.raises(UserError) as e:
        preflight(gcp, "us-central9", "us-central9-a", "nvidia-l4", 1, 4, False, 1)
    assert str(e.value) == (
        "reading quotas of region us-central9: region us-central9 not found in project dtrain-test: "
        "gcloud compute regions list shows the valid ones"
    )
    assert e.value.exit_code == ExitCode.USAGE


# --- the quotas a G2 node and its boot disk draw on (issue 16) ---------------------------------


def test_g2_vcpus_count_against_g2_cpus_not_cpus(gcp, world):
    world.set_quota("G2_CPUS", 16, 8, region=REGION)  # CPUS has room (96); G2_CPUS does not
    report = run(gcp, gpus=2, cpus=16, instances=2, machine_family="g2")
    assert report.problems == [
        f"request G2_CPUS >= 24 in us-central1 (limit 16, in use 8, this cluster needs 16): {QUOTAS}"
    ]
    assert "CPUS" not in {q.metric for q in report.quotas}


def test_e2_and_n1_vcpus_count_against_cpus(gcp, world):
    world.set_quota("CPUS", 8, 0, region=REGION)
    for family in ("e2", "n1"):
        report = run(gcp, accelerator=None, gpus=0, cpus=16, instances=2, machine_family=family)
        assert report.problems == [
            f"request CPUS >= 16 in us-central1 (limit 8, in use 0, this cluster needs 16): {QUOTAS}"
        ], family


def test_spot_g2_without_a_preemptible_grant_uses_g2_cpus(gcp, world):
    report = run(gcp, gpus=2, cpus=16, instances=2, machine_family="g2", spot=True)
    assert report.ok, report.problems
    assert "no PREEMPTIBLE_G2_CPUS quota granted in us-central1: spot VMs use G2_CPUS" in report.notes
    assert {q.metric for q in report.quotas} >= {"G2_CPUS"}


def test_a_series_quota_the_region_does_not_list_is_not_guessed(gcp, world):
    del world.regions[REGION]["quotas"]["G2_CPUS"]
    report = run(gcp, gpus=2, cpus=16, instances=2, machine_family="g2")
    assert report.ok, report.problems
    assert "G2_CPUS is not listed for us-central1: vCPU quota not checked" in report.notes


def test_boot_disks_count_against_ssd_total_gb(gcp, world):
    world.set_quota("SSD_TOTAL_GB", 500, 300, region=REGION)
    report = run(gcp, gpus=2, cpus=16, instances=2, machine_family="g2", disk_gb_total=200)
    assert report.ok, report.problems
    assert "SSD_TOTAL_GB (us-central1): 300/500 used, needs 200" in report.checked()
    report = run(gcp, gpus=2, cpus=16, instances=2, machine_family="g2", disk_gb_total=400)
    assert report.problems == [
        f"request SSD_TOTAL_GB >= 700 in us-central1 (limit 500, in use 300, this cluster needs 400): {QUOTAS}"
    ]


def test_a_disk_quota_the_region_does_not_list_is_said_not_guessed(gcp, world):
    del world.regions[REGION]["quotas"]["SSD_TOTAL_GB"]
    report = run(gcp, disk_gb_total=400)
    assert report.ok, report.problems
    assert "SSD_TOTAL_GB is not listed for us-central1: boot disk quota not checked" in report.notes


def test_nodes_without_external_ips_need_no_address_quota(gcp, world):
    world.set_quota("IN_USE_ADDRESSES", 8, 8, region=REGION)
    assert run(gcp).problems[0].startswith("request IN_USE_ADDRESSES >= 12")
    report = run(gcp, external_ips=False)
    assert report.ok, report.problems
    assert "IN_USE_ADDRESSES" not in {q.metric for q in report.quotas}


# --- no zone configured: the region's own zones, never a guessed <region>-a ----------------------


@pytest.fixture
def east(world):
    """us-east1, whose zones are b, c and d (it has no -a, nor has europe-west1)."""
    world.add_region("us-east1", ["us-east1-b", "us-east1-c", "us-east1-d"])
    for metric, limit in [("CPUS", 24), ("INSTANCES", 10), ("IN_USE_ADDRESSES", 8), ("NVIDIA_L4_GPUS", 2)]:
        world.set_quota(metric, limit, 0, region="us-east1")
    world.offer("us-east1-c", "nvidia-l4", 8)
    return "us-east1"


def test_without_a_zone_the_first_zone_of_the_region_is_taken(gcp, east):
    report = preflight(gcp, east, None, None, 0, 4, False, 2)
    assert report.ok, report.problems
    assert report.zone == "us-east1-b"
    assert report.zones == ["us-east1-b", "us-east1-c", "us-east1-d"]


def test_without_a_zone_the_first_zone_that_offers_the_gpu_is_taken(gcp, east):
    report = preflight(gcp, east, None, "nvidia-l4", 2, 16, False, 2, machine_family="g2")
    assert report.ok, report.problems
    assert report.zone == "us-east1-c" and report.zones == ["us-east1-c"]


def test_without_a_zone_a_gpu_no_zone_offers_is_one_problem(gcp, world, east):
    world.set_quota("NVIDIA_T4_GPUS", 4, 0, region=east)
    report = preflight(gcp, east, None, "nvidia-tesla-t4", 1, 4, False, 1)
    assert report.problems == ["nvidia-tesla-t4 with 1 per VM is not offered in us-east1 (in none of its zones)"]
    assert report.zone == ""
