# Every accelerator/machine combination GCP would refuse, and other bad input.

run "l4_on_n1_refused" {
  # The project's source guide put L4 on n1-standard-4; GCP refuses it (L4 exists only on G2).
  command = plan
  variables {
    machine_type = "n1-standard-4"
  }
  expect_failures = [terraform_data.gpu_machine_family]
}

run "t4_on_g2_refused" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    machine_type     = "g2-standard-8"
  }
  expect_failures = [terraform_data.gpu_machine_family]
}

run "t4_on_e2_refused" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    machine_type     = "e2-standard-4"
  }
  expect_failures = [terraform_data.gpu_machine_family]
}

run "l4_count_beyond_g2_type" {
  command = plan
  variables {
    machine_type  = "g2-standard-8"
    gpus_per_node = 2
  }
  expect_failures = [terraform_data.gpu_fixed_count]
}

run "l4_count_below_g2_type" {
  command = plan
  variables {
    machine_type  = "g2-standard-48"
    gpus_per_node = 1
  }
  expect_failures = [terraform_data.gpu_fixed_count]
}

run "l4_unknown_g2_type" {
  command = plan
  variables {
    machine_type = "g2-standard-6"
  }
  expect_failures = [terraform_data.gpu_fixed_count]
}

run "l4_three_gpus" {
  command = plan
  variables {
    gpus_per_node = 3
  }
  expect_failures = [terraform_data.gpu_count]
}

run "t4_three_gpus" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    gpus_per_node    = 3
    machine_type     = "n1-standard-8"
  }
  expect_failures = [terraform_data.gpu_count]
}

run "t4_eight_gpus" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    gpus_per_node    = 8
    machine_type     = "n1-standard-32"
  }
  expect_failures = [terraform_data.gpu_count]
}

run "t4_too_many_vcpus" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    machine_type     = "n1-standard-64"
  }
  expect_failures = [terraform_data.gpu_vcpus]
}

run "unknown_accelerator" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-k80"
  }
  expect_failures = [var.accelerator_type]
}

run "pd_standard_on_g2" {
  command = plan
  variables {
    disk_type = "pd-standard"
  }
  expect_failures = [terraform_data.disk]
}

# rules.json's boot_disk_types: A3 and C3 take no pd-standard either; N1 and E2 do.
run "pd_standard_on_a3" {
  command = plan
  variables {
    accelerator_type = "nvidia-h100-80gb"
    gpus_per_node    = 8
    disk_type        = "pd-standard"
  }
  expect_failures = [terraform_data.disk]
}

run "pd_standard_on_c3_cpu" {
  command = plan
  variables {
    use_gpu      = false
    machine_type = "c3-standard-8"
    disk_type    = "pd-standard"
  }
  expect_failures = [terraform_data.disk]
}

run "pd_standard_on_n1_t4_accepted" {
  command = plan
  variables {
    accelerator_type = "nvidia-tesla-t4"
    disk_type        = "pd-standard"
  }
  assert {
    condition     = output.machine_type == "n1-standard-4"
    error_message = "pd-standard on N1 should plan"
  }
}

run "pd_standard_on_e2_cpu_accepted" {
  command = plan
  variables {
    use_gpu   = false
    disk_type = "pd-standard"
  }
  assert {
    condition     = output.machine_type == "e2-medium"
    error_message = "pd-standard on E2 should plan"
  }
}

run "dlvm_disk_too_small" {
  command = plan
  variables {
    disk_size_gb = 30
  }
  expect_failures = [terraform_data.disk]
}

run "zone_outside_region" {
  command = plan
  variables {
    zone = "europe-west4-a"
  }
  expect_failures = [terraform_data.zone_in_region]
}

run "bad_ssh_key" {
  command = plan
  variables {
    ssh_public_key = "-----BEGIN OPENSSH PRIVATE KEY-----"
  }
  expect_failures = [var.ssh_public_key]
}

run "example_placeholder_key_refused" {
  # The key terraform.tfvars.example used to hold: well-formed enough for the pattern, but no real
  # key (67 base64 characters), so an unedited copy would have deployed a key nobody holds.
  command = plan
  variables {
    ssh_public_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExampleExampleExampleExampleExampleExample dtrain-demo"
  }
  expect_failures = [var.ssh_public_key]
}

run "example_placeholder_text_refused" {
  # What terraform.tfvars.example holds now: not a key line at all.
  command = plan
  variables {
    ssh_public_key = "REPLACE with the one line of ~/.ssh/dtrain-demo.pub"
  }
  expect_failures = [var.ssh_public_key]
}

run "rsa_key_accepted" {
  command = plan
  variables {
    ssh_public_key = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQDNRMBAnfJntnYqJ0oYi9G7Mddz0hYxibyw+WFrgbHJBX+aL/0pxn0vI4A/TAaCEE2elGFluwo3LWMszf8E69lIyndzoAgW9gohOsqkRgDJk5tdL9ICxBSV3iHUNsZN+CrwbqTZB71cUTlktSzgmiZUdUdtiQMmzFipDRJLx/b32oRLqjmPCcHy9Uga9LyAWxHpXFYo1BDHv9Of2wJqXANjU/Kj8Q3+6POOb8HyVI3+nGx8g6EPOKA1PzZ24ZrbrPfRk29y7Sd6e+ocIG0v7bcFmMKRZE0u6YQA/dkM5b+sDJQOhsYPkFRSVI3bMXnGjhR/P2lACzP8kJKBwj+jxlwt someone@laptop"
  }
  assert {
    condition     = output.machine_type == "g2-standard-8"
    error_message = "an RSA key must be accepted as it is"
  }
}

run "root_ssh_user" {
  command = plan
  variables {
    ssh_user = "root"
  }
  expect_failures = [var.ssh_user]
}

run "bad_cluster_name" {
  command = plan
  variables {
    cluster_name = "Demo_1"
  }
  expect_failures = [var.cluster_name]
}

run "bad_label" {
  command = plan
  variables {
    labels = { "Team" = "ml" }
  }
  expect_failures = [var.labels]
}
