locals {
  use_gpu_cluster = var.infiniband_fabric != ""

  # reserved before the VMs exist (network.tf); "10.60.0.5/32" -> "10.60.0.5"
  node_addresses = [for a in nebius_vpc_v1_allocation.node : split("/", a.status.details.allocated_cidr)[0]]

  # every script a node runs comes from this directory, embedded whole in its cloud-init
  # (tests/test_infra_nebius.py checks that the rendered cloud-init names nothing else)
  node_setup_script = file("${path.module}/scripts/node-setup.sh")
  launch_script     = file("${path.module}/scripts/shardlab-launch.sh")
}

# The InfiniBand fabric that joins the nodes' GPUs (NCCL uses it without any setting); only
# 8-GPU presets can join, and only when the VM is created.
resource "nebius_compute_v1_gpu_cluster" "this" {
  count             = local.use_gpu_cluster ? 1 : 0
  parent_id         = var.project_id
  name              = "${var.name}-gpu-cluster"
  infiniband_fabric = var.infiniband_fabric
  labels            = var.labels
}

check "multi_node_without_infiniband" {
  assert {
    condition     = var.node_count == 1 || !startswith(var.gpu_preset, "8gpu-") || var.infiniband_fabric != ""
    error_message = "Several 8-GPU nodes without infiniband_fabric: collectives between nodes go over Ethernet (TCP), typically an order of magnitude slower. Set the fabric of your region and platform."
  }
}

resource "nebius_compute_v1_disk" "boot" {
  count            = var.node_count
  parent_id        = var.project_id
  name             = "${var.name}-node-${count.index}-boot"
  type             = var.boot_disk_type
  size_gibibytes   = var.boot_disk_size_gib
  block_size_bytes = 4096
  labels           = var.labels
  source_image_family = {
    image_family = var.image_family
  }
}

resource "nebius_compute_v1_instance" "node" {
  count     = var.node_count
  parent_id = var.project_id
  name      = "${var.name}-node-${count.index}"
  hostname  = "${var.name}-node-${count.index}"
  labels    = merge(var.labels, { shardlab-node-rank = tostring(count.index) })

  resources = {
    platform = var.gpu_platform
    preset   = var.gpu_preset
  }

  boot_disk = {
    attach_mode   = "READ_WRITE"
    existing_disk = { id = nebius_compute_v1_disk.boot[count.index].id }
  }

  # the same filesystem, read-write, on every node; node-setup.sh mounts it by this tag
  filesystems = [
    {
      attach_mode         = "READ_WRITE"
      mount_tag           = local.filesystem_mount_tag
      existing_filesystem = { id = local.filesystem_id }
    },
  ]

  gpu_cluster = local.use_gpu_cluster ? { id = nebius_compute_v1_gpu_cluster.this[0].id } : null

  network_interfaces = [
    {
      # the name the interface gets inside the VM: NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME use it
      name       = "eth0"
      subnet_id  = nebius_vpc_v1_subnet.nodes.id
      ip_address = { allocation_id = nebius_vpc_v1_allocation.node[count.index].id }
      # node 0 is the way in; a static address survives a stop/start (preemption)
      public_ip_address = count.index == 0 || var.public_ip_all_nodes ? { static = true } : null
      security_groups   = [{ id = nebius_vpc_v1_security_group.nodes.id }]
    },
  ]

  preemptible = var.preemptible ? { on_preemption = "STOP" } : null

  cloud_init_user_data = templatefile("${path.module}/cloud-init.yaml.tftpl", {
    cluster_name        = var.name
    node_rank           = count.index
    node_count          = var.node_count
    head_address        = local.node_addresses[0]
    node_addresses      = join(" ", local.node_addresses)
    rdzv_port           = var.rdzv_port
    gpus_per_node       = local.gpus_per_node
    omp_threads         = max(1, floor(local.vcpus_per_node / local.gpus_per_node))
    max_restarts        = var.max_restarts
    infiniband          = local.use_gpu_cluster
    shared_dir          = var.shared_mount_path
    fs_mount_tag        = local.filesystem_mount_tag
    ssh_user            = var.ssh_user
    venv_dir            = local.venv_dir
    ssh_keys_json       = jsonencode(var.ssh_public_keys)
    git_url             = var.shardlab_git_url
    git_ref             = var.shardlab_git_ref
    torch_version       = var.torch_version
    torch_index_url     = var.torch_index_url
    setup_wait_minutes  = var.setup_wait_minutes
    node_setup_b64      = base64encode(local.node_setup_script)
    shardlab_launch_b64 = base64encode(local.launch_script)
  })
}
