# SSH sources and CIDR validation.

run "iap_range_added" {
  command = plan
  assert {
    condition     = jsonencode(output.ssh_source_ranges) == jsonencode(["203.0.113.7/32", "35.235.240.0/20"])
    error_message = "SSH sources should be the given ranges plus IAP's, got ${jsonencode(output.ssh_source_ranges)}"
  }
}

run "iap_off" {
  command = plan
  variables {
    iap_ssh = false
  }
  assert {
    condition     = jsonencode(output.ssh_source_ranges) == jsonencode(["203.0.113.7/32"])
    error_message = "without iap_ssh only the given ranges are allowed"
  }
}

run "iap_only" {
  command = plan
  variables {
    ssh_source_ranges = []
  }
  assert {
    condition     = jsonencode(output.ssh_source_ranges) == jsonencode(["35.235.240.0/20"])
    error_message = "with no ranges and iap_ssh, only IAP's range is allowed"
  }
}

run "no_ssh_source_at_all" {
  command = plan
  variables {
    ssh_source_ranges = []
    iap_ssh           = false
  }
  expect_failures = [terraform_data.ssh_reachable]
}

run "ssh_from_anywhere_refused" {
  command = plan
  variables {
    ssh_source_ranges = ["0.0.0.0/0"]
  }
  expect_failures = [terraform_data.ssh_from_anywhere]
}

run "ssh_from_anywhere_ipv6_refused" {
  command = plan
  variables {
    ssh_source_ranges = ["203.0.113.7/32", "::/0"]
  }
  expect_failures = [terraform_data.ssh_from_anywhere]
}

run "ssh_from_anywhere_with_override" {
  command = plan
  variables {
    ssh_source_ranges       = ["0.0.0.0/0"]
    allow_ssh_from_anywhere = true
  }
  assert {
    condition     = contains(output.ssh_source_ranges, "0.0.0.0/0")
    error_message = "allow_ssh_from_anywhere = true should let 0.0.0.0/0 through"
  }
}

run "ssh_range_not_a_cidr" {
  command = plan
  variables {
    ssh_source_ranges = ["203.0.113.300/32"]
  }
  expect_failures = [var.ssh_source_ranges]
}

run "ssh_range_bare_address" {
  command = plan
  variables {
    ssh_source_ranges = ["203.0.113.7"]
  }
  expect_failures = [var.ssh_source_ranges]
}

run "ssh_range_host_bits" {
  command = plan
  variables {
    ssh_source_ranges = ["203.0.113.7/24"]
  }
  expect_failures = [var.ssh_source_ranges]
}

run "ssh_range_ipv6_ok" {
  command = plan
  variables {
    ssh_source_ranges = ["2001:db8::/32"]
  }
  assert {
    condition     = contains(output.ssh_source_ranges, "2001:db8::/32")
    error_message = "an IPv6 CIDR should be accepted"
  }
}

run "subnet_cidr_invalid" {
  command = plan
  variables {
    subnet_cidr = "10.42.0.0/33"
  }
  expect_failures = [var.subnet_cidr]
}

run "subnet_cidr_host_bits" {
  command = plan
  variables {
    subnet_cidr = "10.42.0.1/24"
  }
  expect_failures = [var.subnet_cidr]
}

run "no_external_ip_needs_nat" {
  command = plan
  variables {
    external_ip = false
  }
  assert {
    condition     = output.nat == true
    error_message = "nodes without external IPs need Cloud NAT"
  }
}
