output "cluster_name" {
  value = google_container_cluster.this.name
}

output "kubectl_credentials_command" {
  description = "Run this to point kubectl at the cluster."
  value = format("gcloud container clusters get-credentials %s --location %s --project %s",
  google_container_cluster.this.name, google_container_cluster.this.location, var.project_id)
}

output "bucket_name" {
  description = "Pass as `shardlab render k8s --bucket`."
  value       = google_storage_bucket.data.name
}

output "render_command" {
  description = "A render command that matches this cluster."
  value = format(
    "shardlab render k8s configs/gpt2-small.yaml --nodes %d --gpus-per-node %d --bucket %s --namespace %s --service-account %s --image <IMAGE>",
    var.gpu_pool_max_nodes, var.gpus_per_node, google_storage_bucket.data.name, var.k8s_namespace, var.k8s_service_account,
  )
}

output "node_service_account" {
  value = google_service_account.nodes.email
}
