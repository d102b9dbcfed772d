"""The cluster service's custom role id (infra/iam.tf) against IAM's soft delete, as the fake serves it
(compute_fake.py: a deleted role's id is refused for 37 days). The id as infra/ builds it is rendered
from the HCL for two creations of the same cluster, each with the random suffix iam.tf's terraform_data
would draw; the id fixed by the cluster name alone, as it was, is refused 10 days after a `down`."""

from __future__ import annotations

import functools
import json
import re
import urllib.error
import urllib.request
import uuid

import pytest

from tests.infra.hcl import INFRA, PLAN, Module

from .conftest import PROJECT

CLUSTER = "demo"


def call(endpoint: str, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        endpoint + path, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def create(endpoint: str, role_id: str) -> tuple[int, dict]:
    body = {
        "roleId": role_id,
        "role": {"title": "dtrain demo cluster service", "includedPermissions": ["compute.instances.stop"]},
    }
    return call(endpoint, "POST", f"/v1/projects/{PROJECT}/roles", body)


def delete(endpoint: str, role_id: str) -> None:
    status, _ = call(endpoint, "DELETE", f"/v1/projects/{PROJECT}/roles/{role_id}")
    assert status == 200


@functools.cache
def role_id_parts() -> tuple[str, int]:
    """iam.tf's role_id template and its suffix's length in hex digits (python-hcl2 parses infra/ once)."""
    root = Module(INFRA)
    template = root.resource("google_project_iam_custom_role", "service")["role_id"]
    assert Module(PLAN).outputs["service_account_id"]["value"] == "${local.name_prefix}"
    drawn = root.resource("terraform_data", "service_role")["input"]
    assert drawn == '${substr(replace(uuid(), "-", ""), 0, 8)}', drawn
    return template, 8


def role_id_of_one_creation(cluster: str) -> str:
    """The role_id infra/iam.tf gives this cluster, with a fresh suffix as terraform_data draws it (the first
    hex digits of a UUID)."""
    template, digits = role_id_parts()
    expected = '${replace(module.plan.service_account_id, "-", "_")}_service_${terraform_data.service_role.output}'
    assert template == expected, f"iam.tf's role_id changed ({template}): update this rendering"
    account_id = f"dtrain-{cluster}"  # the plan module's name_prefix
    return f"{account_id.replace('-', '_')}_service_{uuid.uuid4().hex[:digits]}"


def test_a_fixed_role_id_is_refused_for_weeks_after_a_down(server, world):
    fixed = f"dtrain_{CLUSTER}_service"  # the id iam.tf derived from the name alone
    assert create(server.endpoint, fixed)[0] == 200
    delete(server.endpoint, fixed)  # dtrain down
    world.days_passed = 10  # past the undelete window, inside the purge
    status, body = create(server.endpoint, fixed)  # dtrain up again
    assert status == 400 and body["error"]["status"] == "FAILED_PRECONDITION", body
    assert "in a deleted state" in body["error"]["message"]
    status, body = call(server.endpoint, "POST", f"/v1/projects/{PROJECT}/roles/{fixed}:undelete")
    assert status == 400 and "cannot be undeleted" in body["error"]["message"]
    world.days_passed = 38  # purged: the id is free again
    assert create(server.endpoint, fixed)[0] == 200


@pytest.mark.parametrize("days_later", [1, 10, 36])
def test_the_id_infra_builds_is_new_for_each_creation(server, world, days_later):
    first = role_id_of_one_creation(CLUSTER)
    assert create(server.endpoint, first)[0] == 200  # dtrain up
    delete(server.endpoint, first)  # dtrain down: the role goes with the state (and the suffix)
    world.days_passed = days_later
    second = role_id_of_one_creation(CLUSTER)
    assert second != first and re.fullmatch(rf"dtrain_{CLUSTER}_service_[0-9a-f]{{8}}", second)
    status, body = create(server.endpoint, second)  # dtrain up again, with the same cluster name
    assert status == 200, body


def test_the_longest_cluster_name_gives_a_valid_role_id(server):
    # IAM role ids are at most 64 characters of [a-zA-Z0-9_.]; cluster names are at most 23 characters.
    longest = "a" * 23
    role_id = role_id_of_one_creation(longest)
    assert len(role_id) <= 64
    assert create(server.endpoint, role_id)[0] == 200
    status, body = create(server.endpoint, role_id + "-x")  # and the fake does check the pattern
    assert status == 400 and body["error"]["status"] == "INVALID_ARGUMENT"
