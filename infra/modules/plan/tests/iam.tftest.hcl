# The cluster service's IAM conditions (infra/iam.tf binds one per entry of service_conditions). An IAM
# condition may hold at most 12 logical operators (&&, ||, !); each entry must stay within that, and
# together they must name every node exactly once, at any worker count up to the limit.

run "service_conditions_at_the_worker_limit" {
  command = plan
  variables {
    worker_count = 63
  }
  assert {
    condition     = length(output.service_conditions) == 6
    error_message = "64 nodes should make 6 bindings of at most 12 names, got ${length(output.service_conditions)}"
  }
  assert {
    condition     = alltrue([for e in values(output.service_conditions) : length(regexall("\\|\\||&&|![^=]", e)) <= 12])
    error_message = "a condition has more than 12 logical operators: ${jsonencode([for e in values(output.service_conditions) : length(regexall("\\|\\||&&|![^=]", e))])}"
  }
  assert {
    condition     = jsonencode(sort(flatten([for e in values(output.service_conditions) : regexall("/instances/([a-z0-9-]+)\"", e)]))) == jsonencode(sort(output.node_names))
    error_message = "the conditions should name every node exactly once"
  }
  assert {
    condition     = alltrue([for e in values(output.service_conditions) : startswith(e, "resource.type != \"compute.googleapis.com/Instance\" || ")])
    error_message = "each condition must let the project-level calls (list, zone operations) through"
  }
  assert {
    condition     = alltrue([for e in values(output.service_conditions) : !strcontains(e, "startsWith")])
    error_message = "a name prefix would reach other clusters' VMs"
  }
}

run "service_conditions_small_cluster" {
  command = plan
  variables {
    worker_count = 1
  }
  assert {
    condition     = jsonencode(output.service_conditions) == jsonencode({ "0" = "resource.type != \"compute.googleapis.com/Instance\" || resource.name == \"projects/demo-project/zones/us-central1-a/instances/demo-master\" || resource.name == \"projects/demo-project/zones/us-central1-a/instances/demo-worker-0\"" })
    error_message = "a 2-node cluster should have one binding naming both VMs: ${jsonencode(output.service_conditions)}"
  }
}

run "service_conditions_at_the_boundary" {
  command = plan
  variables {
    worker_count = 12
  }
  assert {
    condition     = length(output.service_conditions) == 2 && length(regexall("\\|\\|", output.service_conditions["1"])) == 1
    error_message = "13 nodes should make a binding of 12 names and one of 1: ${jsonencode(output.service_conditions)}"
  }
}
