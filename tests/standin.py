"""A stand-in for infra/ that Terraform can apply here (no google provider can be downloaded), for
the tests of `dtrain up` / `dtrain down` (tests/cloud, tests/cluster/test_gcp_lifecycle.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A two-node CPU cluster in the project the fakes serve, with its state in bucket {state}.
CPU_TABLE = """
[clusters.demo]
backend = "gcp"
project = "dtrain-test"
zone = "us-central1-a"
workers = 1
ssh_source_ranges = ["203.0.113.7/32"]
state_bucket = "{state}"
"""


def fake_env(
    cwd: Path, home: Path, *, compute: str | None, storage: str | None, infra: Path | None = None
) -> dict[str, str]:
    """The environment to run the CLI in against the fakes: the Compute fake at `compute` (which answers
    Service Usage, Resource Manager, OS Login and userinfo too) and the storage emulator at `storage`
    (None: Google's own endpoints), infra/ at `infra` (None: dtrain's own), config and cache under
    `cwd`, and nothing of this machine's Google credentials or project."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRAIN_")}
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT"):
        env.pop(name, None)
    env.update(
        DTRAIN_OFFLINE="1",
        XDG_CONFIG_HOME=str(cwd / "config"),
        XDG_CACHE_HOME=str(cwd / "cache"),
        HOME=str(home),  # no gcloud ADC file
        NO_GCE_CHECK="True",  # google-auth: do not probe the GCE metadata server
        COLUMNS="200",
    )
    if infra is not None:
        env["DTRAIN_INFRA_DIR"] = str(infra)
    if compute is not None:
        env["DTRAIN_GCP_COMPUTE_ENDPOINT"] = env["DTRAIN_GCP_API_ENDPOINT"] = compute
    if storage is not None:
        env["DTRAIN_GCP_STORAGE_ENDPOINT"] = storage
    return env


# What the google provider does with a google_compute_instance, against whatever Compute endpoint
# dtrain was pointed at (DTRAIN_GCP_COMPUTE_ENDPOINT, which Terraform's local-exec inherits):
# `create` inserts the VM, `destroy` deletes it. Standard library only.
GCE_SCRIPT = """
import json, os, sys, urllib.request
verb, project, zone, name = sys.argv[1:5]
base = os.environ["DTRAIN_GCP_COMPUTE_ENDPOINT"].rstrip("/") + f"/compute/v1/projects/{project}/zones/{zone}/instances"
if verb == "create":
    labels, machine, ip, external = json.loads(sys.argv[5]), sys.argv[6], sys.argv[7], sys.argv[8] == "true"
    nic = {"networkIP": ip, **({"accessConfigs": [{"natIP": ip}]} if external else {})}
    body = {"name": name, "machineType": f"zones/{zone}/machineTypes/{machine}", "labels": labels,
            "networkInterfaces": [nic]}
    req = urllib.request.Request(base, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
else:
    req = urllib.request.Request(f"{base}/{name}", method="DELETE")
try:
    op = json.loads(urllib.request.urlopen(req, timeout=30).read())
except urllib.error.HTTPError as e:
    if not (verb == "destroy" and e.code == 404):  # already gone is gone
        raise
    sys.exit(0)
wait = f"{base.rsplit('/instances', 1)[0]}/operations/{op['name']}/wait"
for _ in range(100):  # as the provider does: until the operation is DONE
    if op.get("status") == "DONE":
        break
    op = json.loads(urllib.request.urlopen(urllib.request.Request(wait, method="POST"), timeout=30).read())
if op.get("status") != "DONE" or op.get("error"):
    sys.exit(f"{verb} {name}: operation {op.get('name')} ended {op.get('status')} {op.get('error')}")
"""


# What the google provider does with the google_storage_bucket, against DTRAIN_GCP_STORAGE_ENDPOINT
# (gcp-storage-emulator): `create` makes it and labels it (a create of a name that exists fails with
# GCS's own 409, "you already own this bucket"), `destroy` deletes it, refusing a bucket that still
# holds objects unless force_destroy (the provider's rule). Standard library only.
GCS_SCRIPT = """
import json, os, sys, urllib.error, urllib.request
verb, project, name = sys.argv[1:4]
base = os.environ["DTRAIN_GCP_STORAGE_ENDPOINT"].rstrip("/") + "/storage/v1/b"
def call(method, url, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        text = urllib.request.urlopen(req, timeout=30).read()
    except urllib.error.HTTPError as e:
        sys.exit(f"googleapi: Error {e.code}: {json.loads(e.read())['error']['message']}")
    return json.loads(text) if text else {}
if verb == "create":
    call("POST", f"{base}?project={project}", {"name": name})
    call("PATCH", f"{base}/{name}", {"labels": json.loads(sys.argv[4])})  # the emulator keeps labels set so
else:
    force = sys.argv[4] == "true"
    if call("GET", f"{base}/{name}/o").get("items") and not force:
        sys.exit(f"Error trying to delete bucket {name} containing objects without `force_destroy` set to true")
    for item in call("GET", f"{base}/{name}/o").get("items", []):
        call("DELETE", f"{base}/{name}/o/{item['name']}")
    call("DELETE", f"{base}/{name}")
"""


def standin_infra(
    dest: Path,
    *,
    addresses: list[str],
    workdirs: list[str],
    authorized_keys: Path,
    ready_file: Path,
    extra_hcl: str = "",
) -> Path:
    """infra/ with the google provider's resources replaced by what the test machine can be: the
    real variables.tf and `module "plan"`, a terraform_data per node that does what GCE does for a
    new VM (authorizes the cluster's SSH key, as the guest agent does with the ssh-keys metadata,
    and writes the startup script's ready file, and creates the VM in the Compute API dtrain talks to),
    and the `cluster` output naming `addresses`."""
    dest.mkdir()
    (dest / "gce.py").write_text(GCE_SCRIPT)
    (dest / "gcs.py").write_text(GCS_SCRIPT)
    shutil.copy(REPO / "infra" / "variables.tf", dest / "variables.tf")
    (dest / "modules").symlink_to(REPO / "infra" / "modules")
    from dtrain.control.gcp.terraform import _block

    plan = _block(REPO / "infra" / "main.tf", 'module "plan"')
    # infra/'s own import block, aimed at the stand-in's bucket: adopting a kept bucket is its logic.
    adopt = _block(REPO / "infra" / "storage.tf", "import {")
    adopt = adopt.replace("google_storage_bucket.checkpoints", "terraform_data.checkpoints")
    addrs = json.dumps(addresses)
    dirs = json.dumps(workdirs)
    (dest / "versions.tf").write_text('terraform {\n  required_version = ">= 1.9"\n  backend "gcs" {}\n}\n')
    (dest / "main.tf").write_text(
        plan
        + textwrap.dedent(
            f"""

            locals {{
              addresses = {addrs}
              workdirs  = {dirs}
            }}

            # A node: the VM in the Compute API (created and deleted as the provider would, with an
            # external IP unless external_ip = false), what GCE's guest agent does with the ssh-keys
            # metadata (authorize the key; with os_login there is none, and sshd asks OS Login, which
            # the test machine does not have), and what infra/node-startup.sh signals when it is done.
            resource "terraform_data" "node" {{
              for_each = toset(module.plan.node_names)
              input = {{
                key     = var.ssh_public_key
                gce     = "${{path.module}}/gce.py"
                project = var.project_id
                zone    = var.zone
                name    = each.key
              }}
              provisioner "local-exec" {{
                command = join("; ", [
                  "set -e",
                  "{sys.executable} $GCE create $PROJECT $ZONE $NAME \\"$LABELS\\" $MACHINE $IP $EXTERNAL",
                  "$OS_LOGIN || grep -qxF \\"$KEY\\" $AUTH || echo \\"$KEY\\" >> $AUTH",
                  "mkdir -p $(dirname $READY)", "echo $OK > $READY",
                ])
                environment = {{
                  GCE     = "${{path.module}}/gce.py"
                  PROJECT = var.project_id
                  ZONE    = var.zone
                  NAME    = each.key
                  LABELS  = jsonencode(module.plan.labels)
                  MACHINE = module.plan.machine_type
                  IP      = local.addresses[index(module.plan.node_names, each.key)]
                  EXTERNAL = tostring(var.external_ip)
                  OS_LOGIN = tostring(var.os_login)
                  KEY     = trimspace(var.ssh_public_key)  # one line: grep -x must see it whole
                  AUTH    = "{authorized_keys}"
                  READY   = "{ready_file}"
                  OK      = jsonencode({{ ok = true }})
                }}
              }}
              provisioner "local-exec" {{
                when    = destroy
                command = join(" ", ["{sys.executable}", self.input.gce, "destroy", self.input.project,
                                     self.input.zone, self.input.name])
              }}
            }}

            # The checkpoint bucket (infra/storage.tf), in the storage API dtrain talks to.
            resource "terraform_data" "checkpoints" {{
              input = {{
                gcs     = "${{path.module}}/gcs.py"
                project = var.project_id
                name    = module.plan.bucket_name
                force   = var.force_destroy
              }}
              provisioner "local-exec" {{
                command     = "{sys.executable} $GCS create $PROJECT $NAME \\"$LABELS\\""
                environment = {{
                  GCS     = "${{path.module}}/gcs.py"
                  PROJECT = var.project_id
                  NAME    = module.plan.bucket_name
                  LABELS  = jsonencode(module.plan.labels)
                }}
              }}
              provisioner "local-exec" {{
                when    = destroy
                command = join(" ", ["{sys.executable}", self.input.gcs, "destroy", self.input.project,
                                     self.input.name, tostring(self.input.force)])
              }}
            }}

            output "cluster" {{
              value = {{
                name     = var.cluster_name
                project  = var.project_id
                region   = var.region
                zone     = var.zone
                bucket   = "gs://${{module.plan.bucket_name}}"
                registry = "${{var.region}}-docker.pkg.dev/${{var.project_id}}/${{module.plan.repository_id}}"
                ssh_user = "root"
                nodes = [for i, name in module.plan.node_names : {{
                  name         = name
                  role         = i == 0 ? "master" : "worker"
                  internal_ip  = local.addresses[i]
                  external_ip  = var.external_ip ? local.addresses[i] : ""
                  gpus         = module.plan.gpus
                  accelerator  = module.plan.accelerator
                  machine_type = module.plan.machine_type
                  python       = "{sys.executable}"
                  workdir      = local.workdirs[i]
                  interface    = "eth0"
                }}]
              }}
              depends_on = [terraform_data.node, terraform_data.checkpoints]
            }}
            """
        )
        + "\n"
        + adopt
        + "\n"
        + extra_hcl
    )
    return dest
