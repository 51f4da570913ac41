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

resource "aws_eks_pod_identity_association" "pipeline" {
  cluster_name    = module.eks.cluster_name
  namespace       = "kubeflow"
  service_account = "pipeline-runner"
  role_arn        = aws_iam_role.pipeline.arn
}

# MLflow tracking server: artifacts bucket read/write.
data "aws_iam_policy_document" "mlflow" {
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
