"""instances.start against the Compute fake where the fake must behave as Compute does (issue 31, A.9): a
start of a running VM is a no-op, and a stockout comes as ZONE_RESOURCE_POOL_EXHAUSTED or as
ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS, both read as a stockout by every place that classifies one
(errors.is_stockout: instances, the Terraform diagnostics, the cluster service)."""

from __future__ import annotations

import pytest

from dtrain.control.gcp import instances
from dtrain.control.gcp.errors import is_stockout

from .conftest import REGION

ZONE = f"{REGION}-a"
STOCKOUTS = ("ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS")


def test_starting_a_running_vm_changes_nothing(gcp, world):
    # Compute's instances.start on a RUNNING instance is a no-op operation: the VM keeps its last start
    # (which preemption detection compares with the preempted operation), nothing boots again, and a
    # refusal the test set up is not spent on it.
    world.polls_to_finish = 1
    world.add_instance(ZONE, "w", last_start="2025-01-01T00:00:00.000-08:00")
    hooked: list[str] = []
    world.on_start = lambda zone, name: hooked.append(name)
    world.refuse_starts(1)
    instances.start(gcp, ZONE, "w")
    inst = world.instances[(ZONE, "w")]
    assert inst["status"] == "RUNNING"
    assert inst["lastStartTimestamp"] == "2025-01-01T00:00:00.000-08:00"
    assert hooked == [] and world.start_refusals[None] == 1
    # The refusal is still there for the next start of a stopped VM.
    inst["status"] = "TERMINATED"
    with pytest.raises(instances.NoCapacity):
        instances.start(gcp, ZONE, "w")


@pytest.mark.parametrize("code", STOCKOUTS)
def test_both_stockout_codes_are_no_capacity(gcp, world, code):
    world.polls_to_finish = 1
    world.add_instance(ZONE, "w", status="TERMINATED", spot=True)
    world.refuse_starts(1, code=code)
    with pytest.raises(instances.NoCapacity) as e:
        instances.start(gcp, ZONE, "w")
    assert "does not have enough resources available" in str(e.value)
    ops = [s["op"] for s in world.operations.values() if s["op"].get("error")]
    assert [op["error"]["errors"][0]["code"] for op in ops] == [code]
    assert ops[0]["httpErrorStatusCode"] == 503
    instances.start(gcp, ZONE, "w")  # capacity is back
    assert world.instances[(ZONE, "w")]["status"] == "RUNNING"


def test_a_quota_refusal_is_not_a_stockout(gcp, world):
    world.polls_to_finish = 1
    world.add_instance(ZONE, "w", status="TERMINATED", spot=True)
    world.refuse_starts(1, code="QUOTA_EXCEEDED")
    with pytest.raises(instances.OperationFailed) as e:
        instances.start(gcp, ZONE, "w")
    assert str(e.value).startswith("QUOTA_EXCEEDED: Quota 'PREEMPTIBLE_CPUS' exceeded.")


@pytest.mark.parametrize("code", STOCKOUTS)
def test_terraform_diagnostics_of_either_stockout_say_zone_exhausted(code):
    from dtrain.control.gcp.terraform import explain

    text = f"Error: Error waiting for instance to create: The zone 'projects/p/zones/us-central1-a' has no room: {code}"
    assert explain([text], {"zone": "us-central1-a"}).kind == "zone_exhausted"


def test_is_stockout_reads_codes_and_words_and_nothing_else():
    for code in STOCKOUTS:
        assert is_stockout(code, "")
        assert is_stockout(message=f"operation failed: {code}: try later")
    assert is_stockout(message="The zone 'z' does not have enough resources available to fulfill the request.")
    assert not is_stockout("QUOTA_EXCEEDED", "Quota 'CPUS' exceeded.")
    assert not is_stockout(message="ZONE_RESOURCE_POOL_EXHAUSTED_SOMETHING_ELSE")
