# ------------------------------------------------------------------ project and naming

variable "project_id" {
  description = "Nebius project that owns every resource (project-...). The project fixes the region."
  type        = string
  validation {
    condition     = can(regex("^project-[a-z0-9]+$", var.project_id))
    error_message = "project_id must look like project-e00abc123 (the ID, not the project's name)."
  }
}

variable "name" {
  description = "Prefix of every resource name (network, nodes, disks, filesystem)."
  type        = string
  default     = "shardlab"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,18}[a-z0-9]$", var.name))
    error_message = "name must be 3-20 lower-case letters, digits or '-', starting with a letter."
  }
}

variable "labels" {
  description = "Labels put on every resource that takes them (cost tracking)."
  type        = map(string)
  default     = { app = "shardlab", managed-by = "terraform" }
}

# ------------------------------------------------------------------ network

variable "network_cidr" {
  description = "Private IPv4 range of the cluster's own network (a pool created for it)."
  type        = string
  default     = "10.60.0.0/16"
  validation {
    condition     = can(cidrnetmask(var.network_cidr)) && tonumber(split("/", var.network_cidr)[1]) <= 24
    error_message = "network_cidr must be an IPv4 CIDR block of /24 or larger, e.g. 10.60.0.0/16."
  }
  validation {
    # private ranges only: these nodes must never be given addresses that belong to someone else
    condition = can(cidrnetmask(var.network_cidr)) && anytrue([
      for private in ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"] :
      tonumber(split("/", var.network_cidr)[1]) >= tonumber(split("/", private)[1]) &&
      cidrhost("${split("/", var.network_cidr)[0]}/${split("/", private)[1]}", 0) == cidrhost(private, 0)
    ])
    error_message = "network_cidr must lie inside 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16."
  }
}

variable "subnet_cidr" {
  description = "Range of the nodes' subnet; must lie inside network_cidr."
  type        = string
  default     = "10.60.0.0/24"
  validation {
    condition     = can(cidrnetmask(var.subnet_cidr)) && tonumber(split("/", var.subnet_cidr)[1]) <= 28
    error_message = "subnet_cidr must be an IPv4 CIDR block of /28 or larger, e.g. 10.60.0.0/24."
  }
  validation {
    # the subnet's base address, masked with the network's prefix, must be the network's base
    condition = can(cidrnetmask(var.subnet_cidr)) && can(cidrnetmask(var.network_cidr)) && (
      tonumber(split("/", var.subnet_cidr)[1]) >= tonumber(split("/", var.network_cidr)[1]) &&
      cidrhost("${split("/", var.subnet_cidr)[0]}/${split("/", var.network_cidr)[1]}", 0) == cidrhost(var.network_cidr, 0)
    )
    error_message = "subnet_cidr must lie inside network_cidr."
  }
}

variable "ssh_allowed_cidrs" {
  description = "Who may SSH to the node(s) with a public address: your address as /32 (at most 8 blocks, a limit of one security rule)."
  type        = list(string)
  validation {
    condition     = length(var.ssh_allowed_cidrs) >= 1 && length(var.ssh_allowed_cidrs) <= 8
    error_message = "ssh_allowed_cidrs needs 1 to 8 CIDR blocks."
  }
  validation {
    condition     = alltrue([for c in var.ssh_allowed_cidrs : can(cidrnetmask(c))])
    error_message = "every ssh_allowed_cidrs entry must be an IPv4 CIDR block such as 203.0.113.7/32."
  }
  validation {
    condition     = alltrue([for c in var.ssh_allowed_cidrs : !can(cidrnetmask(c)) || tonumber(split("/", c)[1]) >= 8])
    error_message = "ssh_allowed_cidrs must not open SSH to the whole internet (no /0../7 blocks): list your own addresses."
  }
}

variable "egress_cidrs" {
  description = "Where the nodes may open connections outside the cluster (package index, git host). Narrow it to your mirrors if you have them."
  type        = list(string)
  default     = ["0.0.0.0/0"]
  validation {
    condition     = length(var.egress_cidrs) >= 1 && length(var.egress_cidrs) <= 8 && alltrue([for c in var.egress_cidrs : can(cidrnetmask(c))])
    error_message = "egress_cidrs needs 1 to 8 IPv4 CIDR blocks."
  }
}

variable "public_ip_all_nodes" {
  description = "Give every node a public address. false: only node 0 has one; reach the others through it (ssh -J)."
  type        = bool
  default     = false
}

# ------------------------------------------------------------------ nodes

variable "node_count" {
  description = "GPU VMs in the cluster (torchrun --nnodes)."
  type        = number
  default     = 2
  validation {
    condition     = var.node_count >= 1 && var.node_count <= 64 && floor(var.node_count) == var.node_count
    error_message = "node_count must be a whole number from 1 to 64."
  }
}

variable "gpu_platform" {
  description = "Compute platform of the nodes: gpu-h100-sxm (H100), gpu-h200-sxm (H200), ... (Nebius docs: types of virtual machines)."
  type        = string
  default     = "gpu-h100-sxm"
  validation {
    condition     = can(regex("^gpu-[a-z0-9]+(-[a-z0-9]+)*$", var.gpu_platform))
    error_message = "gpu_platform must be a GPU platform name such as gpu-h100-sxm."
  }
}

variable "gpu_preset" {
  description = "Preset of the nodes: <G>gpu-<C>vcpu-<M>gb. G becomes torchrun --nproc-per-node. Only 8-GPU presets join an InfiniBand GPU cluster."
  type        = string
  default     = "8gpu-128vcpu-1600gb"
  validation {
    condition     = can(regex("^[1-9][0-9]*gpu-[1-9][0-9]*vcpu-[1-9][0-9]*gb$", var.gpu_preset))
    error_message = "gpu_preset must look like 8gpu-128vcpu-1600gb or 1gpu-16vcpu-200gb."
  }
}

variable "infiniband_fabric" {
  description = "InfiniBand fabric of the GPU cluster (e.g. fabric-3); it depends on region and platform. Empty: no GPU cluster, nodes talk over Ethernet only."
  type        = string
  default     = ""
  validation {
    condition     = var.infiniband_fabric == "" || can(regex("^[a-z0-9][a-z0-9-]*[a-z0-9]$", var.infiniband_fabric))
    error_message = "infiniband_fabric must be a fabric name such as fabric-3, or empty."
  }
  validation {
    # Nebius adds only VMs with all 8 GPUs of a host to an InfiniBand GPU cluster
    condition     = var.infiniband_fabric == "" || startswith(var.gpu_preset, "8gpu-")
    error_message = "an InfiniBand GPU cluster takes only 8-GPU presets: set infiniband_fabric = \"\" or an 8gpu-* gpu_preset."
  }
}

variable "preemptible" {
  description = "Preemptible VMs: cheaper, stopped (SIGTERM, then 60 s) when capacity is needed. Fixed at creation. Training resumes from the newest checkpoint on the shared filesystem."
  type        = bool
  default     = false
}

variable "image_family" {
  description = "Boot image family with the NVIDIA driver and CUDA preinstalled. Its driver must be new enough for the torch wheel you install."
  type        = string
  default     = "ubuntu24.04-cuda13.0"
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9.-]*[a-z0-9]$", var.image_family))
    error_message = "image_family must be an image family name such as ubuntu24.04-cuda13.0."
  }
}

variable "boot_disk_type" {
  description = "Boot disk type. The venv (torch with its CUDA libraries) lives here."
  type        = string
  default     = "NETWORK_SSD"
  validation {
    condition     = contains(["NETWORK_SSD", "NETWORK_SSD_NON_REPLICATED", "NETWORK_SSD_IO_M3", "NETWORK_HDD"], var.boot_disk_type)
    error_message = "boot_disk_type must be NETWORK_SSD, NETWORK_SSD_NON_REPLICATED, NETWORK_SSD_IO_M3 or NETWORK_HDD."
  }
}

variable "boot_disk_size_gib" {
  description = "Boot disk size per node in GiB (image, venv ~10 GiB, pip cache)."
  type        = number
  default     = 200
  validation {
    condition     = var.boot_disk_size_gib >= 64 && floor(var.boot_disk_size_gib) == var.boot_disk_size_gib
    error_message = "boot_disk_size_gib must be a whole number of at least 64."
  }
  validation {
    condition     = var.boot_disk_type != "NETWORK_SSD_NON_REPLICATED" || var.boot_disk_size_gib % 93 == 0
    error_message = "NETWORK_SSD_NON_REPLICATED disks come in multiples of 93 GiB."
  }
}

# ------------------------------------------------------------------ shared filesystem

variable "filesystem_type" {
  description = "Type of the shared filesystem that holds the source, the wheelhouse, data, checkpoints and run outputs."
  type        = string
  default     = "NETWORK_SSD"
  validation {
    condition     = contains(["NETWORK_SSD", "NETWORK_HDD"], var.filesystem_type)
    error_message = "filesystem_type must be NETWORK_SSD or NETWORK_HDD."
  }
}

variable "filesystem_size_gib" {
  description = "Size of the shared filesystem in GiB (torch wheels ~5 GiB; a GPT-2-small FSDP checkpoint ~1.5 GiB x checkpoint.keep_last)."
  type        = number
  default     = 512
  validation {
    condition     = var.filesystem_size_gib >= 64 && floor(var.filesystem_size_gib) == var.filesystem_size_gib
    error_message = "filesystem_size_gib must be a whole number of at least 64."
  }
}

variable "filesystem_forbid_deletion" {
  description = "Refuse to delete the shared filesystem (checkpoints!) on destroy; set false before `terraform destroy` to remove it."
  type        = bool
  default     = false
}

variable "existing_filesystem_id" {
  description = "Attach this shared filesystem (computefilesystem-...) instead of creating one, so data and checkpoints outlive the cluster."
  type        = string
  default     = ""
  validation {
    condition     = var.existing_filesystem_id == "" || can(regex("^computefilesystem-[a-z0-9]+$", var.existing_filesystem_id))
    error_message = "existing_filesystem_id must be a filesystem ID (computefilesystem-...) or empty."
  }
}

variable "shared_mount_path" {
  description = "Where the shared filesystem is mounted on every node (the same path everywhere)."
  type        = string
  default     = "/mnt/shardlab"
  validation {
    condition     = can(regex("^(/[A-Za-z0-9._-]+)+$", var.shared_mount_path)) && !contains(["/home", "/opt", "/usr", "/var", "/etc", "/tmp"], var.shared_mount_path)
    error_message = "shared_mount_path must be an absolute path of letters, digits, '.', '_', '-' that does not hide a system directory."
  }
}

# ------------------------------------------------------------------ login and software

variable "ssh_user" {
  description = "Login user created on every node (owns the shared filesystem's top directory)."
  type        = string
  default     = "shardlab"
  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,30}$", var.ssh_user)) && var.ssh_user != "root"
    error_message = "ssh_user must be a Linux user name (lower case, at most 31 characters), not root."
  }
}

variable "ssh_public_keys" {
  description = "SSH public keys (one line each) allowed to log in as ssh_user."
  type        = list(string)
  validation {
    condition = length(var.ssh_public_keys) >= 1 && alltrue([
      for k in var.ssh_public_keys :
      can(regex("^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)|sk-ssh-ed25519@openssh\\.com|sk-ecdsa-sha2-nistp256@openssh\\.com) [A-Za-z0-9+/]+=*( [^\\n\\r\"]*)?$", k))
    ])
    error_message = "ssh_public_keys needs at least one key, each one line such as 'ssh-ed25519 AAAA... you@laptop'."
  }
}

variable "shardlab_git_url" {
  description = "HTTPS URL of the shardlab repository that node 0 clones onto the shared filesystem. Empty: copy the source there yourself (README.md)."
  type        = string
  default     = ""
  validation {
    condition     = var.shardlab_git_url == "" || can(regex("^https://[A-Za-z0-9._~:/%+@-]+$", var.shardlab_git_url))
    error_message = "shardlab_git_url must be an https:// URL (no credentials inside; use a public or deploy-token URL) or empty."
  }
}

variable "shardlab_git_ref" {
  description = "Commit, tag or branch of shardlab_git_url to install (a commit makes every rebuild identical)."
  type        = string
  default     = "main"
  validation {
    condition     = can(regex("^[A-Za-z0-9._/-]+$", var.shardlab_git_ref))
    error_message = "shardlab_git_ref must be a commit, tag or branch name."
  }
}

variable "torch_version" {
  description = "torch version installed on every node (pip's torch==VERSION)."
  type        = string
  default     = "2.13.0"
  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+(\\.[0-9]+)?([a-z0-9.+]*)$", var.torch_version))
    error_message = "torch_version must be a version such as 2.13.0."
  }
}

variable "torch_index_url" {
  description = "Extra pip index for torch (e.g. a CUDA-specific wheel index). Empty: the default index."
  type        = string
  default     = ""
  validation {
    condition     = var.torch_index_url == "" || can(regex("^https://[A-Za-z0-9._~:/%+-]+$", var.torch_index_url))
    error_message = "torch_index_url must be an https:// URL or empty."
  }
}

variable "setup_wait_minutes" {
  description = "How long a node's first-boot setup waits for the source (and, on nodes > 0, for node 0's wheelhouse) before giving up."
  type        = number
  default     = 60
  validation {
    condition     = var.setup_wait_minutes >= 5 && var.setup_wait_minutes <= 720
    error_message = "setup_wait_minutes must be between 5 and 720."
  }
}

# ------------------------------------------------------------------ launch

variable "rdzv_port" {
  description = "TCP port of torchrun's c10d rendezvous on node 0."
  type        = number
  default     = 29500
  validation {
    condition     = var.rdzv_port >= 1024 && var.rdzv_port <= 65535 && floor(var.rdzv_port) == var.rdzv_port
    error_message = "rdzv_port must be a port from 1024 to 65535."
  }
}

variable "max_restarts" {
  description = "torchrun --max-restarts: worker-group restarts before a node's agent gives up (each resumes from the newest checkpoint)."
  type        = number
  default     = 3
  validation {
    condition     = var.max_restarts >= 0 && floor(var.max_restarts) == var.max_restarts
    error_message = "max_restarts must be a whole number >= 0."
  }
}

variable "run_name" {
  description = "Name of the first run: its directory is <shared_mount_path>/jobs/<run_name>, its checkpoints <shared_mount_path>/checkpoints/<run_name>."
  type        = string
  default     = "gpt2-small"
  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.run_name))
    error_message = "run_name must be lower-case letters, digits and '-' (at most 63), starting and ending with a letter or digit."
  }
}

variable "run_config" {
  description = "shardlab config of the first run, relative to the source tree."
  type        = string
  default     = "configs/gpt2-small.yaml"
  validation {
    condition     = can(regex("^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*\\.ya?ml$", var.run_config)) && !strcontains(var.run_config, "..")
    error_message = "run_config must be a relative path to a .yaml file inside the source tree."
  }
}

variable "run_overrides" {
  description = "key=value overrides of the first run. train.global_batch_size defaults to nodes x GPUs x 8 (gpt2-small's micro batch: no accumulation)."
  type        = list(string)
  default     = ["parallel.mixed_precision=bf16"]
  validation {
    condition     = alltrue([for o in var.run_overrides : can(regex("^[a-z_]+(\\.[a-z_]+)+=[A-Za-z0-9._/:+-]+$", o))])
    error_message = "each run_overrides entry must be key=value such as train.steps=500 (no spaces or quotes)."
  }
}
