locals {
  # "203.0.113.9/32" or "203.0.113.9" -> "203.0.113.9"
  entry_address = split("/", nebius_compute_v1_instance.node[0].status.network_interfaces[0].public_ip_address.address)[0]
  jump          = "${var.ssh_user}@${local.entry_address}"
}

output "nodes" {
  description = "Rank, name and private address of every node (rank 0 hosts the rendezvous)."
  value = [
    for i, n in nebius_compute_v1_instance.node : {
      rank            = i
      name            = n.name
      private_address = local.node_addresses[i]
    }
  ]
}

output "node_private_addresses" {
  value = local.node_addresses
}

output "head_public_address" {
  description = "Public address of node 0, the way into the cluster."
  value       = local.entry_address
}

output "ssh_command" {
  description = "Log in to node 0 (the others: ssh -J <this user@address> <user>@<private address>)."
  value       = "ssh ${local.jump}"
}

output "setup_status_command" {
  description = "Lists the nodes that finished their first-boot setup (one .ready file each; all must be there before a launch)."
  value       = "ssh ${local.jump} ls ${var.shared_mount_path}/.shardlab-cluster/${var.name}/nodes"
}

output "launch_command" {
  description = "Starts every node's torchrun agent for the rendered run (after render_command); they meet at node 0's rendezvous."
  value = format(
    "for a in %s; do ssh -J %s %s@$a shardlab-launch --detach %s; done",
    join(" ", local.node_addresses), local.jump, var.ssh_user, local.run_dir,
  )
}

output "logs_command" {
  description = "Follows node 0's log of the run (node i: node-i.log; all under <run_dir>/logs)."
  value       = "ssh ${local.jump} tail -F ${local.run_dir}/logs/node-0.log"
}

output "shared_filesystem_id" {
  description = "Pass as existing_filesystem_id to a later cluster to keep data and checkpoints."
  value       = local.filesystem_id
}

output "gpu_cluster_id" {
  value = local.use_gpu_cluster ? nebius_compute_v1_gpu_cluster.this[0].id : null
}
