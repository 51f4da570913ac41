output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name ...)."
  value       = module.eks.cluster_name
}

output "karpenter_node_role" {
  description = "IAM role of Karpenter-launched nodes (EC2NodeClass spec.role)."
  value       = module.karpenter.node_iam_role_name
}

output "cluster_env" {
  description = "Every name infra/k8s takes from Terraform: terraform output -raw cluster_env > infra/k8s/values/cluster.env (keys replaced into the manifests by the component infra/k8s/values)."
  value       = <<-EOT
    CLUSTER_NAME=${module.eks.cluster_name}
    AWS_REGION=${var.region}
    KARPENTER_NODE_ROLE=${module.karpenter.node_iam_role_name}
    FSX_FILE_SYSTEM_ID=${aws_fsx_lustre_file_system.models.id}
    FSX_DNS_NAME=${aws_fsx_lustre_file_system.models.dns_name}
    FSX_MOUNT_NAME=${aws_fsx_lustre_file_system.models.mount_name}
    FSX_SUBNET_ID=${module.vpc.private_subnets[0]}
    FSX_SECURITY_GROUP_ID=${aws_security_group.fsx.id}
    MLFLOW_ARTIFACTS_DESTINATION=s3://${aws_s3_bucket.this["artifacts"].bucket}/mlflow
    MLFLOW_DB_ENDPOINT=${aws_db_instance.mlflow.endpoint}
    MLFLOW_DB_SECRET_ARN=${aws_db_instance.mlflow.master_user_secret[0].secret_arn}
  EOT
}

output "mlflow_db_endpoint" {
  description = "host:port of the MLflow PostgreSQL database."
  value       = aws_db_instance.mlflow.endpoint
}

output "mlflow_db_secret_arn" {
  description = "Secrets Manager secret with the MLflow database master credentials."
  value       = aws_db_instance.mlflow.master_user_secret[0].secret_arn
}

output "model_bucket" {
  description = "S3 bucket for model weights (stage-weights source)."
  value       = aws_s3_bucket.this["models"].bucket
}

output "batch_role_arn" {
  description = "IAM role of the pdserve-batch service account (EKS Pod Identity): reads batch inputs and traffic logs, writes batch outputs in the model bucket."
  value       = aws_iam_role.batch.arn
}

output "batch_s3_prefixes" {
  description = "Where batch work may live: s3:// URIs for `pdserve batch workflow --input/--output`; traffic: `pdserve promote --traffic-upload` (the runtime ships to <traffic><InferenceService>/) and `retune-schedule --traffic <traffic><InferenceService>/`."
  value = {
    input   = "s3://${aws_s3_bucket.this["models"].bucket}/${var.batch_input_prefix}"
    output  = "s3://${aws_s3_bucket.this["models"].bucket}/${var.batch_output_prefix}"
    traffic = "s3://${aws_s3_bucket.this["models"].bucket}/${var.traffic_log_prefix}"
  }
}

output "traffic_upload_role_arns" {
  description = "IAM role (EKS Pod Identity, ServiceAccount pdserve/<name>-runtime) of each InferenceService in traffic_upload_inference_services: PutObject under <traffic>/<name>/ only."
  value       = { for name, role in aws_iam_role.traffic_upload : name => role.arn }
}

output "image_repository_url" {
  description = "ECR repository of the pdserve images: make image-push IMAGE=<this>:<tag>; pdserve compile --image <this>:<tag>."
  value       = aws_ecr_repository.runtime.repository_url
}
