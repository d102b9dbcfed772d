# The nodes' own identity; never the default compute service account (which holds Editor on the
# project in many organisations). It gets object access to this cluster's bucket and read access
# to this cluster's repository, each granted on that resource, not on the project.
resource "google_service_account" "node" {
  account_id   = module.plan.service_account_id
  display_name = "dtrain ${var.cluster_name} nodes"
  description  = "Identity of the nodes of dtrain cluster ${var.cluster_name}"
}

# Read, write and delete checkpoints (rank 0 writes, every rank reads, old steps are pruned).
resource "google_storage_bucket_iam_member" "node_objects" {
  bucket = google_storage_bucket.checkpoints.name
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.node.email}"
}

# Pull training images; pushing is done by `dtrain build` with the user's own credentials.
resource "google_artifact_registry_repository_iam_member" "node_reader" {
  project    = google_artifact_registry_repository.images.project
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.node.email}"
}

# Only for users who install the Ops Agent: the startup script, dtrain and the guest attributes
# need neither role (guest attributes go through the metadata server, not IAM).
resource "google_project_iam_member" "node_observability" {
  for_each = var.observability_roles ? toset(["roles/logging.logWriter", "roles/monitoring.metricWriter"]) : toset([])
  project  = var.project_id
  role     = each.value
  member   = "serviceAccount:${google_service_account.node.email}"
}

# The cluster service on the master (docs/service.md) starts preempted nodes and stops (or deletes) the
# cluster when it is idle, with this identity. A custom role holds only what it calls; the binding's IAM
# condition limits the instance permissions to this cluster's VMs by their exact names (a name prefix
# would also match cluster "demo-2"'s VMs from cluster "demo"). Listing instances and reading zone
# operations are checked on the project/zone, not on an instance: the condition lets them through, and
# the role grants nothing else there. docs/decisions.md says why not roles/compute.instanceAdmin.v1.
resource "google_project_iam_custom_role" "service" {
  project     = var.project_id
  role_id     = replace("${module.plan.service_account_id}_service", "-", "_")
  title       = "dtrain ${var.cluster_name} cluster service"
  description = "Start, stop and delete the VMs of dtrain cluster ${var.cluster_name}; read their operations"
  permissions = [
    "compute.instances.delete",
    "compute.instances.get",
    "compute.instances.list",
    "compute.instances.start",
    "compute.instances.stop",
    "compute.zoneOperations.get",
    "compute.zoneOperations.list",
  ]
}

resource "google_project_iam_member" "node_service" {
  project = var.project_id
  role    = google_project_iam_custom_role.service.name
  member  = "serviceAccount:${google_service_account.node.email}"
  condition {
    title       = "dtrain-${var.cluster_name}-instances"
    description = "Only the VMs of dtrain cluster ${var.cluster_name}"
    expression = join(" || ", concat(
      ["resource.type != \"compute.googleapis.com/Instance\""],
      [for name in module.plan.node_names : "resource.name == \"projects/${var.project_id}/zones/${var.zone}/instances/${name}\""],
    ))
  }
}
