# Names, labels and the node list.

run "names_and_nodes" {
  command = plan
  variables {
    worker_count = 2
  }
  assert {
    condition     = jsonencode(output.node_names) == jsonencode(["demo-master", "demo-worker-0", "demo-worker-1"])
    error_message = "nodes should be master first, then workers: ${jsonencode(output.node_names)}"
  }
  assert {
    condition     = output.nodes["demo-master"].role == "master" && output.nodes["demo-worker-1"].role == "worker"
    error_message = "roles wrong"
  }
  assert {
    condition     = output.bucket_name == "demo-project-dtrain-demo"
    error_message = "derived bucket name wrong: ${output.bucket_name}"
  }
  assert {
    condition     = output.service_account_id == "dtrain-demo" && output.repository_id == "dtrain-demo"
    error_message = "service account / repository IDs wrong"
  }
}

run "single_node" {
  command = plan
  variables {
    worker_count = 0
  }
  assert {
    condition     = jsonencode(output.node_names) == jsonencode(["demo-master"])
    error_message = "worker_count = 0 should give only the master"
  }
}

run "labels_merge_and_dtrain_label_wins" {
  command = plan
  variables {
    labels = { "team" = "ml", "dtrain-cluster" = "spoofed" }
  }
  assert {
    condition     = jsonencode(output.labels) == jsonencode({ "dtrain-cluster" = "demo", "team" = "ml" })
    error_message = "labels should be var.labels with dtrain-cluster = cluster_name: ${jsonencode(output.labels)}"
  }
}

run "bucket_name_override" {
  command = plan
  variables {
    bucket_name = "my-checkpoints"
  }
  assert {
    condition     = output.bucket_name == "my-checkpoints"
    error_message = "bucket_name override ignored"
  }
}

run "longest_names_fit" {
  command = plan
  variables {
    project_id   = "a-project-id-of-thirty-chars-x"
    cluster_name = "a-cluster-name-23-chars"
  }
  assert {
    condition     = length(output.bucket_name) <= 63 && length(output.service_account_id) <= 30
    error_message = "longest project and cluster names must still give valid bucket and service account names"
  }
}
