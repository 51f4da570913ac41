# IAM through EKS Pod Identity: one role per workload, trusted by pods.eks.amazonaws.com only.

data "aws_iam_policy_document" "pod_identity_trust" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]
    principals {
      type        = "Service"
      identifiers = ["pods.eks.amazonaws.com"]
    }
  }
}

# FSx CSI controller (dynamic provisioning through the fsx-sc StorageClass).
resource "aws_iam_role" "fsx_csi" {
  name               = "${var.cluster_name}-fsx-csi"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json
}

resource "aws_iam_role_policy_attachment" "fsx_csi" {
  role       = aws_iam_role.fsx_csi.name
  policy_arn = "arn:aws:iam::aws:policy/AmazonFSxFullAccess"
}

# Pipeline steps (stage-weights reads the model bucket; tune/promote log to MLflow over HTTP).
data "aws_iam_policy_document" "pipeline" {
  statement {
    sid       = "ListModelBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.this["models"].arn]
  }
  statement {
    sid       = "ReadWriteModels"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.this["models"].arn}/models/*"]
  }
  statement {
    sid       = "UseDataKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.data.arn]
  }
  statement {
    sid       = "DescribeFsx"
    actions   = ["fsx:DescribeFileSystems", "fsx:DescribeDataRepositoryAssociations", "fsx:DescribeDataRepositoryTasks", "fsx:CreateDataRepositoryTask"]
    resources = [aws_fsx_lustre_file_system.models.arn, "arn:aws:fsx:${var.region}:${data.aws_caller_identity.current.account_id}:task/*", "arn:aws:fsx:${var.region}:${data.aws_caller_identity.current.account_id}:association/*"]
  }
}

resource "aws_iam_role" "pipeline" {
  name               = "${var.cluster_name}-pipeline"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json
}

resource "aws_iam_role_policy" "pipeline" {
  name   = "models-and-fsx"
  role   = aws_iam_role.pipeline.id
  policy = data.aws_iam_policy_document.pipeline.json
}

# Kubeflow Pipelines standalone (infra/k8s/kubeflow-pipelines) runs every step as kubeflow/pipeline-runner.
resource "aws_eks_pod_identity_association" "pipeline" {
  cluster_name    = module.eks.cluster_name
  namespace       = "kubeflow"
  service_account = "pipeline-runner"
  role_arn        = aws_iam_role.pipeline.arn
}

# Multi-user Kubeflow runs them as default-editor of the profile namespace (infra/k8s/kubeflow-profile).
resource "aws_eks_pod_identity_association" "pipeline_profile" {
  for_each        = toset(var.kubeflow_profile_namespaces)
  cluster_name    = module.eks.cluster_name
  namespace       = each.key
  service_account = "default-editor"
  role_arn        = aws_iam_role.pipeline.arn
}

# Batch workflows (runtime/batch: `pdserve batch workflow` / `retune-schedule`; ServiceAccount pdserve/pdserve-batch
# from infra/k8s/batch): `batch run` reads its input, reads back and writes its output (resume); the re-tuning
# CronWorkflow's Argo executor fetches the recorded traffic (one object or every object under a prefix). MLflow
# is reached over HTTP (its server proxies artifacts), the model config through the FSx claim: no other AWS access.
data "aws_iam_policy_document" "batch" {
  statement {
    # Not narrowed by s3:prefix: a GetObject of a missing key answers 404 (not 403) only to a caller allowed to
    # list the bucket (docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html), and both `batch run` (first run:
    # no output to resume yet) and Argo (a traffic prefix is first tried as an object) rely on that 404.
    # Listing shows key names, not contents; GetBucketLocation: Argo's S3 client looks the region up.
    sid       = "ListModelBucket"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.this["models"].arn]
  }
  statement {
    sid     = "ReadBatchInputAndTraffic"
    actions = ["s3:GetObject"]
    # the bare traffic "folder" key too: Argo tries s3://bucket/traffic (the prefix without '/') as an object first
    resources = [
      "${aws_s3_bucket.this["models"].arn}/${var.batch_input_prefix}*",
      "${aws_s3_bucket.this["models"].arn}/${var.traffic_log_prefix}*",
      "${aws_s3_bucket.this["models"].arn}/${trimsuffix(var.traffic_log_prefix, "/")}",
    ]
  }
  statement {
    sid       = "ReadWriteBatchOutput"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.this["models"].arn}/${var.batch_output_prefix}*"]
  }
  statement {
    sid       = "UseDataKeyThroughS3"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.data.arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "batch" {
  name               = "${var.cluster_name}-batch"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json
}

resource "aws_iam_role_policy" "batch" {
  name   = "batch-and-traffic"
  role   = aws_iam_role.batch.id
  policy = data.aws_iam_policy_document.batch.json

  lifecycle {
    precondition {
      # the output is the only writable prefix: it must not contain, or lie inside, a prefix that is only read
      condition = alltrue([for p in [var.batch_input_prefix, var.traffic_log_prefix] :
      !startswith(p, var.batch_output_prefix) && !startswith(var.batch_output_prefix, p)])
      error_message = "batch_output_prefix must not overlap batch_input_prefix or traffic_log_prefix (inputs are read-only)."
    }
  }
}

resource "aws_eks_pod_identity_association" "batch" {
  cluster_name    = module.eks.cluster_name
  namespace       = "pdserve"
  service_account = "pdserve-batch"
  role_arn        = aws_iam_role.batch.arn
}

# MLflow tracking server: artifacts bucket read/write; the RDS-managed database credentials (read at start by
# infra/k8s/mlflow/start_mlflow.py; encrypted with the data key).
data "aws_iam_policy_document" "mlflow" {
  statement {
    sid       = "ReadDatabaseCredentials"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [aws_db_instance.mlflow.master_user_secret[0].secret_arn]
  }
  statement {
    sid       = "ListArtifacts"
    actions   = ["s3:ListBucket", "s3:GetBucketLocation"]
    resources = [aws_s3_bucket.this["artifacts"].arn]
  }
  statement {
    sid       = "ReadWriteArtifacts"
    actions   = ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
    resources = ["${aws_s3_bucket.this["artifacts"].arn}/*"]
  }
  statement {
    sid       = "UseDataKey"
    actions   = ["kms:Decrypt", "kms:GenerateDataKey"]
    resources = [aws_kms_key.data.arn]
  }
}

resource "aws_iam_role" "mlflow" {
  name               = "${var.cluster_name}-mlflow"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json
}

resource "aws_iam_role_policy" "mlflow" {
  name   = "artifacts"
  role   = aws_iam_role.mlflow.id
  policy = data.aws_iam_policy_document.mlflow.json
}

resource "aws_eks_pod_identity_association" "mlflow" {
  cluster_name    = module.eks.cluster_name
  namespace       = "mlflow"
  service_account = "mlflow"
  role_arn        = aws_iam_role.mlflow.arn
}

# Recorded traffic of the online endpoints (`pdserve promote --traffic-upload s3://<model bucket>/<traffic_log_prefix>`):
# the runtime pods of InferenceService <name> run as ServiceAccount pdserve/<name>-runtime (runtime/deploy/render.py)
# and PUT one object per shipment under <traffic_log_prefix><name>/<pod>/ (runtime/server/traffic.py TrafficShipper:
# single put_object calls of at most 64 MiB, no multipart upload, no read, list or delete). One role per
# InferenceService, so a runtime can write only its own folder and never read anything. The batch role reads
# these objects back for re-tuning; the lifecycle rule in storage.tf expires them.
data "aws_iam_policy_document" "traffic_upload" {
  for_each = toset(var.traffic_upload_inference_services)

  statement {
    sid       = "ShipOwnTraffic"
    actions   = ["s3:PutObject"]
    resources = ["${aws_s3_bucket.this["models"].arn}/${var.traffic_log_prefix}${each.key}/*"]
  }
  statement {
    # SSE-KMS by bucket default (storage.tf): a PUT needs a data key (docs.aws.amazon.com/AmazonS3/latest/userguide/
    # UsingKMSEncryption.html: kms:GenerateDataKey to upload; kms:Decrypt only for multipart uploads, unused here).
    sid       = "EncryptThroughS3"
    actions   = ["kms:GenerateDataKey"]
    resources = [aws_kms_key.data.arn]
    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "traffic_upload" {
  for_each           = toset(var.traffic_upload_inference_services)
  name               = "${var.cluster_name}-traffic-${each.key}"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json

  lifecycle {
    precondition {
      condition     = length("${var.cluster_name}-traffic-${each.key}") <= 64
      error_message = "IAM role name ${var.cluster_name}-traffic-${each.key} is longer than 64 characters: shorten cluster_name."
    }
  }
}

resource "aws_iam_role_policy" "traffic_upload" {
  for_each = toset(var.traffic_upload_inference_services)
  name     = "ship-recorded-traffic"
  role     = aws_iam_role.traffic_upload[each.key].id
  policy   = data.aws_iam_policy_document.traffic_upload[each.key].json
}

resource "aws_eks_pod_identity_association" "traffic_upload" {
  for_each        = toset(var.traffic_upload_inference_services)
  cluster_name    = module.eks.cluster_name
  namespace       = "pdserve"
  service_account = "${each.key}-runtime"
  role_arn        = aws_iam_role.traffic_upload[each.key].arn
}
