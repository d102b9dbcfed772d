output "cluster" {
  description = "The cluster record dtrain reads (`terraform output -json cluster`; shape in packages/control/gcp/record.py): nodes master first, external_ip \"\" without one, accelerator \"\" on CPU nodes."
  value = {
    name     = var.cluster_name
    project  = var.project_id
    region   = var.region
    zone     = var.zone
    bucket   = "gs://${google_storage_bucket.checkpoints.name}"
    registry = "${local.registry_host}/${var.project_id}/${google_artifact_registry_repository.images.repository_id}"
    ssh_user = var.ssh_user
    slurm    = var.slurm
    nodes = [
      for name in module.plan.node_names : {
        name         = name
        role         = module.plan.nodes[name].role
        internal_ip  = google_compute_instance.node[name].network_interface[0].network_ip
        external_ip  = try(google_compute_instance.node[name].network_interface[0].access_config[0].nat_ip, "")
        gpus         = module.plan.gpus
        accelerator  = module.plan.accelerator
        machine_type = module.plan.machine_type
        # New for every VM Compute creates: a changed id tells `dtrain up` the VM (and its SSH host key) is new.
        instance_id = google_compute_instance.node[name].instance_id
      }
    ]
  }
}

output "service_account_email" {
  description = "Email of the nodes' service account."
  value       = google_service_account.node.email
}
