# Spot scheduling: workers are Spot with spot = true; the master only with master_spot as well.

run "spot_gpu" {
  command = plan
  variables {
    spot = true
  }
  assert {
    condition     = output.scheduling.worker.provisioning_model == "SPOT" && output.scheduling.worker.preemptible
    error_message = "spot workers need provisioning_model SPOT and preemptible = true"
  }
  assert {
    condition     = output.scheduling.worker.automatic_restart == false && output.scheduling.worker.on_host_maintenance == "TERMINATE"
    error_message = "spot nodes cannot restart automatically and must terminate on maintenance"
  }
  assert {
    condition     = output.scheduling.worker.instance_termination_action == "STOP"
    error_message = "spot termination action should default to STOP"
  }
}

run "spot_workers_on_demand_master" {
  command = plan
  variables {
    spot = true
  }
  assert {
    condition     = output.scheduling.master.provisioning_model == "STANDARD" && output.scheduling.master.preemptible == false
    error_message = "with master_spot = false (the default) the master is on-demand even when the workers are Spot"
  }
  assert {
    condition     = output.scheduling.master.automatic_restart && output.scheduling.master.instance_termination_action == null
    error_message = "an on-demand master restarts automatically and has no termination action"
  }
  assert {
    condition     = output.scheduling.master.on_host_maintenance == "TERMINATE"
    error_message = "a GPU master still terminates on host maintenance (GPU VMs cannot live-migrate)"
  }
}

run "spot_master_when_asked" {
  command = plan
  variables {
    spot        = true
    master_spot = true
  }
  assert {
    condition     = output.scheduling.master == output.scheduling.worker && output.scheduling.master.provisioning_model == "SPOT"
    error_message = "master_spot = true makes the master Spot like the workers"
  }
}

run "master_spot_needs_spot" {
  command = plan
  variables {
    use_gpu     = false
    master_spot = true
  }
  assert {
    condition     = output.scheduling.master.provisioning_model == "STANDARD" && output.scheduling.master.on_host_maintenance == "MIGRATE"
    error_message = "master_spot alone (spot = false) leaves every node on-demand"
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
    condition     = output.scheduling.worker.on_host_maintenance == "TERMINATE" && output.scheduling.worker.instance_termination_action == "DELETE"
    error_message = "spot CPU nodes terminate on maintenance and honour the termination action"
  }
  assert {
    condition     = output.scheduling.master.on_host_maintenance == "MIGRATE"
    error_message = "an on-demand CPU master live-migrates"
  }
}

run "standard_has_no_termination_action" {
  command = plan
  assert {
    condition     = alltrue([for s in values(output.scheduling) : s.instance_termination_action == null && s.preemptible == false])
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
