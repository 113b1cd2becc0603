# Shared filesystem: one POSIX tree mounted at var.shared_mount_path on every node. It holds
# the source tree and wheelhouse every node installs from, the data, the rendered run
# directories, checkpoints and run outputs, so that a checkpoint written by the ranks of all
# nodes is one complete directory, and a node that is replaced (or a preempted VM that comes
# back) finds everything where it was.
resource "nebius_compute_v1_filesystem" "shared" {
  count            = var.existing_filesystem_id == "" ? 1 : 0
  parent_id        = var.project_id
  name             = "${var.name}-shared"
  type             = var.filesystem_type
  size_gibibytes   = var.filesystem_size_gib
  block_size_bytes = 4096
  forbid_deletion  = var.filesystem_forbid_deletion
  labels           = var.labels
}

locals {
  filesystem_id = var.existing_filesystem_id != "" ? var.existing_filesystem_id : nebius_compute_v1_filesystem.shared[0].id
  # the name the VM sees the filesystem under (virtiofs tag); node-setup.sh mounts it by this
  filesystem_mount_tag = "shardlab-shared"
}
