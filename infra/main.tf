# A dtrain cluster: one VPC and subnet, two firewall rules (SSH in, everything between nodes), a
# service account, a checkpoint bucket, an Artifact Registry repository and master + N workers.
# Every derived value and every rule about valid combinations lives in modules/plan, which needs
# no provider and is tested offline with `terraform test`; this module only wires resources to it.

module "plan" {
  source = "./modules/plan"

  project_id              = var.project_id
  region                  = var.region
  zone                    = var.zone
  cluster_name            = var.cluster_name
  worker_count            = var.worker_count
  use_gpu                 = var.use_gpu
  accelerator_type        = var.accelerator_type
  gpus_per_node           = var.gpus_per_node
  machine_type            = var.machine_type
  spot                    = var.spot
  master_spot             = var.master_spot
  spot_termination_action = var.spot_termination_action
  disk_size_gb            = var.disk_size_gb
  disk_type               = var.disk_type
  ssh_source_ranges       = var.ssh_source_ranges
  allow_ssh_from_anywhere = var.allow_ssh_from_anywhere
  iap_ssh                 = var.iap_ssh
  bucket_name             = var.bucket_name
  bucket_lifecycle_days   = var.bucket_lifecycle_days
  labels                  = var.labels
  ssh_user                = var.ssh_user
  ssh_public_key          = var.ssh_public_key
  external_ip             = var.external_ip
  image_project           = var.image_project
  image_family            = var.image_family
  subnet_cidr             = var.subnet_cidr
  secure_boot             = var.secure_boot
}

locals {
  labels        = module.plan.labels
  registry_host = "${var.region}-docker.pkg.dev"
}
