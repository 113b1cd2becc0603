locals {
  # zonal: control plane and nodes in var.zone; regional: control plane across the region,
  # GPU nodes still pinned to var.zone (T4 capacity is per zone; NCCL stays inside it)
  cluster_location = var.regional_cluster ? var.region : var.zone
}

resource "google_container_cluster" "this" {
  #checkov:skip=CKV_GCP_65:Google Groups for RBAC needs a Workspace/Cloud Identity organization; not every project has one
  #checkov:skip=CKV_GCP_66:Binary Authorization is a variable (enable_binary_authorization); it needs a project policy first
  #checkov:skip=CKV_GCP_12:network policy is enforced by Dataplane V2 (datapath_provider = ADVANCED_DATAPATH), not by the Calico addon this check looks for
  #checkov:skip=CKV_GCP_24:PodSecurityPolicy was removed from Kubernetes in 1.25; pods are hardened by their own securityContext
  name     = "${var.name}-cluster"
  location = local.cluster_location

  # node pools are managed below; the default pool would run as the default service account
  remove_default_node_pool = true
  initial_node_count       = 1
  deletion_protection      = false

  network         = google_compute_network.vpc.id
  subnetwork      = google_compute_subnetwork.nodes.id
  networking_mode = "VPC_NATIVE"
  ip_allocation_policy {
    cluster_secondary_range_name  = "pods"
    services_secondary_range_name = "services"
  }
  datapath_provider = "ADVANCED_DATAPATH"

  private_cluster_config {
    enable_private_nodes    = true
    enable_private_endpoint = false
    master_ipv4_cidr_block  = var.master_cidr
  }

  master_authorized_networks_config {
    dynamic "cidr_blocks" {
      for_each = var.master_authorized_cidrs
      content {
        cidr_block   = cidr_blocks.value.cidr
        display_name = cidr_blocks.value.name
      }
    }
  }

  release_channel {
    channel = var.release_channel
  }

  workload_identity_config {
    workload_pool = "${var.project_id}.svc.id.goog"
  }

  addons_config {
    gcs_fuse_csi_driver_config {
      enabled = true
    }
    http_load_balancing {
      disabled = true # a training cluster serves nothing
    }
  }

  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  enable_shielded_nodes       = true
  enable_intranode_visibility = true
  enable_legacy_abac          = false

  binary_authorization {
    evaluation_mode = var.enable_binary_authorization ? "PROJECT_SINGLETON_POLICY_ENFORCE" : "DISABLED"
  }

  logging_config {
    enable_components = ["SYSTEM_COMPONENTS", "WORKLOADS"]
  }
  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]
  }

  resource_labels = var.labels

  node_config {
    # only the throw-away default pool uses this; it is deleted right after creation
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    metadata = {
      disable-legacy-endpoints = "true"
    }
  }
}

# A small CPU pool for system pods (DNS, the GCS FUSE driver, metrics), so that the T4 pool
# can scale to zero when no job runs.
resource "google_container_node_pool" "system" {
  name       = "${var.name}-system"
  cluster    = google_container_cluster.this.id
  location   = local.cluster_location
  node_count = var.system_pool_nodes

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.system_machine_type
    image_type      = "COS_CONTAINERD"
    disk_size_gb    = 50
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = var.labels
    resource_labels = var.labels

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    metadata = {
      disable-legacy-endpoints = "true"
    }
  }
}

resource "google_container_node_pool" "t4" {
  name     = "${var.name}-t4"
  cluster  = google_container_cluster.this.id
  location = local.cluster_location
  # one zone: T4s are zonal, and inter-zone traffic would slow (and bill) every all-gather
  node_locations = [var.zone]

  initial_node_count = 0
  autoscaling {
    min_node_count = 0 # nothing to pay for between jobs
    max_node_count = var.gpu_pool_max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.gpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = var.gpu_disk_size_gb
    spot            = var.gpu_spot
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = merge(var.labels, { "shardlab/pool" = "t4" })
    resource_labels = var.labels

    guest_accelerator {
      type  = "nvidia-tesla-t4"
      count = var.gpus_per_node
      gpu_driver_installation_config {
        gpu_driver_version = var.gpu_driver_version
      }
    }

    # keep everything that does not ask for a GPU off these expensive nodes
    taint {
      key    = "nvidia.com/gpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }

    gvnic {
      enabled = true
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }
    workload_metadata_config {
      mode = "GKE_METADATA"
    }
    metadata = {
      disable-legacy-endpoints = "true"
    }
  }
}
