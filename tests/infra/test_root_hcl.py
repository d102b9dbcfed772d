"""Assertions on the root module's HCL for what only the Google provider could check.

No provider can be downloaded here, so `terraform validate/plan` cannot run on infra/ itself. These
tests parse it (python-hcl2) and check the wiring: that every security-relevant argument comes from
the plan module (whose values `terraform test` checks) or is the literal it must be. Each check is a
plain function over a parsed module, so test_checks_catch_mutations can run it on a broken copy and
see it fail.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from .hcl import INFRA, PLAN, Module, block

# Resource types of the root module that take labels, and those that do not (GCP has no labels on
# networks, subnets, firewalls, routers, service accounts or IAM bindings). A new resource type must
# be added to one of the two, which forces the labelling decision.
LABELLED = {"google_compute_instance", "google_storage_bucket", "google_artifact_registry_repository"}
UNLABELLED = {
    "google_compute_network",
    "google_compute_subnetwork",
    "google_compute_firewall",
    "google_compute_router",
    "google_compute_router_nat",
    "google_service_account",
    "google_storage_bucket_iam_member",
    "google_artifact_registry_repository_iam_member",
    "google_project_iam_member",
    "google_project_iam_custom_role",  # roles take no labels; it says its cluster in title and description
    "terraform_data",  # not a cloud resource: the custom role id's suffix, in the state only
}
TAG = "${module.plan.network_tag}"
IAP_RANGE = "35.235.240.0/20"
NODE_KEYS = {"name", "role", "internal_ip", "external_ip", "gpus", "accelerator", "machine_type", "instance_id"}
RECORD_KEYS = {"name", "project", "region", "zone", "bucket", "registry", "ssh_user", "slurm", "nodes"}
ROOT_ONLY_VARIABLES = {"force_destroy", "observability_roles", "adopt_bucket", "os_login", "slurm"}


@pytest.fixture(scope="module")
def root() -> Module:
    return Module(INFRA)


@pytest.fixture(scope="module")
def plan() -> Module:
    return Module(PLAN)


# --- checks (each raises AssertionError when the module is wrong) ---------------------------------


def check_ssh_firewall(root: Module, plan: Module) -> None:
    ssh = root.resource("google_compute_firewall", "ssh")
    assert ssh["direction"] == "INGRESS"
    assert ssh["source_ranges"] == "${module.plan.ssh_source_ranges}", ssh["source_ranges"]
    assert "source_tags" not in ssh and "source_service_accounts" not in ssh
    assert ssh["target_tags"] == [TAG]
    allows = ssh["allow"]
    assert allows == [{"protocol": "tcp", "ports": ["22"]}], allows
    assert block(ssh, "log_config")["metadata"] == "INCLUDE_ALL_METADATA"
    # ...and the plan module builds those sources from var.ssh_source_ranges and IAP's range only.
    assert plan.outputs["ssh_source_ranges"]["value"] == "${local.ssh_source_ranges}"
    assert plan.locals["iap_range"] == IAP_RANGE
    expected = "${distinct(concat(var.ssh_source_ranges, var.iap_ssh ? [local.iap_range] : []))}"
    assert plan.locals["ssh_source_ranges"] == expected, plan.locals["ssh_source_ranges"]


def check_internal_firewall(root: Module, plan: Module) -> None:
    rules = root.of_type("google_compute_firewall")
    assert set(rules) == {"ssh", "internal"}, f"only the SSH and the between-nodes rules may exist: {set(rules)}"
    internal = rules["internal"]
    assert internal["direction"] == "INGRESS"
    assert internal.get("source_tags") == [TAG] and internal.get("target_tags") == [TAG]
    assert "source_ranges" not in internal, "the between-nodes rule must match by tag, not by address"
    assert block(internal, "log_config")["metadata"] == "INCLUDE_ALL_METADATA"
    assert {a["protocol"] for a in internal["allow"]} == {"tcp", "udp", "icmp"}
    # No resource argument (comments aside) may open anything to the whole internet.
    everything = json.dumps([list(root.resources.values()), [v.get("default") for v in root.variables.values()]])
    assert "0.0.0.0/0" not in everything and "::/0" not in everything


def check_labels(root: Module, plan: Module) -> None:
    types = {t for t, _ in root.resources}
    assert not types - LABELLED - UNLABELLED, f"decide whether these take labels: {types - LABELLED - UNLABELLED}"
    assert root.locals["labels"] == "${module.plan.labels}"
    assert plan.locals["labels"] == '${merge(var.labels, {"dtrain-cluster" = var.cluster_name})}'
    for (rtype, name), body in root.resources.items():
        if rtype in LABELLED:
            labels = body.get("labels", "")
            assert "local.labels" in labels, f"{rtype}.{name} has no dtrain-cluster labels: {labels!r}"
    for name, node in root.of_type("google_compute_instance").items():
        disk = block(block(node, "boot_disk"), "initialize_params")
        assert disk.get("labels") == "${local.labels}", f"boot disk of {name} is not labelled"


def check_gpu_scheduling(root: Module, plan: Module) -> None:
    node = root.resource("google_compute_instance", "node")
    scheduling = block(node, "scheduling")
    fields = ["on_host_maintenance", "automatic_restart", "preemptible", "provisioning_model"]
    fields.append("instance_termination_action")
    for field in fields:
        # each node's block for its role: the master is on-demand unless master_spot
        assert scheduling.get(field) == f"${{module.plan.scheduling[each.value.role].{field}}}", f"scheduling.{field}"
    dynamics = {k: v for d in node["dynamic"] for k, v in d.items()}
    acc = dynamics["guest_accelerator"]
    assert acc["for_each"] == "${module.plan.guest_accelerators}"
    assert block(acc, "content") == {
        "type": "${guest_accelerator.value.type}",
        "count": "${guest_accelerator.value.count}",
    }
    # The values (terraform test checks them: tests/spot.tftest.hcl): TERMINATE for GPU or spot nodes,
    # SPOT with preemptible and no restart; a Spot master only with master_spot as well.
    assert plan.locals["role_spot"] == {"master": "${var.spot && var.master_spot}", "worker": "${var.spot}"}
    assert root.variables["master_spot"]["default"] is False


def check_service_account(root: Module, plan: Module) -> None:
    node = root.resource("google_compute_instance", "node")
    sa = block(node, "service_account")
    assert sa["email"] == "${google_service_account.node.email}", sa
    assert sa["scopes"] == ["cloud-platform"]
    assert root.resource("google_service_account", "node")["account_id"] == "${module.plan.service_account_id}"
    assert "developer.gserviceaccount.com" not in root.text
    member = "serviceAccount:${google_service_account.node.email}"
    bucket_iam = root.resource("google_storage_bucket_iam_member", "node_objects")
    assert bucket_iam == {
        "bucket": "${google_storage_bucket.checkpoints.name}",
        "role": "roles/storage.objectAdmin",
        "member": member,
    }
    ar_iam = root.resource("google_artifact_registry_repository_iam_member", "node_reader")
    assert ar_iam["role"] == "roles/artifactregistry.reader" and ar_iam["member"] == member
    assert ar_iam["repository"] == "${google_artifact_registry_repository.images.name}"
    for name, binding in root.of_type("google_project_iam_member").items():
        if name == "node_service":  # the cluster service's custom role, conditioned: check_service_role
            continue
        assert "var.observability_roles" in binding["for_each"], f"project-level grant {name} must be opt-in"
        assert (
            "roles/logging.logWriter" in binding["for_each"] and "roles/monitoring.metricWriter" in binding["for_each"]
        )
        assert not re.search(r"roles/(owner|editor|storage\.admin|iam\.)", binding["for_each"])


def check_service_role(root: Module, plan: Module) -> None:
    """The cluster service's grant: a custom role with only the instance and operation calls it makes,
    bound with a condition naming this cluster's VMs exactly."""
    role = root.resource("google_project_iam_custom_role", "service")
    assert sorted(role["permissions"]) == [
        "compute.instances.delete", "compute.instances.get", "compute.instances.list", "compute.instances.start",
        "compute.instances.stop", "compute.zoneOperations.get", "compute.zoneOperations.list",
    ]  # fmt: skip
    # A deleted role's id is refused for 37 days: the id carries a random suffix drawn once per creation
    # (kept in the state; a new cluster after `dtrain down` draws a new one), never the name alone.
    suffix = root.resource("terraform_data", "service_role")
    assert suffix["input"] == '${substr(replace(uuid(), "-", ""), 0, 8)}', suffix["input"]
    assert suffix["triggers_replace"] == ["${var.project_id}", "${var.cluster_name}"]
    assert block(suffix, "lifecycle")["ignore_changes"] == ["input"], "drawn once: a later plan keeps it"
    role_id = role["role_id"]
    assert role_id == (
        '${replace(module.plan.service_account_id, "-", "_")}_service_${terraform_data.service_role.output}'
    ), role_id
    # One binding per entry of the plan module's service_conditions (12 names each: IAM's 12-operator limit;
    # tests/iam.tftest.hcl counts them at 63 workers), each naming the VMs exactly.
    binding = root.resource("google_project_iam_member", "node_service")
    assert binding["for_each"] == "${module.plan.service_conditions}", binding.get("for_each")
    assert binding["role"] == "${google_project_iam_custom_role.service.name}"
    assert binding["member"] == "serviceAccount:${google_service_account.node.email}"
    assert block(binding, "condition")["expression"] == "${each.value}"
    assert plan.locals["service_names_per_binding"] == 12
    expression = plan.locals["service_conditions"]
    assert 'resource.type != \\"compute.googleapis.com/Instance\\"' in expression, expression
    assert "chunklist(local.node_names, local.service_names_per_binding)" in expression
    assert 'resource.name == \\"projects/${var.project_id}/zones/${var.zone}/instances/${name}' in expression
    assert "startsWith" not in expression  # a prefix would reach other clusters' VMs (demo -> demo-2)


def check_ssh_metadata(root: Module, plan: Module) -> None:
    metadata = root.resource("google_compute_instance", "node")["metadata"]
    assert metadata["block-project-ssh-keys"] is True
    # The cluster's key in metadata and OS Login off, unless os_login: then the key is on the user's
    # OS Login profile and sshd would ignore metadata keys anyway.
    assert metadata["ssh-keys"] == '${var.os_login ? "" : "${var.ssh_user}:${trimspace(var.ssh_public_key)}"}'
    assert metadata["enable-oslogin"] == '${var.os_login ? "TRUE" : "FALSE"}'
    assert root.variables["os_login"]["default"] is False
    assert metadata["enable-guest-attributes"] == "TRUE"
    assert metadata["startup-script"] == '${file("${path.module}/node-startup.sh")}'
    assert (root.directory / "node-startup.sh").is_file(), "infra/ must hold its startup script (self-contained)"


def check_shielded_vm(root: Module, plan: Module) -> None:
    shielded = block(root.resource("google_compute_instance", "node"), "shielded_instance_config")
    assert shielded == {
        "enable_secure_boot": "${module.plan.secure_boot}",
        "enable_vtpm": True,
        "enable_integrity_monitoring": True,
    }


def check_bucket(root: Module, plan: Module) -> None:
    bucket = root.resource("google_storage_bucket", "checkpoints")
    assert bucket["uniform_bucket_level_access"] is True
    assert bucket["public_access_prevention"] == "enforced"
    assert block(bucket, "versioning")["enabled"] is True
    # Soft delete off: versioning keeps deleted checkpoints for bucket_lifecycle_days already, and GCS's
    # default 7-day soft delete would bill every copy the lifecycle rules delete for 7 days more.
    assert block(bucket, "soft_delete_policy") == {"retention_duration_seconds": 0}
    assert bucket["force_destroy"] == "${var.force_destroy}"
    assert root.variables["force_destroy"]["default"] is False
    rules = bucket["lifecycle_rule"]
    noncurrent = [r for r in rules if "days_since_noncurrent_time" in block(r, "condition")]
    everything = [r for r in noncurrent if "matches_suffix" not in block(r, "condition")]
    assert len(everything) == 1 and block(everything[0], "action") == {"type": "Delete"}
    assert block(everything[0], "condition")["days_since_noncurrent_time"] == "${var.bucket_lifecycle_days}"
    # The appended files' noncurrent copies (one per compose) go after a day; only those, and never a
    # live object: the rule is on ARCHIVED versions with the appended files' suffixes only.
    appended = [r for r in noncurrent if "matches_suffix" in block(r, "condition")]
    assert len(appended) == 1 and block(appended[0], "action") == {"type": "Delete"}, appended
    condition = block(appended[0], "condition")
    assert condition["days_since_noncurrent_time"] == 1 and condition["with_state"] == "ARCHIVED", condition
    assert set(condition["matches_suffix"]) == {"metrics.jsonl", "events.jsonl", ".log"}, condition
    for rule in rules:  # nothing else may delete: checkpoints and final models are what the bucket is for
        if block(rule, "action")["type"] == "Delete":
            assert block(rule, "condition").get("with_state") == "ARCHIVED", rule
    assert bucket["name"] == "${module.plan.bucket_name}"
    # A bucket `dtrain down` kept is imported (adopted) when adopt_bucket, never created again.
    assert root.imports == [
        {
            "for_each": "${var.adopt_bucket ? toset([module.plan.bucket_name]) : toset([])}",
            "to": "${google_storage_bucket.checkpoints}",
            "id": "${each.value}",
        }
    ], root.imports
    assert root.variables["adopt_bucket"]["default"] is False


def check_network(root: Module, plan: Module) -> None:
    network = root.resource("google_compute_network", "cluster")
    assert network["auto_create_subnetworks"] is False
    subnet = root.resource("google_compute_subnetwork", "cluster")
    assert subnet["private_ip_google_access"] is True
    assert subnet["ip_cidr_range"] == "${var.subnet_cidr}"
    node = root.resource("google_compute_instance", "node")
    assert node["tags"] == [TAG]
    assert block(node, "network_interface")["subnetwork"] == "${google_compute_subnetwork.cluster.id}"


def check_cluster_output(root: Module, plan: Module) -> None:
    value = root.outputs["cluster"]["value"]
    assert set(value) == RECORD_KEYS, set(value)
    assert value["bucket"] == "gs://${google_storage_bucket.checkpoints.name}"
    assert value["registry"].startswith("${local.registry_host}/${var.project_id}/")
    nodes = value["nodes"]
    assert nodes.startswith("${[for name in module.plan.node_names :"), "nodes must follow node_names (master first)"
    keys = set(re.findall(r"([a-z_]+)\s*=", nodes))
    assert keys == NODE_KEYS, keys
    assert 'access_config[0].nat_ip, "")' in nodes, 'external_ip must be "" without an access config'
    assert root.locals["registry_host"] == "${var.region}-docker.pkg.dev"


CHECKS = [
    check_ssh_firewall,
    check_internal_firewall,
    check_labels,
    check_gpu_scheduling,
    check_service_account,
    check_service_role,
    check_ssh_metadata,
    check_shielded_vm,
    check_bucket,
    check_network,
    check_cluster_output,
]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_root_module(check, root: Module, plan: Module):
    check(root, plan)


def test_record_fields_match_cli(root: Module):
    # The CLI's validator (dtrain.control.gcp.record) must accept what the output produces.
    record = pytest.importorskip("dtrain.control.gcp.record", reason="needs dtrain installed (pip install -e .)")
    assert set(record.RECORD_FIELDS) <= RECORD_KEYS
    assert set(record.NODE_FIELDS) <= NODE_KEYS


def test_versions(root: Module):
    terraform = root.terraform[0]
    assert terraform["required_version"] == ">= 1.11"
    google = terraform["required_providers"][0]["google"]
    assert google["source"] == "hashicorp/google"
    assert re.fullmatch(r"~> \d+\.0", google["version"]), "pin the google provider to one major version"
    assert set(terraform["required_providers"][0]) == {"google"}, "one provider to download (registries vary)"
    assert terraform["backend"] == [{"gcs": {}}], "the backend must be a partial gcs configuration"


def test_variables_typed_described_and_passed(root: Module, plan: Module):
    for module in (root, plan):
        for name, var in module.variables.items():
            assert var.get("type") and var.get("description"), f"{module.directory}: variable {name}"
    shared = set(root.variables) - ROOT_ONLY_VARIABLES
    assert shared == set(plan.variables), shared ^ set(plan.variables)
    args = {k: v for k, v in root.modules["plan"].items() if k != "source"}
    assert args == {name: f"${{var.{name}}}" for name in shared}, "pass every variable to the plan module unchanged"
    for name in shared:
        r, p = root.variables[name], plan.variables[name]
        assert r["type"] == p["type"], name
        plan_conditions = {v["condition"] for v in p.get("validation", [])}
        for v in r.get("validation", []):
            assert v["condition"] in plan_conditions, f"root validation of {name} is not tested in the plan module"
        if "validation" in p:
            assert "validation" in r, f"{name} is validated in the plan module but not in the root"


def test_checkov_skips_have_reasons(root: Module):
    skips = re.findall(r"#checkov:skip=([A-Z0-9_]+)(?::(.*))?", root.text)
    assert skips, "expected the documented inline skips"
    for check_id, reason in skips:
        assert reason and len(reason.strip()) > 20, f"checkov skip {check_id} needs a reason"


MUTATIONS = [
    (
        "network.tf",
        "source_ranges = module.plan.ssh_source_ranges",
        'source_ranges = ["0.0.0.0/0"]',
        check_ssh_firewall,
    ),
    (
        "network.tf",
        "source_tags = [module.plan.network_tag]",
        'source_ranges = ["10.0.0.0/8"]',
        check_internal_firewall,
    ),
    ("storage.tf", "  labels        = local.labels\n\n  uniform", "\n  uniform", check_labels),
    ("compute.tf", '"block-project-ssh-keys" = true', '"block-project-ssh-keys" = false', check_ssh_metadata),
    (
        "compute.tf",
        'file("${path.module}/node-startup.sh")',
        'file("${path.module}/../docker/node-startup.sh")',
        check_ssh_metadata,
    ),
    (
        "compute.tf",
        "email  = google_service_account.node.email",
        'email  = "123-compute@developer.gserviceaccount.com"',
        check_service_account,
    ),
    (
        "compute.tf",
        "on_host_maintenance         = module.plan",
        'on_host_maintenance         = "MIGRATE"\n    x = module.plan',
        check_gpu_scheduling,
    ),
    (
        "compute.tf",
        "provisioning_model          = module.plan.scheduling[each.value.role]",
        'provisioning_model          = module.plan.scheduling["worker"]',
        check_gpu_scheduling,
    ),
    (
        "storage.tf",
        "to       = google_storage_bucket.checkpoints",
        "to       = google_storage_bucket.other",
        check_bucket,
    ),
    (
        "storage.tf",
        'matches_suffix             = ["metrics.jsonl", "events.jsonl", ".log"]',
        'matches_suffix             = ["metrics.jsonl", "events.jsonl", ".log", ".pt"]',
        check_bucket,
    ),
    (
        "storage.tf",
        'days_since_noncurrent_time = 1\n      with_state                 = "ARCHIVED"',
        'days_since_noncurrent_time = 1\n      with_state                 = "ANY"',
        check_bucket,
    ),
    (
        "storage.tf",
        "retention_duration_seconds = 0",
        "retention_duration_seconds = 604800",
        check_bucket,
    ),
    (
        "storage.tf",
        'public_access_prevention    = "enforced"',
        'public_access_prevention    = "inherited"',
        check_bucket,
    ),
    (
        "iam.tf",
        '"compute.instances.stop",',
        '"compute.instances.stop",\n    "compute.instances.setMetadata",',
        check_service_role,
    ),  # fmt: skip
    (
        "iam.tf",
        "expression  = each.value",
        'expression  = "resource.name.startsWith(\\"projects/\\")"',
        check_service_role,
    ),
    (
        "iam.tf",
        "_service_${terraform_data.service_role.output}",
        "_service",
        check_service_role,
    ),  # the role id fixed by the cluster name again
]


@pytest.mark.parametrize("filename,old,new,check", MUTATIONS, ids=[m[3].__name__ + "-" + m[0] for m in MUTATIONS])
def test_checks_catch_mutations(tmp_path: Path, plan: Module, filename: str, old: str, new: str, check):
    copy = tmp_path / "infra"
    shutil.copytree(INFRA, copy, ignore=shutil.ignore_patterns(".terraform", "modules"))
    path = copy / filename
    text = path.read_text()
    assert old in text, f"mutation target {old!r} not found in {filename}; update the test"
    path.write_text(text.replace(old, new, 1))
    check(Module(INFRA), plan)  # the original passes...
    with pytest.raises(AssertionError):
        check(Module(copy), plan)  # ...the mutated copy does not
