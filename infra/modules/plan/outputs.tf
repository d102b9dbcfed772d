output "machine_type" {
  description = "Machine type of every node."
  value       = local.machine_type
}

output "machine_family" {
  description = "Machine series of machine_type (n1, g2, e2, ...)."
  value       = local.machine_family
}

output "accelerator" {
  description = "GPU model on each node, \"\" for CPU nodes."
  value       = local.gpu ? local.accelerator_type : ""
}

output "gpus" {
  description = "GPUs per node (0 for CPU nodes)."
  value       = local.gpus
}

output "guest_accelerators" {
  description = "guest_accelerator blocks for google_compute_instance: one {type, count} on GPU nodes, none on CPU nodes."
  value       = local.guest_accelerators
}

output "image" {
  description = "Boot image, as projects/P/global/images/family/F."
  value       = local.image
}

output "image_project" {
  description = "Project of the boot image."
  value       = local.image_project
}

output "image_family" {
  description = "Image family of the boot disk."
  value       = local.image_family
}

output "secure_boot" {
  description = "Whether Shielded VM Secure Boot is on."
  value       = local.secure_boot
}

output "scheduling" {
  description = "Values of the instance scheduling block, by node role (master, worker): the master is on-demand unless master_spot."
  value       = local.scheduling
}

output "ssh_source_ranges" {
  description = "Source ranges of the SSH firewall rule: ssh_source_ranges plus IAP's range when iap_ssh."
  value       = local.ssh_source_ranges
}

output "name_prefix" {
  description = "Prefix of the cluster's network, firewall, service account and repository names."
  value       = local.name_prefix
}

output "network_tag" {
  description = "Network tag on every node; the firewall rules target it."
  value       = local.name_prefix
}

output "service_account_id" {
  description = "account_id of the nodes' service account (6-30 characters)."
  value       = local.name_prefix
}

output "repository_id" {
  description = "Artifact Registry repository ID for the training images."
  value       = local.name_prefix
}

output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = local.bucket_name
}

output "node_names" {
  description = "Node names, master first."
  value       = local.node_names
}

output "nodes" {
  description = "Map of node name to {role, index}."
  value       = local.nodes
}

output "service_conditions" {
  description = "IAM condition expressions of the cluster service's grant, by binding index: each lets the instance permissions reach at most 12 of this cluster's VMs by exact name, and IAM's 12-operator limit holds."
  value       = local.service_conditions
}

output "labels" {
  description = "Labels for every resource that takes labels (var.labels plus dtrain-cluster)."
  value       = local.labels
}

output "nat" {
  description = "Whether the subnet needs Cloud NAT (nodes without external IPs still need to reach apt and Docker Hub)."
  value       = !var.external_ip
}
