# PostgreSQL for the MLflow tracking/registry backend; the master password lives in Secrets Manager
# (manage_master_user_password), never in Terraform state or code.

resource "aws_db_subnet_group" "mlflow" {
  name       = "${var.cluster_name}-mlflow"
  subnet_ids = module.vpc.private_subnets
}

resource "aws_security_group" "mlflow_db" {
  name_prefix = "${var.cluster_name}-mlflow-db-"
  description = "MLflow PostgreSQL: only from the EKS nodes"
  vpc_id      = module.vpc.vpc_id

  ingress {
    description     = "PostgreSQL from EKS nodes"
    from_port       = 5432
    to_port         = 5432
    protocol        = "tcp"
    security_groups = [module.eks.node_security_group_id]
  }
}

data "aws_iam_policy_document" "rds_monitoring_trust" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["monitoring.rds.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "rds_monitoring" {
  name               = "${var.cluster_name}-rds-monitoring"
  assume_role_policy = data.aws_iam_policy_document.rds_monitoring_trust.json
}

resource "aws_iam_role_policy_attachment" "rds_monitoring" {
  role       = aws_iam_role.rds_monitoring.name
  policy_arn = "arn:aws:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

resource "aws_db_parameter_group" "mlflow" {
  name   = "${var.cluster_name}-mlflow-pg16"
  family = "postgres16"

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "log_statement"
    value = "ddl"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }
}

resource "aws_db_instance" "mlflow" {
  identifier     = "${var.cluster_name}-mlflow"
  engine         = "postgres"
  engine_version = "16"
  instance_class = "db.t4g.medium"

  allocated_storage     = 50
  max_allocated_storage = 500
  storage_type          = "gp3"
  storage_encrypted     = true
  kms_key_id            = aws_kms_key.data.arn

  db_name                       = "mlflow"
  username                      = "mlflow"
  manage_master_user_password   = true
  master_user_secret_kms_key_id = aws_kms_key.data.arn

  parameter_group_name   = aws_db_parameter_group.mlflow.name
  db_subnet_group_name   = aws_db_subnet_group.mlflow.name
  vpc_security_group_ids = [aws_security_group.mlflow_db.id]
  publicly_accessible    = false
  multi_az               = true

  iam_database_authentication_enabled = true
  backup_retention_period             = 14
  copy_tags_to_snapshot               = true
  deletion_protection                 = true
  auto_minor_version_upgrade          = true
  enabled_cloudwatch_logs_exports     = ["postgresql", "upgrade"]
  monitoring_interval                 = 60
  monitoring_role_arn                 = aws_iam_role.rds_monitoring.arn
  performance_insights_enabled        = true
  performance_insights_kms_key_id     = aws_kms_key.data.arn
  skip_final_snapshot                 = false
  final_snapshot_identifier           = "${var.cluster_name}-mlflow-final"
}
