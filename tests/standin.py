"""A stand-in for infra/ that Terraform can apply here (no google provider can be downloaded), for
the tests of `dtrain up` / `dtrain down` (tests/cloud, tests/cluster/test_gcp_lifecycle.py)."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# What the google provider does with a google_compute_instance, against whatever Compute endpoint
# dtrain was pointed at (DTRAIN_GCP_COMPUTE_ENDPOINT, which Terraform's local-exec inherits):
# `create` inserts the VM, `destroy` deletes it. Standard library only.
GCE_SCRIPT = """
import json, os, sys, urllib.request
verb, project, zone, name = sys.argv[1:5]
base = os.environ["DTRAIN_GCP_COMPUTE_ENDPOINT"].rstrip("/") + f"/compute/v1/projects/{project}/zones/{zone}/instances"
if verb == "create":
    labels, machine, ip = json.loads(sys.argv[5]), sys.argv[6], sys.argv[7]
    body = {"name": name, "machineType": f"zones/{zone}/machineTypes/{machine}", "labels": labels,
            "networkInterfaces": [{"networkIP": ip, "accessConfigs": [{"natIP": ip}]}]}
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
    shutil.copy(REPO / "infra" / "variables.tf", dest / "variables.tf")
    (dest / "modules").symlink_to(REPO / "infra" / "modules")
    from dtrain.control.gcp.terraform import _block

    plan = _block(REPO / "infra" / "main.tf", 'module "plan"')
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

            # A node: the VM in the Compute API (created and deleted as the provider would), what GCE's
            # guest agent does with the ssh-keys metadata (authorize the key), and what
            # infra/node-startup.sh signals when it is done.
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
                  "{sys.executable} $GCE create $PROJECT $ZONE $NAME \\"$LABELS\\" $MACHINE $IP",
                  "grep -qxF \\"$KEY\\" $AUTH || echo \\"$KEY\\" >> $AUTH",
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
                  KEY     = var.ssh_public_key
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
                  external_ip  = local.addresses[i]
                  gpus         = module.plan.gpus
                  accelerator  = module.plan.accelerator
                  machine_type = module.plan.machine_type
                  python       = "{sys.executable}"
                  workdir      = local.workdirs[i]
                  interface    = "eth0"
                }}]
              }}
              depends_on = [terraform_data.node]
            }}
            """
        )
        + extra_hcl
    )
    return dest
