locals {
  # dtrain's rules (accelerators and how each attaches to a VM, name and size limits) live once, in
  # rules.json, which the Python CLI reads too; see its _comment for the sources. g2-standard-8 is
  # L4's one-GPU default rather than -4: 8 vCPUs / 32 GB keep a data loader fed.
  rules        = jsondecode(file("${path.module}/rules.json"))
  accelerators = local.rules.accelerators

  # "" (the default) is the rules' default accelerator.
  accelerator_type = var.accelerator_type != "" ? var.accelerator_type : local.rules.default_accelerator

  # Machine series whose machine types come with GPUs attached; a CPU node must not use them.
  gpu_families = toset(flatten([for a in values(local.accelerators) : length(a.fixed_counts) > 0 ? a.families : []]))

  gpu         = var.use_gpu
  accelerator = local.gpu ? local.accelerators[local.accelerator_type] : null

  # CPU nodes default to e2-medium: enough for gloo tests and small runs, and the cheapest type that
  # is not shared-core throttled for minutes at a time.
  derived_machine_type = local.gpu ? lookup(local.accelerator.default_machine, tostring(var.gpus_per_node), "") : "e2-medium"
  machine_type         = var.machine_type != "" ? var.machine_type : local.derived_machine_type

  # Legacy custom types ("custom-4-15360") are N1.
  machine_family = startswith(local.machine_type, "custom-") ? "n1" : split("-", local.machine_type)[0]
  machine_vcpus  = try(tonumber(regex("^(?:n1-(?:standard|highmem|highcpu)|(?:n1-)?custom)-([0-9]+)", local.machine_type)[0]), null)

  # Rules below are gated so one mistake gives one error: the count first, then the machine
  # family, then the count a fixed-count machine type carries. local.accelerator is null on a CPU
  # node, so each rule that reads it is a conditional (`gpu ? rule : true`), never `!gpu || rule`:
  # Terraform before 1.12 evaluates both sides of `||` and fails on the null.
  count_ok  = local.gpu ? contains(local.accelerator.allowed_counts, var.gpus_per_node) : true
  family_ok = local.gpu ? contains(local.accelerator.families, local.machine_family) : true
  # A GPU node whose count and family passed: the rules after them may read local.accelerator.
  gpu_checked = local.gpu && local.count_ok && local.family_ok

  # The boot disk types this machine series takes; null where it takes all three dtrain offers. One
  # table for every series (rules.json's boot_disk_types), which dtrain.control.gcp.rules reads too.
  boot_disk_types = try(local.rules.boot_disk_types[local.machine_family], null)

  gpus = local.gpu ? var.gpus_per_node : 0
  guest_accelerators = local.gpu ? [{
    type  = local.accelerator_type
    count = var.gpus_per_node
  }] : []

  # GPU nodes: a Deep Learning VM "common" image with the NVIDIA 580 driver, CUDA 12.9, Docker and
  # the NVIDIA container toolkit (Ubuntu 24.04). CPU nodes: plain Ubuntu 24.04 LTS, the same
  # distribution, so the startup script takes one path (it installs docker.io from Ubuntu's archive).
  image_project = var.image_project != "" ? var.image_project : (local.gpu ? "deeplearning-platform-release" : "ubuntu-os-cloud")
  image_family  = var.image_family != "" ? var.image_family : (local.gpu ? "common-cu129-ubuntu-2404-nvidia-580" : "ubuntu-2404-lts-amd64")
  image         = "projects/${local.image_project}/global/images/family/${local.image_family}"
  dlvm_image    = local.image_project == "deeplearning-platform-release"

  secure_boot = var.secure_boot != null ? var.secure_boot : !local.gpu

  # The master is Spot only with master_spot: it runs the service that restarts preempted workers,
  # and a preempted master cannot restart itself (nor them) until `dtrain up` runs again.
  role_spot = { master = var.spot && var.master_spot, worker = var.spot }

  # GPU VMs cannot live-migrate, and Spot VMs must terminate on maintenance; both restart only when
  # they are standard VMs. A preempted Spot node is STOPped by default so its disk and internal IP
  # survive for a restart. One scheduling block per node role.
  scheduling = { for role, spot in local.role_spot : role => {
    on_host_maintenance         = local.gpu || spot ? "TERMINATE" : "MIGRATE"
    automatic_restart           = !spot
    preemptible                 = spot
    provisioning_model          = spot ? "SPOT" : "STANDARD"
    instance_termination_action = spot ? var.spot_termination_action : null
  } }

  # IAP's TCP-forwarding source range (cloud.google.com/iap/docs/using-tcp-forwarding).
  iap_range         = "35.235.240.0/20"
  ssh_source_ranges = distinct(concat(var.ssh_source_ranges, var.iap_ssh ? [local.iap_range] : []))
  ssh_anywhere      = [for c in var.ssh_source_ranges : c if can(cidrhost(c, 0)) && endswith(c, "/0")]

  name_prefix = "dtrain-${var.cluster_name}"
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.project_id}-dtrain-${var.cluster_name}"

  # Master first: the launcher and the cluster record rely on the order.
  node_names = concat(["${var.cluster_name}-master"], [for i in range(var.worker_count) : "${var.cluster_name}-worker-${i}"])
  nodes      = { for i, name in local.node_names : name => { role = i == 0 ? "master" : "worker", index = i } }

  # The cluster service's grant (infra/iam.tf) names this cluster's VMs exactly, one `||` term per
  # name. An IAM condition may hold at most 12 logical operators (cloud.google.com/iam/docs/
  # conditions-overview, "Limitations"), so one condition over every node stops at 12 nodes. The
  # grant is one binding per service_names_per_binding names instead: the type check plus 12 names
  # is 12 `||`, however many nodes; the most nodes rules.json allows (64) make 6 bindings. A name
  # prefix would need no split but would also match other clusters' VMs ("demo" -> "demo-2-master").
  service_names_per_binding = 12
  service_conditions = { for i, names in chunklist(local.node_names, local.service_names_per_binding) : tostring(i) => join(" || ", concat(
    ["resource.type != \"compute.googleapis.com/Instance\""],
    [for name in names : "resource.name == \"projects/${var.project_id}/zones/${var.zone}/instances/${name}\""],
  )) }

  # dtrain's own label wins over a user label of the same key: `dtrain down` sweeps by it.
  labels = merge(var.labels, { "dtrain-cluster" = var.cluster_name })
}

# One terraform_data per cross-variable rule, so a failing plan names the rule and each
# `terraform test` run can expect exactly the rule it breaks.

resource "terraform_data" "zone_in_region" {
  lifecycle {
    precondition {
      condition     = startswith(var.zone, "${var.region}-")
      error_message = "zone ${var.zone} is not in region ${var.region}."
    }
  }
}

resource "terraform_data" "gpu_machine_family" {
  lifecycle {
    precondition {
      condition     = !local.count_ok || local.family_ok
      error_message = "accelerator ${local.accelerator_type} cannot be attached to ${local.machine_type}: it needs a ${join("/", local.gpu ? local.accelerator.families : [])} machine type (T4 attaches to n1-*; L4 exists only on g2-standard-*, A100 on a2-*, H100 on a3-highgpu-*)."
    }
  }
}

resource "terraform_data" "gpu_count" {
  lifecycle {
    precondition {
      condition     = local.count_ok
      error_message = "gpus_per_node = ${var.gpus_per_node} is not offered for ${local.accelerator_type}: choose one of ${join(", ", local.gpu ? [for n in local.accelerator.allowed_counts : tostring(n)] : [])}."
    }
  }
}

resource "terraform_data" "gpu_fixed_count" {
  lifecycle {
    precondition {
      condition = (local.gpu_checked ?
        length(local.accelerator.fixed_counts) == 0 || lookup(local.accelerator.fixed_counts, local.machine_type, -1) == var.gpus_per_node
      : true)
      error_message = "machine type ${local.machine_type} carries ${try(tostring(local.accelerator.fixed_counts[local.machine_type]), "no")} ${local.accelerator_type} GPU(s), not gpus_per_node = ${var.gpus_per_node}; leave machine_type empty to derive the matching type."
    }
  }
}

resource "terraform_data" "gpu_vcpus" {
  lifecycle {
    precondition {
      # machine_vcpus is null for types that do not spell their vCPUs (g2-standard-8): `null <= n` fails.
      condition = (local.gpu_checked && local.machine_vcpus != null ?
        length(local.accelerator.max_vcpus) == 0 || local.machine_vcpus <= lookup(local.accelerator.max_vcpus, tostring(var.gpus_per_node), 0)
      : true)
      error_message = "${local.machine_type} has too many vCPUs for ${var.gpus_per_node} x ${local.accelerator_type} (at most ${try(tostring(local.accelerator.max_vcpus[tostring(var.gpus_per_node)]), "?")})."
    }
  }
}

# a3-highgpu-1g/2g/4g exist only as Spot or flex-start VMs (rules.json's spot_only); an on-demand
# request for one fails at creation, after the network and bucket are made. Every node must be Spot:
# the master too (master_spot), since it is on-demand otherwise.
resource "terraform_data" "gpu_spot_only" {
  lifecycle {
    precondition {
      condition     = local.gpu ? !contains(local.accelerator.spot_only, local.machine_type) || (var.spot && var.master_spot) : true
      error_message = "${local.machine_type} is offered only as a Spot VM: set spot = true and master_spot = true, or take the on-demand type with more GPUs (${join(", ", local.gpu ? [for n, m in local.accelerator.default_machine : m if !contains(lookup(local.accelerator, "spot_only", []), m)] : [])})."
    }
  }
}

resource "terraform_data" "cpu_machine_family" {
  lifecycle {
    precondition {
      condition     = local.gpu || !contains(local.gpu_families, local.machine_family)
      error_message = "use_gpu is false but ${local.machine_type} comes with GPUs attached; set use_gpu = true or pick a CPU machine type."
    }
  }
}

resource "terraform_data" "disk" {
  lifecycle {
    precondition {
      condition     = local.boot_disk_types == null ? true : contains(local.boot_disk_types, var.disk_type)
      error_message = "${local.machine_type} does not take a ${var.disk_type} boot disk: ${upper(local.machine_family)} machine types take ${join(" or ", local.boot_disk_types == null ? [] : local.boot_disk_types)}; set disk_type = \"pd-balanced\"."
    }
    precondition {
      condition     = !local.dlvm_image || var.disk_size_gb >= 50
      error_message = "Deep Learning VM images need a boot disk of at least 50 GB; disk_size_gb is ${var.disk_size_gb}."
    }
  }
}

resource "terraform_data" "ssh_from_anywhere" {
  lifecycle {
    precondition {
      condition     = var.allow_ssh_from_anywhere || length(local.ssh_anywhere) == 0
      error_message = "ssh_source_ranges contains ${join(", ", local.ssh_anywhere)}, which opens SSH to the whole internet; list your own ranges, use iap_ssh, or set allow_ssh_from_anywhere = true."
    }
  }
}

resource "terraform_data" "ssh_reachable" {
  lifecycle {
    precondition {
      condition     = length(local.ssh_source_ranges) > 0
      error_message = "No SSH source: ssh_source_ranges is empty and iap_ssh is false, so nobody could reach the nodes (and an empty firewall source would mean 0.0.0.0/0)."
    }
  }
}

resource "terraform_data" "bucket_name" {
  lifecycle {
    precondition {
      condition     = length(local.bucket_name) <= 63
      error_message = "The derived bucket name ${local.bucket_name} is longer than 63 characters; set bucket_name."
    }
  }
}
