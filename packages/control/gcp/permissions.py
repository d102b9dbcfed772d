"""The IAM permissions `dtrain up` needs on the project, grouped by what needs them with the role that
grants each group, and the one preflight call that finds which the caller lacks."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from dtrain.control.gcp.client import Gcp


# Every permission `dtrain up` needs on the project, by what needs it (infra/*.tf, and how dtrain logs in),
# with the predefined role that grants the group: preflight asks for them all in one Resource Manager
# projects.testIamPermissions call (https://cloud.google.com/resource-manager/reference/rest/v1/projects/testIamPermissions)
# and names every missing one, with its role, in one line, before anything is created. Roles: the
# predefined roles reference, https://cloud.google.com/iam/docs/understanding-roles. `when` names the
# condition under which a group is needed ("" always; "nat": nodes without external IPs; "external_ip";
# "os_login"); preflight_permissions() picks the groups.
@dataclasses.dataclass(frozen=True)
class PermissionGroup:
    what: str  # what needs them, as the error line says it
    role: str  # the predefined role that grants them
    permissions: tuple[str, ...]
    when: str = ""


UP_PERMISSIONS = (
    # infra/network.tf: the cluster's VPC network and subnetwork.
    PermissionGroup(
        "the cluster's network (infra/network.tf)",
        "roles/compute.networkAdmin",
        (
            "compute.networks.create",
            "compute.networks.get",
            "compute.networks.delete",
            "compute.subnetworks.create",
            "compute.subnetworks.get",
            "compute.subnetworks.delete",
        ),
    ),  # fmt: skip
    # infra/network.tf: Cloud Router and NAT for nodes without external IPs (the NAT is a router update).
    PermissionGroup(
        "Cloud NAT for nodes without external IPs (infra/network.tf)",
        "roles/compute.networkAdmin",
        ("compute.routers.create", "compute.routers.get", "compute.routers.update", "compute.routers.delete"),
        when="nat",
    ),
    # infra/network.tf: the SSH and internal firewall rules (a rule on a network also needs updatePolicy on it).
    PermissionGroup(
        "the cluster's firewall rules (infra/network.tf)",
        "roles/compute.securityAdmin",
        (
            "compute.firewalls.create",
            "compute.firewalls.get",
            "compute.firewalls.delete",
            "compute.networks.updatePolicy",
        ),
    ),  # fmt: skip
    # infra/compute.tf: the VMs, their boot disks, metadata, labels, tags and service account, on the subnetwork.
    PermissionGroup(
        "the VMs (infra/compute.tf)",
        "roles/compute.instanceAdmin.v1",
        (
            "compute.instances.create",
            "compute.instances.get",
            "compute.instances.delete",
            "compute.instances.setMetadata",
            "compute.instances.setLabels",
            "compute.instances.setTags",
            "compute.instances.setServiceAccount",
            "compute.instances.start",
            "compute.instances.stop",
            "compute.disks.create",
            "compute.disks.setLabels",
            "compute.subnetworks.use",
        ),
    ),  # fmt: skip
    PermissionGroup(
        "the VMs' external IPs (infra/compute.tf)",
        "roles/compute.instanceAdmin.v1",
        ("compute.subnetworks.useExternalIp",),
        when="external_ip",
    ),
    # infra/compute.tf: a VM that runs as the nodes' service account needs actAs on it.
    PermissionGroup(
        "running the VMs as the nodes' service account (infra/compute.tf)",
        "roles/iam.serviceAccountUser",
        ("iam.serviceAccounts.actAs",),
    ),
    # infra/iam.tf: google_service_account.node.
    PermissionGroup(
        "the nodes' service account (infra/iam.tf)",
        "roles/iam.serviceAccountAdmin",
        ("iam.serviceAccounts.create", "iam.serviceAccounts.get", "iam.serviceAccounts.delete"),
    ),
    # infra/iam.tf: google_project_iam_custom_role.service.
    PermissionGroup(
        "the cluster service's custom role (infra/iam.tf)",
        "roles/iam.roleAdmin",
        ("iam.roles.create", "iam.roles.get", "iam.roles.delete", "iam.roles.undelete"),
    ),
    # infra/iam.tf: google_project_iam_member (the service role's bindings, the observability roles).
    PermissionGroup(
        "the project-level grants (infra/iam.tf)",
        "roles/resourcemanager.projectIamAdmin",
        ("resourcemanager.projects.getIamPolicy", "resourcemanager.projects.setIamPolicy"),
    ),
    # infra/storage.tf and infra/iam.tf: the checkpoint bucket and the nodes' grant on it.
    PermissionGroup(
        "the checkpoint bucket and its grant (infra/storage.tf, infra/iam.tf)",
        "roles/storage.admin",
        (
            "storage.buckets.create",
            "storage.buckets.get",
            "storage.buckets.update",
            "storage.buckets.delete",
            "storage.buckets.getIamPolicy",
            "storage.buckets.setIamPolicy",
        ),
    ),  # fmt: skip
    # infra/storage.tf and infra/iam.tf: the image repository and the nodes' read grant on it.
    PermissionGroup(
        "the image repository and its grant (infra/storage.tf, infra/iam.tf)",
        "roles/artifactregistry.admin",
        (
            "artifactregistry.repositories.create",
            "artifactregistry.repositories.get",
            "artifactregistry.repositories.delete",
            "artifactregistry.repositories.getIamPolicy",
            "artifactregistry.repositories.setIamPolicy",
        ),
    ),  # fmt: skip
    # Logging in: OS Login with sudo (which `sudo docker` needs), and IAP TCP forwarding without external IPs.
    PermissionGroup(
        "logging in to the nodes", "roles/compute.osAdminLogin", ("compute.instances.osAdminLogin",), when="os_login"
    ),
    PermissionGroup(
        "logging in to the nodes",
        "roles/iap.tunnelResourceAccessor",
        ("iap.tunnelInstances.accessViaIAP",),
        when="nat",
    ),  # fmt: skip
)


def up_permissions(*, nat: bool, external_ip: bool, os_login: bool) -> list[PermissionGroup]:
    """The groups of UP_PERMISSIONS a cluster with these settings needs."""
    on = {"": True, "nat": nat, "external_ip": external_ip, "os_login": os_login}
    return [g for g in UP_PERMISSIONS if on[g.when]]


def missing_permissions_line(project: str, groups: Iterable[PermissionGroup], missing: Iterable[str]) -> str:
    """The one line that names every missing permission, what needs it and the roles that grant them."""
    missing = set(missing)
    lacking = [(g, [p for p in g.permissions if p in missing]) for g in groups]
    lacking = [(g, perms) for g, perms in lacking if perms]
    roles = list(dict.fromkeys(g.role for g, _ in lacking))
    binding = f"gcloud projects add-iam-policy-binding {project} --member=user:YOU --role="
    if len(lacking) == 1 and len(lacking[0][1]) == 1:
        (group, (permission,)) = lacking[0]
        return (
            f"you lack {permission} on project {project}, which {group.what} needs: ask for {group.role} "
            f"({binding}{group.role})"
        )
    count = sum(len(perms) for _, perms in lacking)
    parts = "; ".join(f"{', '.join(perms)} for {g.what}" for g, perms in lacking)
    return (
        f"you lack {count} permissions on project {project} that dtrain up needs ({parts}): ask for "
        f"{', '.join(roles)} ({binding}ROLE, once per role)"
    )


def missing_permissions(gcp: Gcp, permissions: Iterable[str]) -> list[str]:
    """Which of `permissions` the caller lacks on the project (Resource Manager testIamPermissions)."""
    wanted = list(permissions)
    if not wanted:
        return []
    with gcp.errors("checking your permissions on the project"):
        body = gcp.rest(
            "cloudresourcemanager",
            "POST",
            f"/v1/projects/{gcp.project}:testIamPermissions",
            json={"permissions": wanted},
        )
    held = set(body.get("permissions") or [])
    return [p for p in wanted if p not in held]
