"""Preflight checks every permission `dtrain up` needs (issue 31, A.2), in one testIamPermissions call
answered by the Compute fake by member, and names all the missing ones with their roles in one line.
Before, it asked only for iam.roles.create: an Editor who followed its advice still failed halfway
through `terraform apply`, with resources already created."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dtrain.control.gcp import permissions
from dtrain.control.gcp.preflight import PreflightReport

from .conftest import REGION

ZONE = f"{REGION}-a"
INFRA = Path(__file__).resolve().parents[2] / "infra"

# What the issue found an Editor lacks, plus the custom role's create (roles/iam.roleAdmin).
EDITOR_LACKS = (
    "resourcemanager.projects.setIamPolicy",
    "storage.buckets.setIamPolicy",
    "artifactregistry.repositories.setIamPolicy",
    "iam.serviceAccounts.create",
    "iam.serviceAccounts.actAs",
    "iam.roles.create",
)

# One permission each resource type of infra/*.tf needs to be created: the list must cover every type.
CREATES = {
    "google_compute_network": "compute.networks.create",
    "google_compute_subnetwork": "compute.subnetworks.create",
    "google_compute_firewall": "compute.firewalls.create",
    "google_compute_router": "compute.routers.create",
    "google_compute_router_nat": "compute.routers.update",
    "google_compute_instance": "compute.instances.create",
    "google_service_account": "iam.serviceAccounts.create",
    "google_project_iam_custom_role": "iam.roles.create",
    "google_project_iam_member": "resourcemanager.projects.setIamPolicy",
    "google_storage_bucket": "storage.buckets.create",
    "google_storage_bucket_iam_member": "storage.buckets.setIamPolicy",
    "google_artifact_registry_repository": "artifactregistry.repositories.create",
    "google_artifact_registry_repository_iam_member": "artifactregistry.repositories.setIamPolicy",
}


def test_the_list_covers_every_resource_infra_creates():
    types = set()
    for tf in INFRA.glob("*.tf"):
        types |= set(re.findall(r'^resource "(google_[a-z0-9_]+)"', tf.read_text(), re.M))
    assert types and types <= set(CREATES), sorted(types - set(CREATES))
    listed = {p for g in permissions.UP_PERMISSIONS for p in g.permissions}
    assert {CREATES[t] for t in types} <= listed
    assert set(EDITOR_LACKS) <= listed


@pytest.fixture
def ctx(cluster_ctx):
    return cluster_ctx()


def access_problems(ctx) -> list[str]:
    from dtrain.control.gcp import lifecycle

    report = PreflightReport(project=ctx.project, region=REGION, zone=ZONE, accelerator=None)
    derived = {"node_names": ["demo-master", "demo-worker-0"], "nat": False}
    lifecycle._access_check(ctx, report, derived)
    return report.problems


def test_an_editor_without_the_iam_admin_permissions_is_told_everything_in_one_line(ctx, world):
    world.grant("user:editor@example.com", but=EDITOR_LACKS)
    world.grant("user:owner@example.com")  # everything
    world.identity = "editor@example.com"
    problems = access_problems(ctx)
    assert len(problems) == 1, problems
    line = problems[0]
    assert line.startswith("you lack 6 permissions on project dtrain-test that dtrain up needs (")
    for permission in EDITOR_LACKS:
        assert permission in line
    for role in ("roles/resourcemanager.projectIamAdmin", "roles/storage.admin", "roles/artifactregistry.admin",
                 "roles/iam.serviceAccountAdmin", "roles/iam.serviceAccountUser", "roles/iam.roleAdmin"):  # fmt: skip
        assert role in line
    assert "resourcemanager.projects.setIamPolicy for the project-level grants (infra/iam.tf)" in line
    assert line.endswith(
        "(gcloud projects add-iam-policy-binding dtrain-test --member=user:YOU --role=ROLE, once per role)"
    )
    # One call asked for all of them; what came back depended on who asked.
    asked = [m for m, p, _ in world.requests if p.endswith(":testIamPermissions")]
    assert len(asked) == 1
    world.identity = "owner@example.com"
    assert access_problems(ctx) == []


def test_one_missing_permission_names_its_role_and_purpose(ctx, world):
    world.grant("user:dev@example.com", but={"storage.buckets.setIamPolicy"})
    assert access_problems(ctx) == [
        "you lack storage.buckets.setIamPolicy on project dtrain-test, which the checkpoint bucket and its grant "
        "(infra/storage.tf, infra/iam.tf) needs: ask for roles/storage.admin (gcloud projects "
        "add-iam-policy-binding dtrain-test --member=user:YOU --role=roles/storage.admin)"
    ]


def test_the_groups_follow_the_cluster_settings():
    def perms(**kw) -> set[str]:
        return {p for g in permissions.up_permissions(**kw) for p in g.permissions}

    with_ip = perms(nat=False, external_ip=True, os_login=False)
    without = perms(nat=True, external_ip=False, os_login=True)
    assert "compute.subnetworks.useExternalIp" in with_ip - without
    assert {"compute.routers.create", "iap.tunnelInstances.accessViaIAP", "compute.instances.osAdminLogin"} <= (
        without - with_ip
    )
    assert len(with_ip | without) < 100  # one testIamPermissions request
