# The use_gpu switch: GPU nodes vs CPU nodes.

run "cpu_nodes" {
  command = plan
  variables {
    use_gpu = false
  }
  assert {
    condition     = output.machine_type == "e2-medium"
    error_message = "CPU nodes should default to e2-medium, got ${output.machine_type}"
  }
  assert {
    condition     = output.accelerator == "" && output.gpus == 0 && length(output.guest_accelerators) == 0
    error_message = "CPU nodes must have no accelerator"
  }
  assert {
    condition     = output.image == "projects/ubuntu-os-cloud/global/images/family/ubuntu-2404-lts-amd64"
    error_message = "CPU nodes should boot Ubuntu 24.04 LTS, got ${output.image}"
  }
  assert {
    condition     = output.scheduling.worker.on_host_maintenance == "MIGRATE" && output.scheduling.worker.automatic_restart
    error_message = "standard CPU nodes can live-migrate and restart"
  }
  assert {
    condition     = output.secure_boot == true
    error_message = "Secure Boot should default to on for CPU nodes"
  }
}

run "cpu_nodes_ignore_gpu_settings" {
  command = plan
  variables {
    use_gpu          = false
    accelerator_type = "nvidia-tesla-t4"
    gpus_per_node    = 3
    machine_type     = "n2-standard-8"
  }
  assert {
    condition     = output.machine_type == "n2-standard-8" && output.gpus == 0
    error_message = "CPU nodes keep an explicit CPU machine type and ignore the GPU count"
  }
}

run "gpu_nodes_terminate_on_maintenance" {
  command = plan
  assert {
    condition     = output.scheduling.worker.on_host_maintenance == "TERMINATE"
    error_message = "GPU nodes cannot live-migrate: on_host_maintenance must be TERMINATE"
  }
  assert {
    condition     = output.scheduling.worker.automatic_restart && output.scheduling.worker.provisioning_model == "STANDARD"
    error_message = "standard GPU nodes restart automatically"
  }
}

run "secure_boot_override" {
  command = plan
  variables {
    secure_boot = true
  }
  assert {
    condition     = output.secure_boot == true
    error_message = "secure_boot = true must win over the GPU default"
  }
}

run "cpu_rejects_gpu_machine_type" {
  command = plan
  variables {
    use_gpu      = false
    machine_type = "g2-standard-8"
  }
  expect_failures = [terraform_data.cpu_machine_family]
}
