"""A stand-in for infra/ that Terraform can apply here (no google provider can be downloaded), for
the tests of `dtrain up` / `dtrain down` (tests/cloud, tests/cluster/test_gcp_lifecycle.py)."""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
    and writes the startup script's ready file), and the `cluster` output naming `addresses`."""
    dest.mkdir()
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

            # A node: what GCE's guest agent does with the ssh-keys metadata (authorize the key),
            # and what docker/node-startup.sh signals when it is done.
            resource "terraform_data" "node" {{
              for_each = toset(module.plan.node_names)
              input    = var.ssh_public_key
              provisioner "local-exec" {{
                command = join("; ", [
                  "grep -qxF \\"$KEY\\" $AUTH || echo \\"$KEY\\" >> $AUTH",
                  "mkdir -p $(dirname $READY)", "echo $OK > $READY",
                ])
                environment = {{
                  KEY   = var.ssh_public_key
                  AUTH  = "{authorized_keys}"
                  READY = "{ready_file}"
                  OK    = jsonencode({{ ok = true }})
                }}
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
