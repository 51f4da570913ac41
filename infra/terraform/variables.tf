variable "region" {
  description = "AWS region (p5/p5e/g6e capacity differs by region)."
  type        = string
  default     = "us-east-1"
}

variable "cluster_name" {
  description = "EKS cluster name; also the karpenter.sh/discovery tag value."
  type        = string
  default     = "pdserve"
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version (manifests are validated against the same minor version)."
  type        = string
  default     = "1.33"
}

variable "vpc_cidr" {
  description = "VPC CIDR block."
  type        = string
  default     = "10.20.0.0/16"
}

variable "model_bucket_name" {
  description = "S3 bucket holding model weights (linked to FSx by a data repository association)."
  type        = string
}

variable "artifact_bucket_name" {
  description = "S3 bucket for MLflow artifacts."
  type        = string
}

variable "fsx_storage_capacity_gib" {
  description = "FSx for Lustre capacity, GiB (PERSISTENT_2: 1200 or a multiple of 2400)."
  type        = number
  default     = 2400
}

variable "fsx_throughput_mbps_per_tib" {
  description = "FSx PERSISTENT_2 throughput per TiB (125, 250, 500 or 1000 MB/s/TiB)."
  type        = number
  default     = 500
}

variable "karpenter_version" {
  description = "Karpenter Helm chart version (must serve the karpenter.sh/v1 CRDs vendored in runtime/deploy/schemas)."
  type        = string
  default     = "1.8.1"
}

variable "admin_cidrs" {
  description = "CIDRs allowed to reach the public EKS API endpoint."
  type        = list(string)
  default     = []
}
