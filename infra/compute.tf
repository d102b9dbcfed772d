resource "google_compute_instance" "node" {
  #checkov:skip=CKV_GCP_38:Boot disks use Google-managed encryption; customer-supplied keys would have to be kept by the user for short-lived training nodes whose data lives in the bucket.
  #checkov:skip=CKV_GCP_40:external_ip (default true) gives direct SSH from ssh_source_ranges only; set external_ip = false for internal-only nodes reached through IAP.
  #checkov:skip=CKV_GCP_34:enable-oslogin is FALSE unless os_login: access is by the cluster's own key in instance metadata (infra/README.md, docs/decisions.md), which project-level OS Login would make sshd ignore; organisations that require OS Login get os_login = true (dtrain sets it), and the key goes to the user's OS Login profile instead.
  for_each = module.plan.nodes

  name         = each.key
  zone         = var.zone
  machine_type = module.plan.machine_type
  tags         = [module.plan.network_tag]
  labels       = merge(local.labels, { "dtrain-role" = each.value.role })
  description  = "dtrain cluster ${var.cluster_name} ${each.value.role}"

  # Changing machine_type or the accelerator needs the VM stopped; let terraform do it.
  allow_stopping_for_update = true

  boot_disk {
    auto_delete = true
    initialize_params {
      image  = module.plan.image
      size   = var.disk_size_gb
      type   = var.disk_type
      labels = local.labels
    }
  }

  network_interface {
    subnetwork = google_compute_subnetwork.cluster.id
    dynamic "access_config" {
      for_each = var.external_ip ? [1] : []
      content {
        network_tier = "PREMIUM"
      }
    }
  }

  # Empty on CPU nodes. On G2 the machine type already fixes the L4 count; the block states the
  # same count (module.plan refuses any other), as the GCP API accepts.
  dynamic "guest_accelerator" {
    for_each = module.plan.guest_accelerators
    content {
      type  = guest_accelerator.value.type
      count = guest_accelerator.value.count
    }
  }

  scheduling {
    on_host_maintenance         = module.plan.scheduling[each.value.role].on_host_maintenance
    automatic_restart           = module.plan.scheduling[each.value.role].automatic_restart
    preemptible                 = module.plan.scheduling[each.value.role].preemptible
    provisioning_model          = module.plan.scheduling[each.value.role].provisioning_model
    instance_termination_action = module.plan.scheduling[each.value.role].instance_termination_action
  }

  # The cluster's own identity, never the default compute service account. The cloud-platform
  # scope defers every access decision to IAM (the bucket- and repository-level grants in iam.tf).
  service_account {
    email  = google_service_account.node.email
    scopes = ["cloud-platform"]
  }

  # Secure Boot is off on GPU nodes (module.plan.secure_boot): it loads only kernel modules signed by a key
  # the firmware trusts, which Google documents for its Secure Boot driver steps
  # (https://cloud.google.com/compute/docs/gpus/install-drivers-gpu#secure-boot), not for the Deep Learning VM
  # image. Where constraints/compute.requireShieldedVm is enforced, `dtrain preflight` refuses GPU nodes.
  shielded_instance_config {
    enable_secure_boot          = module.plan.secure_boot
    enable_vtpm                 = true
    enable_integrity_monitoring = true
  }

  metadata = {
    # The per-cluster key dtrain generated; project-wide keys and OS Login are switched off so
    # exactly this key (and nothing else) logs in as ssh_user. With os_login (an organisation that
    # enforces constraints/compute.requireOsLogin) sshd ignores metadata keys: the key is on the
    # user's OS Login profile instead, and none is put here.
    "ssh-keys"               = var.os_login ? "" : "${var.ssh_user}:${trimspace(var.ssh_public_key)}"
    "block-project-ssh-keys" = true
    "enable-oslogin"         = var.os_login ? "TRUE" : "FALSE"
    # The startup script reports readiness as the guest attribute dtrain/ready.
    "enable-guest-attributes" = "TRUE"
    "startup-script"          = file("${path.module}/node-startup.sh")
    "dtrain-ssh-user"         = var.ssh_user
    "dtrain-gpus"             = tostring(module.plan.gpus)
    "dtrain-registry-host"    = local.registry_host
    "dtrain-slurm"            = var.slurm ? "1" : "0"
    # Deep Learning VM images install the driver on first boot only if the image lacks it;
    # the -nvidia-580 families ship it, so this is a no-op there and a fallback elsewhere.
    "install-nvidia-driver" = module.plan.gpus > 0 ? "True" : "False"
  }

  # The node must be able to read its bucket and repository from its first boot.
  depends_on = [
    google_storage_bucket_iam_member.node_objects,
    google_artifact_registry_repository_iam_member.node_reader,
  ]
}
