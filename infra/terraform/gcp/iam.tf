data "google_project" "this" {
  project_id = var.project_id
}

# Nodes run as a dedicated account that can only write logs/metrics and pull images,
# instead of the Compute Engine default account (Editor on the whole project).
resource "google_service_account" "nodes" {
  account_id   = "${var.name}-nodes"
  display_name = "shardlab GKE nodes"
}

resource "google_project_iam_member" "nodes" {
  for_each = toset([
    "roles/container.defaultNodeServiceAccount",
    "roles/artifactregistry.reader",
  ])
  project = var.project_id
  role    = each.value
  member  = "serviceAccount:${google_service_account.nodes.email}"
}

# The training pods' Kubernetes service account gets object access to the bucket through
# workload identity federation: no Google service account, no key.
locals {
  training_principal = join("", [
    "principal://iam.googleapis.com/projects/${data.google_project.this.number}",
    "/locations/global/workloadIdentityPools/${var.project_id}.svc.id.goog",
    "/subject/ns/${var.k8s_namespace}/sa/${var.k8s_service_account}",
  ])
}

resource "google_storage_bucket_iam_member" "training" {
  bucket = google_storage_bucket.data.name
  role   = "roles/storage.objectUser"
  member = local.training_principal
}

# The GCS FUSE sidecar lists the bucket before mounting it.
resource "google_storage_bucket_iam_member" "training_list" {
  bucket = google_storage_bucket.data.name
  role   = "roles/storage.legacyBucketReader"
  member = local.training_principal
}
