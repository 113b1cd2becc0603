# What to run once the nodes are up. Only variables go in here (no resource): the test suite
# evaluates these locals and outputs with a real terraform binary, offline, and runs the
# render command they produce (tests/test_infra_nebius.py).
locals {
  # the preset's name carries the node's shape: 8gpu-128vcpu-1600gb -> 8 GPUs, 128 vCPUs
  gpus_per_node  = tonumber(regex("^([0-9]+)gpu-", var.gpu_preset)[0])
  vcpus_per_node = tonumber(regex("-([0-9]+)vcpu-", var.gpu_preset)[0])
  world_size     = var.node_count * local.gpus_per_node

  source_dir = "${var.shared_mount_path}/src/shardlab"
  venv_dir   = "/opt/shardlab/venv" # on every node's boot disk: fast imports, no shared-filesystem load
  run_dir    = "${var.shared_mount_path}/jobs/${var.run_name}"

  # one micro-batch of 8 per GPU and step unless the user chose a global batch
  batch_override = anytrue([for o in var.run_overrides : startswith(o, "train.global_batch_size=")]) ? [] : [
    "train.global_batch_size=${local.world_size * 8}",
  ]

  render_command = join(" ", concat(
    [
      "cd ${local.source_dir} &&",
      "${local.venv_dir}/bin/shardlab render slurm ${var.run_config}",
      "--nodes ${var.node_count} --gpus-per-node ${local.gpus_per_node} --out ${local.run_dir}",
      "checkpoint.dir=${var.shared_mount_path}/checkpoints/${var.run_name}",
      "output.dir=${var.shared_mount_path}/runs",
    ],
    local.batch_override,
    var.run_overrides,
  ))
}

output "render_command" {
  description = "Run on node 0 (ssh_command) once every node is ready: resolves the config for nodes x GPUs and writes it to the shared filesystem."
  value       = local.render_command
}

output "run_dir" {
  description = "The rendered run's directory on the shared filesystem (shardlab-launch's argument)."
  value       = local.run_dir
}

output "world_size" {
  value = local.world_size
}
