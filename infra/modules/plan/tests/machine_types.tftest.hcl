# Accelerator -> machine family mapping, and the accepted explicit machine types.

run "l4_one_gpu_derives_g2_standard_8" {
  command = plan
  assert {
    condition     = output.machine_type == "g2-standard-8" && output.machine_family == "g2"
    error_message = "1 x L4 should derive g2-standard-8, got ${output.machine_type}"
  }
  assert {
    condition     = output.accelerator == "nvidia-l4" && output.gpus == 1
    error_message = "accelerator/gpus wrong"
  }
  assert {
    condition     = length(output.guest_accelerators) == 1 && output.guest_accelerators[0].type == "nvidia-l4" && output.guest_accelerators[0].count == 1
    error_message = "guest_accelerators should be one nvidia-l4 x1 block"
  }
}

run "l4_counts_derive_g2_types" {
  command = plan
  variables {
    gpus_per_node = 4
  }
  assert {
    condition     = output.machine_type == "g2-standard-48"
    error_message = "4 x L4 should derive g2-standard-48, got ${output.machine_type}"
  }
}

run "l4_two_gpus_g2_standard_24" {
  command = plan
  variables {
    gpus_per_node = 2
  }
  assert {
    condition     = output.machine_type == "g2-standard-24"
    error_message = "2 x L4 should derive g2-standard-24, got ${output.machine_type}"
  }
}

run "l4_eight_gpus_g2_standard_96" {
  command = plan
  variables {
    gpus_per_node = 8
  }
  assert {
    condition     = output.machine_type == "g2-standard-96" && output.guest_accelerators[0].count == 8
    error_message = "8 x L4 should derive g2-standard-96, got ${output.machine_type}"
  }
}

run "l4_explicit_g2_standard_4_accepted" {
  command = plan
  variables {
    machine_type = "g2-standard-4"
  }
  assert {
    condition     = output.machine_type == "g2-standard-4"
    error_message = "explicit g2-standard-4 with 1 L4 should be kept"
  }
}

run "t4_one_gpu_derives_n1_standard_4" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
  }
  assert {
    condition     = output.machine_type == "n1-standard-4" && output.machine_family == "n1"
    error_message = "1 x T4 should derive n1-standard-4, got ${output.machine_type}"
  }
  assert {
    condition     = length(output.guest_accelerators) == 1 && output.guest_accelerators[0].type == "nvidia-tesla-t4" && output.guest_accelerators[0].count == 1
    error_message = "guest_accelerators should be one nvidia-tesla-t4 x1 block"
  }
}

run "t4_four_gpus_derives_n1_standard_16" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    gpus_per_node    = 4
  }
  assert {
    condition     = output.machine_type == "n1-standard-16" && output.gpus == 4
    error_message = "4 x T4 should derive n1-standard-16, got ${output.machine_type}"
  }
}

run "t4_explicit_n1_highmem_accepted" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    gpus_per_node    = 2
    machine_type     = "n1-highmem-16"
  }
  assert {
    condition     = output.machine_type == "n1-highmem-16"
    error_message = "n1-highmem-16 with 2 x T4 is valid and should be kept"
  }
}

run "gpu_image_is_deep_learning_vm" {
  command = plan
  assert {
    condition     = output.image == "projects/deeplearning-platform-release/global/images/family/common-cu129-ubuntu-2404-nvidia-580"
    error_message = "GPU nodes should boot the DLVM common-cu129 nvidia-580 family, got ${output.image}"
  }
  assert {
    condition     = output.secure_boot == false
    error_message = "Secure Boot should default to off on GPU nodes"
  }
}

run "image_overrides_win" {
  command = plan
  variables {
    image_project = "my-images"
    image_family  = "my-gpu-family"
  }
  assert {
    condition     = output.image == "projects/my-images/global/images/family/my-gpu-family"
    error_message = "image_project/image_family overrides ignored: ${output.image}"
  }
}
