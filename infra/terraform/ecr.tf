# The pdserve images (`make image-push IMAGE=<image_repository_url>:<tag>`): one repository holds the GPU build
# (<tag>) and the CPU build (<tag>-cpu, runtime/image.py). Immutable tags: a promoted revision records its image
# (annotation pdserve.io/image) and a rollback re-applies it, so a tag must never move. Nodes pull with the
# AmazonEC2ContainerRegistryReadOnly policy of their node role (EKS managed node group, Karpenter module).
resource "aws_ecr_repository" "runtime" {
  name                 = var.image_repository_name
  image_tag_mutability = "IMMUTABLE"

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "KMS"
    kms_key         = aws_kms_key.data.arn
  }
}

resource "aws_ecr_lifecycle_policy" "runtime" {
  repository = aws_ecr_repository.runtime.name
  policy = jsonencode({
    rules = [{
      rulePriority = 1
      description  = "Untagged layers of superseded builds"
      selection    = { tagStatus = "untagged", countType = "sinceImagePushed", countUnit = "days", countNumber = 14 }
      action       = { type = "expire" }
    }]
  })
}
