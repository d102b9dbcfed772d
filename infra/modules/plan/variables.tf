# The same inputs as the root module (infra/variables.tf), minus those only provider resources use
# (force_destroy, observability_roles, adopt_bucket, os_login), and without defaults: the root owns them.
# Single-variable checks are validations, identical here and in the root (tests/infra checks that
# every root validation appears here, so `terraform test` exercises the root's rules); rules that
# involve several variables are the terraform_data preconditions in main.tf.

variable "project_id" {
  type        = string
  description = "GCP project ID that owns every resource of the cluster."
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a GCP project ID: 6-30 characters, lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "region" {
  type        = string
  description = "Region of the subnet, the checkpoint bucket and the Artifact Registry repository."
  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+$", var.region))
    error_message = "region must look like a GCP region, e.g. us-central1."
  }
}

variable "zone" {
  type        = string
  description = "Zone of every node (one zone keeps NCCL traffic off inter-zone links). Must be in region."
  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone must look like a GCP zone, e.g. us-central1-a."
  }
}

variable "cluster_name" {
  type        = string
  description = "Name of the cluster; prefixes every resource and is the dtrain-cluster label. 2-23 characters so the service account ID (dtrain-NAME) fits in 30."
  validation {
    condition     = can(regex(local.rules.cluster_name.pattern, var.cluster_name))
    error_message = "cluster_name must be ${local.rules.cluster_name.min_length}-${local.rules.cluster_name.max_length} characters: lowercase letters, digits and hyphens, starting with a letter and not ending with a hyphen."
  }
}

variable "worker_count" {
  type        = number
  description = "Number of worker nodes besides the master (0 = a single-node cluster)."
  validation {
    condition     = var.worker_count >= local.rules.worker_count.min && var.worker_count <= local.rules.worker_count.max && floor(var.worker_count) == var.worker_count
    error_message = "worker_count must be a whole number from ${local.rules.worker_count.min} to ${local.rules.worker_count.max}."
  }
}

variable "use_gpu" {
  type        = bool
  description = "true: GPU nodes (accelerator_type x gpus_per_node, Deep Learning VM image). false: CPU nodes (e2-medium unless machine_type is set)."
}

variable "accelerator_type" {
  type        = string
  description = "GPU model when use_gpu is true: nvidia-tesla-t4 (on N1), nvidia-l4 (G2), nvidia-tesla-a100 or nvidia-a100-80gb (A2), nvidia-h100-80gb (A3); \"\" is modules/plan/rules.json's default_accelerator. rules.json's refused_accelerators (V100) are refused with their reason."
  validation {
    # A refused card gets its own reason below, not this list.
    condition     = var.accelerator_type == "" || contains(keys(local.rules.accelerators), var.accelerator_type) || contains(keys(local.rules.refused_accelerators), var.accelerator_type)
    error_message = "accelerator_type must be \"\" (the default, ${local.rules.default_accelerator}) or one of the models dtrain knows: ${join(", ", keys(local.rules.accelerators))}."
  }
  validation {
    condition     = !contains(keys(local.rules.refused_accelerators), var.accelerator_type)
    error_message = "accelerator_type ${var.accelerator_type} is refused: ${lookup(local.rules.refused_accelerators, var.accelerator_type, "")}."
  }
}

variable "gpus_per_node" {
  type        = number
  description = "GPUs per node when use_gpu is true: modules/plan/rules.json's allowed_counts (T4: 1, 2 or 4; L4, A100 80GB, H100: 1, 2, 4 or 8; A100 40GB also 16). A2, A3 and G2 machine types fix the count."
  validation {
    condition     = var.gpus_per_node >= 1 && var.gpus_per_node <= 16 && floor(var.gpus_per_node) == var.gpus_per_node
    error_message = "gpus_per_node must be a whole number from 1 to 16."
  }
}

variable "machine_type" {
  type        = string
  description = "Machine type of every node; \"\" derives it from the accelerator and GPU count (or e2-medium for CPU nodes)."
  validation {
    condition     = var.machine_type == "" || can(regex("^[a-z][a-z0-9]*-[a-z0-9-]+$", var.machine_type))
    error_message = "machine_type must be empty or a machine type name such as n1-standard-8 or g2-standard-24."
  }
}

variable "spot" {
  type        = bool
  description = "Run nodes as Spot VMs (much cheaper, may be preempted with ~30 s notice; dtrain resumes from the last checkpoint)."
}

variable "master_spot" {
  type        = bool
  description = "With spot = true, run the master as Spot too. Off by default: a preempted master cannot restart itself or the workers, so recovery would need `dtrain up` from your machine."
}

variable "spot_termination_action" {
  type        = string
  description = "What GCP does to a preempted Spot node: STOP (keeps the disk and internal IP; restart it later) or DELETE."
  validation {
    condition     = contains(["STOP", "DELETE"], var.spot_termination_action)
    error_message = "spot_termination_action must be STOP or DELETE."
  }
}

variable "disk_size_gb" {
  type        = number
  description = "Boot disk size of each node in GB (Deep Learning VM images need at least 50)."
  validation {
    condition     = var.disk_size_gb >= local.rules.disk_size_gb.min && var.disk_size_gb <= local.rules.disk_size_gb.max && floor(var.disk_size_gb) == var.disk_size_gb
    error_message = "disk_size_gb must be a whole number from ${local.rules.disk_size_gb.min} to ${local.rules.disk_size_gb.max}."
  }
}

variable "disk_type" {
  type        = string
  description = "Boot disk type: pd-balanced (default), pd-ssd or pd-standard. pd-standard is refused on the machine series that do not take it (modules/plan/rules.json's boot_disk_types: G2, A3, C3, C3D)."
  validation {
    condition     = contains(["pd-balanced", "pd-ssd", "pd-standard"], var.disk_type)
    error_message = "disk_type must be pd-balanced, pd-ssd or pd-standard."
  }
}

variable "ssh_source_ranges" {
  type        = list(string)
  description = "CIDR ranges allowed to reach tcp:22 on the nodes, e.g. [\"203.0.113.7/32\"]."
  validation {
    condition     = alltrue([for c in var.ssh_source_ranges : can(cidrhost(c, 0)) && strcontains(c, "/")])
    error_message = "ssh_source_ranges must hold CIDR ranges such as 203.0.113.7/32 (a bare address needs /32, or /128 for IPv6)."
  }
  validation {
    condition     = alltrue([for c in var.ssh_source_ranges : can(cidrhost(c, 0)) ? cidrsubnet(c, 0, 0) == c : true])
    error_message = "ssh_source_ranges entries must have no host bits set (write 203.0.113.0/24, not 203.0.113.7/24; for one address use /32)."
  }
}

variable "allow_ssh_from_anywhere" {
  type        = bool
  description = "Allow 0.0.0.0/0 or ::/0 in ssh_source_ranges. Off by default: SSH open to the internet is refused."
}

variable "iap_ssh" {
  type        = bool
  description = "Also allow SSH from Identity-Aware Proxy's TCP forwarding range 35.235.240.0/20 (for `gcloud compute ssh --tunnel-through-iap`)."
}

variable "bucket_name" {
  type        = string
  description = "Checkpoint bucket name; \"\" derives <project_id>-dtrain-<cluster_name>."
  validation {
    condition     = var.bucket_name == "" || (can(regex("^[a-z0-9][a-z0-9_-]{1,61}[a-z0-9]$", var.bucket_name)) && !startswith(var.bucket_name, "goog"))
    error_message = "bucket_name must be empty or 3-63 lowercase letters, digits, hyphens and underscores, not starting with goog."
  }
}

variable "bucket_lifecycle_days" {
  type        = number
  description = "Days a noncurrent (overwritten or deleted) object version is kept before the lifecycle rule deletes it. Live objects are never deleted by a rule."
  validation {
    condition     = var.bucket_lifecycle_days >= 1 && var.bucket_lifecycle_days <= 3650 && floor(var.bucket_lifecycle_days) == var.bucket_lifecycle_days
    error_message = "bucket_lifecycle_days must be a whole number from 1 to 3650."
  }
}

variable "labels" {
  type        = map(string)
  description = "Extra labels on every resource that takes labels; dtrain-cluster and dtrain-role are always set by dtrain."
  validation {
    condition     = alltrue([for k, v in var.labels : can(regex("^[a-z][a-z0-9_-]{0,62}$", k)) && can(regex("^[a-z0-9_-]{0,63}$", v))])
    error_message = "labels keys must be 1-63 lowercase letters, digits, _ or -, starting with a letter; values up to 63 of the same characters."
  }
}

variable "ssh_user" {
  type        = string
  description = "Login user on the nodes; its key is the cluster's own (ssh_public_key). Added to the docker group."
  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.ssh_user)) && var.ssh_user != "root"
    error_message = "ssh_user must be a Linux user name (lowercase, up to 32 characters) other than root."
  }
}

variable "ssh_public_key" {
  type        = string
  description = "OpenSSH public key of the cluster (one line, e.g. \"ssh-ed25519 AAAA... dtrain-demo\"); dtrain generates one per cluster."
  validation {
    condition     = can(regex("^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\\.com|sk-ecdsa-sha2-nistp256@openssh\\.com) AAAA[A-Za-z0-9+/]+={0,3}( [^\\r\\n]*)?$", trimspace(var.ssh_public_key)))
    error_message = "ssh_public_key must be one OpenSSH public key line: <type> <base64> [comment], e.g. ssh-ed25519 AAAAC3... dtrain. Paste the .pub file of the cluster's own key (ssh-keygen -t ed25519 -f ~/.ssh/dtrain-demo -N \"\"), not the example's placeholder."
  }
  # An ed25519 public key is always 51 bytes (type, then 32 key bytes), 68 base64 characters: a
  # made-up key such as an example's placeholder passes the pattern above but not this, and would
  # deploy a key nobody holds.
  validation {
    condition     = !startswith(trimspace(var.ssh_public_key), "ssh-ed25519 ") || can(regex("^ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI[A-Za-z0-9+/]{43}( [^\\r\\n]*)?$", trimspace(var.ssh_public_key)))
    error_message = "ssh_public_key is not a real ed25519 public key (its base64 part must be the 68 characters ssh-keygen writes): paste the .pub file of the cluster's own key (ssh-keygen -t ed25519 -f ~/.ssh/dtrain-demo -N \"\"), not a placeholder."
  }
}

variable "external_ip" {
  type        = bool
  description = "Give each node an ephemeral external IP (direct SSH). false: internal IPs only, SSH through IAP, internet egress through Cloud NAT."
}

variable "image_project" {
  type        = string
  description = "Project of the boot image; \"\" derives it (deeplearning-platform-release for GPU, ubuntu-os-cloud for CPU)."
  validation {
    condition     = var.image_project == "" || can(regex("^[a-z][a-z0-9-]{4,61}[a-z0-9]$", var.image_project))
    error_message = "image_project must be empty or a GCP project ID."
  }
}

variable "image_family" {
  type        = string
  description = "Image family of the boot disk; \"\" derives it (a Deep Learning VM family with the NVIDIA driver for GPU, Ubuntu 24.04 LTS for CPU)."
  validation {
    condition     = var.image_family == "" || can(regex("^[a-z][a-z0-9-]{0,61}[a-z0-9]$", var.image_family))
    error_message = "image_family must be empty or an image family name."
  }
}

variable "subnet_cidr" {
  type        = string
  description = "Primary IPv4 range of the cluster's subnet."
  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0)) && can(regex("^[0-9.]+/([89]|1[0-9]|2[0-9])$", var.subnet_cidr))
    error_message = "subnet_cidr must be an IPv4 CIDR with a prefix length from /8 to /29, e.g. 10.42.0.0/24."
  }
  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0)) ? cidrsubnet(var.subnet_cidr, 0, 0) == var.subnet_cidr : true
    error_message = "subnet_cidr must have no host bits set (e.g. 10.42.0.0/24, not 10.42.0.1/24)."
  }
}

variable "secure_boot" {
  type        = bool
  default     = null
  nullable    = true
  description = "Shielded VM Secure Boot. null derives it: on for CPU nodes, off for GPU nodes (Secure Boot loads only signed kernel modules, and the Deep Learning VM's NVIDIA modules are not known to be signed by a key the firmware trusts). vTPM and integrity monitoring are always on."
}
