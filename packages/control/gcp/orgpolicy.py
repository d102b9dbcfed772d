"""The organisation policies preflight reads (OS Login required, external IPs denied, Shielded VMs
required): the policy in force on the project for a constraint, and what it says."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dtrain.control.gcp.client import Gcp

REQUIRE_OS_LOGIN = "constraints/compute.requireOsLogin"
EXTERNAL_IP_ACCESS = "constraints/compute.vmExternalIpAccess"
# Enforced, it refuses new VMs without Secure Boot, vTPM and integrity monitoring
# (https://cloud.google.com/resource-manager/docs/organization-policy/org-policy-constraints).
REQUIRE_SHIELDED_VM = "constraints/compute.requireShieldedVm"


def effective_policy(gcp: Gcp, constraint: str) -> dict[str, Any]:
    """The organisation policy in force on the project for `constraint` (Resource Manager v1
    projects.getEffectiveOrgPolicy: the project's, its folders' and its organisation's merged). Needs
    orgpolicy.policy.get; a project outside any organisation answers with the constraint's default."""
    with gcp.errors(f"reading the organisation policy {constraint}"):
        return gcp.rest(
            "cloudresourcemanager",
            "POST",
            f"/v1/projects/{gcp.project}:getEffectiveOrgPolicy",
            json={"constraint": constraint},
        )


def enforced(policy: dict[str, Any]) -> bool:
    """Whether a boolean constraint's policy is on."""
    return bool((policy.get("booleanPolicy") or {}).get("enforced"))


def external_ip_denied(policy: dict[str, Any], project: str, zone: str, names: Iterable[str]) -> list[str]:
    """Which of the VMs `names` (in `zone`) constraints/compute.vmExternalIpAccess denies an external IP.
    Its values are instance paths, projects/P/zones/Z/instances/N; all values allowed when no list
    policy is set (the constraint's default)."""
    listed = policy.get("listPolicy") or {}

    def values(key: str) -> set[str]:
        return {v.removeprefix("is:") for v in listed.get(key) or []}

    allowed, denied, everything = values("allowedValues"), values("deniedValues"), listed.get("allValues")
    out = []
    for name in names:
        path = f"projects/{project}/zones/{zone}/instances/{name}"
        if everything == "ALLOW":
            continue
        if everything == "DENY" or path in denied or (allowed and path not in allowed):
            out.append(name)
    return out
