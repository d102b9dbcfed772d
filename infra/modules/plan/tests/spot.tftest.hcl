# Spot scheduling.
# Baseline: a valid 2-node L4 cluster; each run changes only what it tests.
variables {
  project_id              = "demo-project"
  region                  = "us-central1"
  zone                    = "us-central1-a"
  cluster_name            = "demo"
  worker_count            = 1
  use_gpu                 = true
  accelerator_type        = "nvidia-l4"
  gpus_per_node           = 1
  machine_type            = ""
  spot                    = false
  spot_termination_action = "STOP"
  disk_size_gb            = 100
  disk_type               = "pd-balanced"
  ssh_source_ranges       = ["203.0.113.7/32"]
  allow_ssh_from_anywhere = false
  iap_ssh                 = true
  bucket_name             = ""
  bucket_lifecycle_days   = 7
  labels                  = {}
  ssh_user                = "dtrain"
  ssh_public_key          = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGd0cmFpbi10ZXN0LWtleS1ub3QtYS1yZWFsLW9uZS4uLg dtrain-demo"
  external_ip             = true
  image_project           = ""
  image_family            = ""
  subnet_cidr             = "10.42.0.0/24"
}

run "spot_gpu" {
  command = plan
  variables {
    spot = true
  }
  assert {
    condition     = output.scheduling.provisioning_model == "SPOT" && output.scheduling.preemptible
    error_message = "spot nodes need provisioning_model SPOT and preemptible = true"
  }
  assert {
    condition     = output.scheduling.automatic_restart == false && output.scheduling.on_host_maintenance == "TERMINATE"
    error_message = "spot nodes cannot restart automatically and must terminate on maintenance"
  }
  assert {
    condition     = output.scheduling.instance_termination_action == "STOP"
    error_message = "spot termination action should default to STOP"
  }
}

run "spot_cpu_delete" {
  command = plan
  variables {
    use_gpu                 = false
    spot                    = true
    spot_termination_action = "DELETE"
  }
  assert {
    condition     = output.scheduling.on_host_maintenance == "TERMINATE" && output.scheduling.instance_termination_action == "DELETE"
    error_message = "spot CPU nodes terminate on maintenance and honour the termination action"
  }
}

run "standard_has_no_termination_action" {
  command = plan
  assert {
    condition     = output.scheduling.instance_termination_action == null && output.scheduling.preemptible == false
    error_message = "standard nodes must not set instance_termination_action or preemptible"
  }
}

run "bad_termination_action" {
  command = plan
  variables {
    spot_termination_action = "HIBERNATE"
  }
  expect_failures = [var.spot_termination_action]
}
