"""An IAP-only cluster (external_ip = false) needs no ssh_source_ranges: the plan module admits IAP's range
itself (infra/modules/plan/tests/network.tftest.hcl's iap_only run checks that side)."""

from __future__ import annotations

import pytest

from dtrain.common.errors import UserError
from dtrain.control.gcp.spec import gcp_spec, tfvars

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOCq6lYDCi2DbDjX7yU6Ac7nDnmrMYeBv3I2cLxGdGJk test"


def values(**table):
    s = gcp_spec("demo", {"backend": "gcp", "project": "proj-123456", **table}, "[clusters.demo]")
    return tfvars(s, project="proj-123456", zone="us-central1-a", ssh_public_key=KEY)


def test_iap_only_cluster_needs_no_source_ranges():
    v = values(external_ip=False)
    assert v["ssh_source_ranges"] == [] and v["iap_ssh"] is True and v["external_ip"] is False
    # ...and given ranges still pass through unchanged.
    assert values(external_ip=False, ssh_source_ranges=["203.0.113.7/32"])["ssh_source_ranges"] == ["203.0.113.7/32"]


def test_external_ips_still_need_a_range_and_the_message_names_both_ways():
    with pytest.raises(UserError) as e:
        values()
    assert "set ssh_source_ranges" in str(e.value) and "external_ip = false" in str(e.value)
    # external_ip = false without iap_ssh stays refused: nothing could reach the nodes.
    with pytest.raises(UserError, match="external_ip = false needs iap_ssh = true"):
        values(external_ip=False, iap_ssh=False)
