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

# Prefixes in the model bucket that the pdserve-batch pods (runtime/batch: `pdserve batch workflow` and
# `pdserve batch retune-schedule`) may use; its IAM role (iam.tf) is scoped to exactly these. Each is a key
# prefix ending in '/', outside models/ (the prefix FSx mirrors), without '*' (it would widen the policy).
variable "batch_input_prefix" {
  description = "Model-bucket key prefix the batch pods may READ OpenAI Batch input files (JSONL) from, e.g. batch/input/."
  type        = string
  default     = "batch/input/"

  validation {
    condition     = can(regex("^([0-9A-Za-z!_.'()-]+/)+$", var.batch_input_prefix)) && !can(regex("(^|/)[.]{1,2}/", var.batch_input_prefix)) && !startswith(var.batch_input_prefix, "models/")
    error_message = "batch_input_prefix: a key prefix ending in '/' (letters, digits, ! _ . ' ( ) -; no '*', no '.'/'..' segments), not under models/."
  }
}

variable "batch_output_prefix" {
  description = "Model-bucket key prefix the batch pods may READ and WRITE batch outputs (JSONL, resumed in place) under, e.g. batch/output/."
  type        = string
  default     = "batch/output/"

  validation {
    condition     = can(regex("^([0-9A-Za-z!_.'()-]+/)+$", var.batch_output_prefix)) && !can(regex("(^|/)[.]{1,2}/", var.batch_output_prefix)) && !startswith(var.batch_output_prefix, "models/")
    error_message = "batch_output_prefix: a key prefix ending in '/' (letters, digits, ! _ . ' ( ) -; no '*', no '.'/'..' segments), not under models/."
  }
}

variable "traffic_retention_days" {
  description = "Days recorded traffic under traffic_log_prefix is kept (S3 lifecycle expiration); re-tuning sizes for what is left."
  type        = number
  default     = 35

  validation {
    condition     = var.traffic_retention_days >= 1 && floor(var.traffic_retention_days) == var.traffic_retention_days
    error_message = "traffic_retention_days: a whole number of days >= 1."
  }
}

variable "traffic_log_prefix" {
  description = "Model-bucket key prefix the re-tuning pods may READ recorded traffic logs (Azure CSV / Mooncake JSONL) from, e.g. traffic/."
  type        = string
  default     = "traffic/"

  validation {
    condition     = can(regex("^([0-9A-Za-z!_.'()-]+/)+$", var.traffic_log_prefix)) && !can(regex("(^|/)[.]{1,2}/", var.traffic_log_prefix)) && !startswith(var.traffic_log_prefix, "models/")
    error_message = "traffic_log_prefix: a key prefix ending in '/' (letters, digits, ! _ . ' ( ) -; no '*', no '.'/'..' segments), not under models/."
  }
}

# InferenceServices whose runtime may ship recorded traffic (iam.tf traffic_upload). `pdserve promote` names the
# InferenceService dns_label(<registered model>) (runtime/deploy/target.py) and its runtime pods run as ServiceAccount
# pdserve/<name>-runtime; an EKS Pod Identity association needs that exact name, so list every endpoint promoted with
# --traffic-upload here. The default is the InferenceService of the stage_tune_promote pipeline's default model.
variable "traffic_upload_inference_services" {
  description = "InferenceService names (namespace pdserve) whose runtime pods may PUT recorded traffic under <traffic_log_prefix><name>/ of the model bucket; each gets its own Pod Identity role."
  type        = list(string)
  default     = ["smollm2-135m-instruct-pd"]

  validation {
    condition     = alltrue([for n in var.traffic_upload_inference_services : can(regex("^[a-z]([-a-z0-9]{0,43}[a-z0-9])?$", n))])
    error_message = "traffic_upload_inference_services: each a DNS-1035 label of at most 45 characters (what `pdserve promote` names an InferenceService)."
  }
}

variable "image_repository_name" {
  description = "ECR repository of the pdserve images (make image-push IMAGE=<image_repository_url>:<tag>)."
  type        = string
  default     = "pdserve-runtime"
}

variable "kubeflow_profile_namespaces" {
  description = "Multi-user Kubeflow: profile namespaces whose pipeline runs (ServiceAccount default-editor) run pdserve's pipeline; each gets the pipeline role (infra/k8s/kubeflow-profile)."
  type        = list(string)
  default     = ["kubeflow-user-example-com"]
}
