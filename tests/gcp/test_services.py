"""Which of the APIs a cluster needs are enabled: Service Usage, against the fake (compute_fake.py)."""

from __future__ import annotations

import pytest

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.gcp.errors import enable_hint
from dtrain.control.gcp.preflight import REQUIRED_SERVICES, disabled_services

from .compute_fake import service_disabled
from .conftest import PROJECT


def test_all_enabled_in_one_call(gcp, world):
    assert disabled_services(gcp, REQUIRED_SERVICES) == []
    assert world.called("GET", r"/v1/projects/dtrain-test/services:batchGet$") == 1
    (query,) = [q for m, p, q in world.requests if p.endswith(":batchGet")]
    assert query["names"] == [f"projects/{PROJECT}/services/{s}" for s in REQUIRED_SERVICES]


def test_the_disabled_ones_in_order_with_the_command_that_enables_them(gcp, world):
    world.disabled_services = {"iam.googleapis.com", "artifactregistry.googleapis.com"}
    off = disabled_services(gcp, REQUIRED_SERVICES)
    assert off == ["artifactregistry.googleapis.com", "iam.googleapis.com"]
    assert enable_hint(PROJECT, off) == (
        "Artifact Registry API, IAM API are not enabled in project dtrain-test: "
        "gcloud services enable artifactregistry.googleapis.com iam.googleapis.com --project dtrain-test"
    )
    assert enable_hint(PROJECT, off[:1]).startswith("Artifact Registry API is not enabled")


def test_service_usage_itself_disabled_is_one_line(gcp, world):
    body = service_disabled(PROJECT, service="serviceusage.googleapis.com", title="Service Usage API")
    world.fail("GET", r"services:batchGet$", body)
    with pytest.raises(UserError) as e:
        disabled_services(gcp, REQUIRED_SERVICES)
    assert str(e.value) == (
        "Service Usage API is not enabled in project dtrain-test: "
        "gcloud services enable serviceusage.googleapis.com --project dtrain-test"
    )
    assert e.value.exit_code == ExitCode.USAGE


def test_no_permission_to_read_them_names_the_role(gcp, world):
    from .compute_fake import permission_denied

    world.fail("GET", r"services:batchGet$", permission_denied("serviceusage.services.get", f"projects/{PROJECT}"))
    with pytest.raises(UserError) as e:
        disabled_services(gcp, REQUIRED_SERVICES)
    assert str(e.value).startswith(
        "checking which APIs the project has enabled: permission serviceusage.services.get denied in project "
        "dtrain-test: ask for roles/serviceusage.serviceUsageConsumer"
    )


def test_resource_manager_is_required_and_named_before_anything_is_created(gcp, world):
    # The project IAM grants (infra/iam.tf) and preflight's permission check go through the Resource
    # Manager API: with it off, the fake refuses testIamPermissions as Google does, and the services
    # check names the API with the command that enables it.
    from dtrain.control.gcp.permissions import missing_permissions

    assert "cloudresourcemanager.googleapis.com" in REQUIRED_SERVICES
    world.disabled_services = {"cloudresourcemanager.googleapis.com"}
    with pytest.raises(UserError, match="Cloud Resource Manager API"):
        missing_permissions(gcp, ["iam.roles.create"])
    off = disabled_services(gcp, REQUIRED_SERVICES)
    assert off == ["cloudresourcemanager.googleapis.com"]
    assert enable_hint(PROJECT, off) == (
        "Cloud Resource Manager API is not enabled in project dtrain-test: "
        "gcloud services enable cloudresourcemanager.googleapis.com --project dtrain-test"
    )
