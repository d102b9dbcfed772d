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
# cluster when it is idle, with this identity. A custom role holds only what it calls; the bindings' IAM
# conditions limit the instance permissions to this cluster's VMs by their exact names (a name prefix
# would also match cluster "demo-2"'s VMs from cluster "demo"). Listing instances and reading zone
# operations are checked on the project/zone, not on an instance: the condition lets them through, and
# the role grants nothing else there. docs/decisions.md says why not roles/compute.instanceAdmin.v1.
#
# The role id carries a random suffix kept in the state while the cluster exists: IAM keeps a deleted
# custom role's id for 37 days (7 in which it can be undeleted, then 30 until it is purged) and refuses
# to create a role with that id meanwhile, so an id fixed by the cluster name would make `dtrain up` fail
# for weeks after `dtrain down`. After a `down` (the state is destroyed with it) the next `up` draws a new id.
#
# The suffix comes from Terraform's own terraform_data (no provider to download): 8 hex digits of a UUID
# drawn when the resource is created, kept as is afterwards (ignore_changes), and drawn anew when the
# project or the cluster name changes or after a `down`.
resource "terraform_data" "service_role" {
  input            = substr(replace(uuid(), "-", ""), 0, 8)
  triggers_replace = [var.project_id, var.cluster_name]
  lifecycle {
    ignore_changes = [input]
  }
}

resource "google_project_iam_custom_role" "service" {
  project     = var.project_id
  role_id     = "${replace(module.plan.service_account_id, "-", "_")}_service_${terraform_data.service_role.output}"
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

# One binding per 12 VM names (the plan module's service_conditions): an IAM condition holds at most 12
# logical operators, and one `||` per name would pass that at 13 nodes (12 workers).
resource "google_project_iam_member" "node_service" {
  for_each = module.plan.service_conditions
  project  = var.project_id
  role     = google_project_iam_custom_role.service.name
  member   = "serviceAccount:${google_service_account.node.email}"
  condition {
    title       = "dtrain-${var.cluster_name}-instances-${each.key}"
    description = "VMs of dtrain cluster ${var.cluster_name} (binding ${each.key} of the cluster service)"
    expression  = each.value
  }
}
