# KMS key, the model and artifact buckets, and FSx for Lustre linked to the model bucket.

data "aws_iam_policy_document" "kms" {
  # In a KMS key policy, Resource "*" means "this key" (docs.aws.amazon.com/kms/latest/developerguide/key-policies.html):
  # checkov:skip=CKV_AWS_111:Key policy: Resource "*" is this key only; writes are limited to the account root.
  # checkov:skip=CKV_AWS_356:Key policy: Resource "*" is this key only.
  # checkov:skip=CKV_AWS_109:Key policy: administration by the account root is AWS's default key policy.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["arn:aws:iam::${data.aws_caller_identity.current.account_id}:root"]
    }
  }
  statement {
    sid       = "FSxAndS3UseThroughServices"
    actions   = ["kms:Encrypt", "kms:Decrypt", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:DescribeKey", "kms:CreateGrant"]
    resources = ["*"]
    principals {
      type        = "AWS"
      identifiers = ["*"]
    }
    condition {
      test     = "StringEquals"
      variable = "kms:CallerAccount"
      values   = [data.aws_caller_identity.current.account_id]
    }
    condition {
      test     = "StringLike"
      variable = "kms:ViaService"
      values   = ["fsx.${var.region}.amazonaws.com", "s3.${var.region}.amazonaws.com", "rds.${var.region}.amazonaws.com", "ecr.${var.region}.amazonaws.com"]
    }
  }
}

resource "aws_kms_key" "data" {
  description             = "pdserve: model weights (S3, FSx) and MLflow data"
  enable_key_rotation     = true
  deletion_window_in_days = 30
  policy                  = data.aws_iam_policy_document.kms.json
}

locals {
  buckets = {
    models    = var.model_bucket_name
    artifacts = var.artifact_bucket_name
  }
}

resource "aws_s3_bucket" "this" {
  for_each = local.buckets
  bucket   = each.value
  # checkov:skip=CKV_AWS_144:Weights and MLflow artifacts are reproducible (re-stage / re-tune); no cross-region replica.
  # checkov:skip=CKV2_AWS_62:No consumer of S3 event notifications; FSx auto-import uses the data repository association.
  # checkov:skip=CKV_AWS_18:Access logging goes to the organisation's central log bucket, configured outside this stack.
}

resource "aws_s3_bucket_public_access_block" "this" {
  for_each                = local.buckets
  bucket                  = aws_s3_bucket.this[each.key].id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "this" {
  for_each = local.buckets
  bucket   = aws_s3_bucket.this[each.key].id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  for_each = local.buckets
  bucket   = aws_s3_bucket.this[each.key].id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.data.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  for_each = local.buckets
  bucket   = aws_s3_bucket.this[each.key].id
  rule {
    id     = "expire-noncurrent-and-abort-uploads"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = 30
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }
  # Recorded traffic (the runtime's --traffic-upload objects) ages out: each re-tune sizes for recent traffic,
  # and the prefix would otherwise grow by ~300 objects per runtime pod and day.
  dynamic "rule" {
    for_each = each.key == "models" ? [var.traffic_retention_days] : []
    content {
      id     = "expire-recorded-traffic"
      status = "Enabled"
      filter {
        prefix = var.traffic_log_prefix
      }
      expiration {
        days = rule.value
      }
      # the bucket is versioned: expiry leaves the data as a noncurrent version, gone a day later (not 30)
      noncurrent_version_expiration {
        noncurrent_days = 1
      }
      abort_incomplete_multipart_upload {
        days_after_initiation = 1
      }
    }
  }
}

resource "aws_security_group" "fsx" {
  name_prefix = "${var.cluster_name}-fsx-"
  description = "FSx for Lustre: Lustre traffic from the EKS nodes"
  vpc_id      = module.vpc.vpc_id

  ingress {
    description     = "Lustre (988) from EKS nodes"
    from_port       = 988
    to_port         = 988
    protocol        = "tcp"
    security_groups = [module.eks.node_security_group_id]
  }
  ingress {
    description     = "Lustre (1018-1023) from EKS nodes"
    from_port       = 1018
    to_port         = 1023
    protocol        = "tcp"
    security_groups = [module.eks.node_security_group_id]
  }
  ingress {
    description = "Lustre (988) between file servers"
    from_port   = 988
    to_port     = 988
    protocol    = "tcp"
    self        = true
  }
  ingress {
    description = "Lustre (1018-1023) between file servers"
    from_port   = 1018
    to_port     = 1023
    protocol    = "tcp"
    self        = true
  }
  egress {
    description = "Lustre replies and S3 data repository traffic inside the VPC"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = [var.vpc_cidr]
  }
}

resource "aws_fsx_lustre_file_system" "models" {
  storage_capacity            = var.fsx_storage_capacity_gib
  deployment_type             = "PERSISTENT_2"
  per_unit_storage_throughput = var.fsx_throughput_mbps_per_tib
  file_system_type_version    = "2.15"
  data_compression_type       = "LZ4"
  subnet_ids                  = [module.vpc.private_subnets[0]]
  security_group_ids          = [aws_security_group.fsx.id]
  kms_key_id                  = aws_kms_key.data.arn
  copy_tags_to_backups        = true

  metadata_configuration {
    mode = "AUTOMATIC"
  }

  log_configuration {
    level = "WARN_ERROR"
  }

  tags = { Name = "${var.cluster_name}-models" }
}

# /s3 on FSx mirrors s3://<model bucket>/models (objects become visible there, their bytes load on first read),
# so s3://<model bucket>/models/NAME/ is /fsx/s3/NAME in the pods. It stays out of /models, where `pdserve
# stage` and the pipeline publish staged folders (/fsx/models/NAME, with their .pdserve-staged.json marker): an
# auto-imported folder there would have no marker, and staging refuses to overwrite it. `pdserve stage
# --fsx-file-system-id ... --fsx-path /s3/NAME s3://<model bucket>/models/NAME/ /fsx/models/NAME` uses this
# association (FSx forbids overlapping ones: other buckets need a path outside /s3).
resource "aws_fsx_data_repository_association" "models" {
  file_system_id                   = aws_fsx_lustre_file_system.models.id
  data_repository_path             = "s3://${aws_s3_bucket.this["models"].bucket}/models"
  file_system_path                 = "/s3"
  batch_import_meta_data_on_create = true

  s3 {
    auto_import_policy {
      events = ["NEW", "CHANGED", "DELETED"]
    }
  }
}
