# Spot scheduling.

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
