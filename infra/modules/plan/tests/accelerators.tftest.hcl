# A100 40GB / 80GB (A2) and H100 (A3): the machine type each count derives, and what GCP
# would refuse. rules.json holds the tables; these runs check Terraform reads them as intended.

run "v100_refused_with_its_reason" {
  # V100 is in rules.json's refused_accelerators: the GPU image's torch build has no sm_70 kernels.
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-v100"
  }
  expect_failures = [var.accelerator_type]
}

run "t4_too_many_vcpus_refused" {
  # One to two T4s allow at most 48 vCPUs.
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    machine_type     = "n1-standard-64"
  }
  expect_failures = [terraform_data.gpu_vcpus]
}

run "a100_counts_derive_a2_highgpu" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-a100"
    gpus_per_node    = 4
  }
  assert {
    condition     = output.machine_type == "a2-highgpu-4g" && output.machine_family == "a2" && output.gpus == 4
    error_message = "4 x A100 40GB should derive a2-highgpu-4g, got ${output.machine_type}"
  }
}

run "a100_sixteen_gpus_derive_a2_megagpu" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-a100"
    gpus_per_node    = 16
  }
  assert {
    condition     = output.machine_type == "a2-megagpu-16g" && output.guest_accelerators[0].count == 16
    error_message = "16 x A100 40GB should derive a2-megagpu-16g, got ${output.machine_type}"
  }
}

run "a100_80gb_derives_a2_ultragpu" {
  command = plan
  variables {
    accelerator_type = "nvidia-a100-80gb"
    gpus_per_node    = 2
  }
  assert {
    condition     = output.machine_type == "a2-ultragpu-2g"
    error_message = "2 x A100 80GB should derive a2-ultragpu-2g, got ${output.machine_type}"
  }
}

run "a100_80gb_on_a2_highgpu_refused" {
  # Same series, other card: a2-highgpu carries the 40 GB A100.
  command = plan
  variables {
    accelerator_type = "nvidia-a100-80gb"
    machine_type     = "a2-highgpu-1g"
  }
  expect_failures = [terraform_data.gpu_fixed_count]
}

run "a100_count_beyond_a2_type" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-a100"
    machine_type     = "a2-highgpu-2g"
    gpus_per_node    = 4
  }
  expect_failures = [terraform_data.gpu_fixed_count]
}

run "a100_on_n1_refused" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-a100"
    machine_type     = "n1-standard-8"
  }
  expect_failures = [terraform_data.gpu_machine_family]
}

run "a100_sixteen_refused_for_80gb" {
  command = plan
  variables {
    accelerator_type = "nvidia-a100-80gb"
    gpus_per_node    = 16
  }
  expect_failures = [terraform_data.gpu_count]
}

run "h100_eight_gpus_on_demand" {
  command = plan
  variables {
    accelerator_type = "nvidia-h100-80gb"
    gpus_per_node    = 8
  }
  assert {
    condition     = output.machine_type == "a3-highgpu-8g" && output.machine_family == "a3" && output.guest_accelerators[0].count == 8
    error_message = "8 x H100 should derive a3-highgpu-8g, got ${output.machine_type}"
  }
}

run "h100_one_gpu_on_demand_refused" {
  # a3-highgpu-1g/2g/4g are Spot (or flex-start) only.
  command = plan
  variables {
    accelerator_type = "nvidia-h100-80gb"
  }
  expect_failures = [terraform_data.gpu_spot_only]
}

run "h100_one_gpu_spot_master_on_demand_refused" {
  command = plan
  variables {
    accelerator_type = "nvidia-h100-80gb"
    spot             = true
  }
  expect_failures = [terraform_data.gpu_spot_only]
}

run "h100_one_gpu_all_spot_accepted" {
  command = plan
  variables {
    accelerator_type = "nvidia-h100-80gb"
    spot             = true
    master_spot      = true
  }
  assert {
    condition     = output.machine_type == "a3-highgpu-1g" && output.scheduling["master"].provisioning_model == "SPOT"
    error_message = "1 x H100 on Spot should derive a3-highgpu-1g, got ${output.machine_type}"
  }
}

run "a3_machine_without_gpus_refused" {
  command = plan
  variables {
    use_gpu      = false
    machine_type = "a3-highgpu-8g"
  }
  expect_failures = [terraform_data.cpu_machine_family]
}
