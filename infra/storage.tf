resource "google_storage_bucket" "checkpoints" {
  #checkov:skip=CKV_GCP_62:Access logs need a second bucket per cluster; Cloud Audit Logs (Data Access) are GCP's recommended way to log object access.
  name          = module.plan.bucket_name
  location      = upper(var.region)
  storage_class = "STANDARD"
  force_destroy = var.force_destroy
  labels        = local.labels

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # An overwritten or deleted checkpoint stays recoverable as a noncurrent version for
  # bucket_lifecycle_days, then the rule below removes it. Live objects are never expired by a
  # rule: checkpoints and final models are what the cluster is for.
  versioning {
    enabled = true
  }

  # Soft delete off (retention 0; GCS's default is 7 days, and 0 or 7-90 days may be set:
  # https://cloud.google.com/storage/docs/soft-delete). Versioning above already keeps an overwritten
  # or deleted checkpoint for bucket_lifecycle_days; with soft delete on, every copy a lifecycle rule
  # deletes was billed 7 days more as well: an appended file's per-compose copy 1 + 7 days instead of
  # 1, an old checkpoint bucket_lifecycle_days + 7 (infra/README.md, "Storage", has the cost).
  soft_delete_policy {
    retention_duration_seconds = 0
  }

  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.bucket_lifecycle_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  # The files a run appends to while it trains (metrics.jsonl, events.jsonl, logs/*.log) grow by a
  # server-side compose every few seconds, and on a versioned bucket every compose leaves the previous
  # object behind as a noncurrent copy: thousands a day, each a full copy. Those copies are worth
  # nothing once the next append lands; keep them one day, not bucket_lifecycle_days. GCS versioning
  # is per bucket, so these objects cannot be kept out of it by name (docs/decisions.md, issue 22).
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = 1
      with_state                 = "ARCHIVED"
      matches_suffix             = ["metrics.jsonl", "events.jsonl", ".log"]
    }
    action {
      type = "Delete"
    }
  }

  # A checkpoint upload cut off by preemption leaves parts behind; drop them after a day.
  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }
}

# A bucket `dtrain down` kept (it holds the checkpoints) is adopted, not created again: GCS answers
# 409 "you already own it" to a create of a bucket that exists. `dtrain up` sets adopt_bucket when
# it finds the bucket labelled with this cluster's name; set it yourself after a `dtrain down`. An
# import block does nothing for a resource already in the state, so leaving it true is harmless.
import {
  for_each = var.adopt_bucket ? toset([module.plan.bucket_name]) : toset([])
  to       = google_storage_bucket.checkpoints
  id       = each.value
}

resource "google_artifact_registry_repository" "images" {
  #checkov:skip=CKV_GCP_84:Images are encrypted at rest with Google-managed keys; a KMS key per short-lived cluster adds key management for images that hold code, not data.
  location      = var.region
  repository_id = module.plan.repository_id
  description   = "Training images of dtrain cluster ${var.cluster_name}"
  format        = "DOCKER"
  labels        = local.labels
}
