locals {
  bucket_name = var.bucket_name != "" ? var.bucket_name : "${var.project_id}-${var.name}-data"
}

# Checkpoints and data: outlive pods and nodes (spot preemption), mounted in pods by GCS FUSE.
resource "google_storage_bucket" "data" {
  name                        = local.bucket_name
  location                    = var.region # same region as the nodes: no egress cost, low latency
  storage_class               = "STANDARD"
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = var.bucket_force_destroy
  labels                      = var.labels

  versioning {
    enabled = true
  }

  # versioning keeps every overwritten checkpoint shard: drop old versions after a while
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.bucket_noncurrent_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  logging {
    log_bucket = google_storage_bucket.access_logs.name
  }
}

# Access logs of the data bucket (who read or wrote checkpoints).
resource "google_storage_bucket" "access_logs" {
  #checkov:skip=CKV_GCP_62:this is the log sink itself; logging it into itself would loop
  name                        = "${local.bucket_name}-logs"
  location                    = var.region
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  force_destroy               = var.bucket_force_destroy
  labels                      = var.labels

  versioning {
    enabled = true
  }

  lifecycle_rule {
    condition {
      age = 90
    }
    action {
      type = "Delete"
    }
  }
}
