# The cluster gets a network of its own: its address range is the pool below, taken from a
# variable, so it never collides with the project's default network or with your VPN.
resource "nebius_vpc_v1_pool" "private" {
  parent_id  = var.project_id
  name       = "${var.name}-pool"
  version    = "IPV4"
  visibility = "PRIVATE"
  labels     = var.labels
  cidrs = [
    { cidr = var.network_cidr },
  ]
}

resource "nebius_vpc_v1_network" "this" {
  parent_id = var.project_id
  name      = "${var.name}-network"
  labels    = var.labels
  ipv4_private_pools = {
    pools = [{ id = nebius_vpc_v1_pool.private.id }]
  }
}

resource "nebius_vpc_v1_subnet" "nodes" {
  parent_id  = var.project_id
  name       = "${var.name}-nodes"
  network_id = nebius_vpc_v1_network.this.id
  labels     = var.labels
  ipv4_private_pools = {
    use_network_pools = false
    pools = [{
      cidrs = [{ cidr = var.subnet_cidr }]
    }]
  }
}

# One private address per node, reserved before any VM exists: every node's cloud-init can then
# name node 0 as the rendezvous host and list all peers, and the addresses survive a VM
# being recreated.
resource "nebius_vpc_v1_allocation" "node" {
  count     = var.node_count
  parent_id = var.project_id
  name      = "${var.name}-node-${count.index}"
  labels    = var.labels
  ipv4_private = {
    subnet_id = nebius_vpc_v1_subnet.nodes.id
    cidr      = "/32"
  }
}

# ------------------------------------------------------------------ firewall
# A security group denies whatever no rule allows. Nodes may talk to each other freely
# (rendezvous, NCCL/gloo bootstrap and socket traffic; InfiniBand does not pass through it),
# reach the package index and git host, and accept SSH only from ssh_allowed_cidrs.
resource "nebius_vpc_v1_security_group" "nodes" {
  parent_id  = var.project_id
  name       = "${var.name}-nodes"
  network_id = nebius_vpc_v1_network.this.id
  labels     = var.labels
}

resource "nebius_vpc_v1_security_rule" "intra_cluster" {
  parent_id = nebius_vpc_v1_security_group.nodes.id
  name      = "${var.name}-intra-cluster"
  access    = "ALLOW"
  protocol  = "ANY"
  priority  = 100
  type      = "STATEFUL"
  labels    = var.labels
  ingress = {
    source_security_group_id = nebius_vpc_v1_security_group.nodes.id
  }
}

# egress to the peers too, so that narrowing egress_cidrs never cuts the cluster in two
resource "nebius_vpc_v1_security_rule" "intra_cluster_egress" {
  parent_id = nebius_vpc_v1_security_group.nodes.id
  name      = "${var.name}-intra-cluster-egress"
  access    = "ALLOW"
  protocol  = "ANY"
  priority  = 100
  type      = "STATEFUL"
  labels    = var.labels
  egress = {
    destination_security_group_id = nebius_vpc_v1_security_group.nodes.id
  }
}

resource "nebius_vpc_v1_security_rule" "ssh" {
  parent_id = nebius_vpc_v1_security_group.nodes.id
  name      = "${var.name}-ssh"
  access    = "ALLOW"
  protocol  = "TCP"
  priority  = 200
  type      = "STATEFUL"
  labels    = var.labels
  ingress = {
    source_cidrs      = var.ssh_allowed_cidrs
    destination_ports = [22]
  }
}

resource "nebius_vpc_v1_security_rule" "egress" {
  parent_id = nebius_vpc_v1_security_group.nodes.id
  name      = "${var.name}-egress"
  access    = "ALLOW"
  protocol  = "ANY"
  priority  = 300
  type      = "STATEFUL"
  labels    = var.labels
  egress = {
    destination_cidrs = var.egress_cidrs
  }
}
