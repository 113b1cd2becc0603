variable "project_id" {
  description = "Google Cloud project that owns every resource."
  type        = string
}

variable "region" {
  description = "Region of the network, the bucket and (for a regional cluster) the control plane."
  type        = string
  default     = "us-central1"
}

variable "zone" {
  description = "Zone of the GPU pool (T4s are per zone; keeping the pool in one zone keeps NCCL traffic inside it)."
  type        = string
  default     = "us-central1-a"
  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone must look like us-central1-a."
  }
}

variable "regional_cluster" {
  description = "true: regional control plane (more available, costs more); false: zonal control plane in var.zone."
  type        = bool
  default     = false
}

variable "name" {
  description = "Prefix of every resource name (cluster, network, pools, service account)."
  type        = string
  default     = "shardlab"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,18}[a-z0-9]$", var.name))
    error_message = "name must be 3-20 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "labels" {
  description = "Labels put on the cluster, node pools and bucket (cost tracking)."
  type        = map(string)
  default     = { app = "shardlab", managed-by = "terraform" }
}

variable "release_channel" {
  description = "GKE release channel."
  type        = string
  default     = "REGULAR"
  validation {
    condition     = contains(["RAPID", "REGULAR", "STABLE"], var.release_channel)
    error_message = "release_channel must be RAPID, REGULAR or STABLE."
  }
}

variable "subnet_cidr" {
  description = "Primary range of the subnet (node addresses)."
  type        = string
  default     = "10.20.0.0/20"
}

variable "pods_cidr" {
  description = "Secondary range for pod addresses (VPC-native)."
  type        = string
  default     = "10.24.0.0/14"
}

variable "services_cidr" {
  description = "Secondary range for Service addresses."
  type        = string
  default     = "10.28.0.0/20"
}

variable "master_cidr" {
  description = "/28 range for the private control plane endpoint."
  type        = string
  default     = "172.16.0.0/28"
}

variable "master_authorized_cidrs" {
  description = "Networks allowed to reach the control plane (e.g. your office or Cloud Shell egress). Empty: only from inside the VPC."
  type        = list(object({ cidr = string, name = string }))
  default     = []
}

variable "gpu_machine_type" {
  description = "Machine type of the T4 pool. T4s attach only to N1 machines."
  type        = string
  default     = "n1-standard-8"
  validation {
    condition     = can(regex("^n1-", var.gpu_machine_type))
    error_message = "nvidia-tesla-t4 GPUs attach only to N1 machine types (n1-*)."
  }
}

variable "gpus_per_node" {
  description = "T4s per node (N1 takes 1, 2 or 4). The job's --gpus-per-node must not exceed this."
  type        = number
  default     = 1
  validation {
    condition     = contains([1, 2, 4], var.gpus_per_node)
    error_message = "gpus_per_node must be 1, 2 or 4 for T4 on N1."
  }
}

variable "gpu_pool_max_nodes" {
  description = "Autoscaler ceiling of the T4 pool (the pool scales from 0). The job's --nodes must fit."
  type        = number
  default     = 2
  validation {
    condition     = var.gpu_pool_max_nodes >= 1
    error_message = "gpu_pool_max_nodes must be at least 1."
  }
}

variable "gpu_spot" {
  description = "Spot T4 nodes: much cheaper, can be preempted (the Job's podFailurePolicy does not count that as a failure; training resumes from the last checkpoint)."
  type        = bool
  default     = true
}

variable "gpu_driver_version" {
  description = "GPU driver GKE installs on the T4 nodes: DEFAULT or LATEST."
  type        = string
  default     = "DEFAULT"
  validation {
    condition     = contains(["DEFAULT", "LATEST"], var.gpu_driver_version)
    error_message = "gpu_driver_version must be DEFAULT or LATEST."
  }
}

variable "gpu_disk_size_gb" {
  description = "Boot disk of a T4 node (the CUDA PyTorch image is several GB)."
  type        = number
  default     = 100
}

variable "system_machine_type" {
  description = "Machine type of the small CPU pool that runs system pods."
  type        = string
  default     = "e2-standard-2"
}

variable "system_pool_nodes" {
  description = "Nodes per zone of the system pool."
  type        = number
  default     = 1
}

variable "bucket_name" {
  description = "Checkpoint/data bucket name (globally unique). Empty: <project_id>-<name>-data."
  type        = string
  default     = ""
}

variable "bucket_force_destroy" {
  description = "Allow `terraform destroy` to delete a bucket that still holds checkpoints."
  type        = bool
  default     = false
}

variable "bucket_noncurrent_days" {
  description = "Days to keep overwritten/deleted object versions (versioning is on)."
  type        = number
  default     = 7
}

variable "k8s_namespace" {
  description = "Namespace of the training job (shardlab render k8s --namespace)."
  type        = string
  default     = "shardlab"
}

variable "k8s_service_account" {
  description = "Kubernetes service account of the training pods (shardlab render k8s --service-account)."
  type        = string
  default     = "shardlab-trainer"
}

variable "enable_binary_authorization" {
  description = "Enforce Binary Authorization on the cluster (needs a policy in the project)."
  type        = bool
  default     = false
}
