module "vpc" {
  # checkov:skip=CKV_TF_1:Registry module pinned by a version constraint; Terraform registry releases are immutable tags.
  source  = "terraform-aws-modules/vpc/aws"
  version = "~> 6.0"

  name = var.cluster_name
  cidr = var.vpc_cidr
  azs  = local.azs

  private_subnets = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 4, i)]
  public_subnets  = [for i, _ in local.azs : cidrsubnet(var.vpc_cidr, 8, 48 + i)]

  enable_nat_gateway   = true
  single_nat_gateway   = false
  enable_dns_hostnames = true

  enable_flow_log                                 = true
  create_flow_log_cloudwatch_log_group            = true
  create_flow_log_cloudwatch_iam_role             = true
  flow_log_cloudwatch_log_group_retention_in_days = 365

  public_subnet_tags = {
    "kubernetes.io/role/elb" = 1
  }
  private_subnet_tags = {
    "kubernetes.io/role/internal-elb" = 1
    "karpenter.sh/discovery"          = var.cluster_name
  }
}

module "eks" {
  # checkov:skip=CKV_TF_1:Registry module pinned by a version constraint; Terraform registry releases are immutable tags.
  source  = "terraform-aws-modules/eks/aws"
  version = "~> 21.0"

  name               = var.cluster_name
  kubernetes_version = var.kubernetes_version

  endpoint_public_access       = length(var.admin_cidrs) > 0
  endpoint_public_access_cidrs = var.admin_cidrs

  enable_cluster_creator_admin_permissions = true
  enabled_log_types                        = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  vpc_id     = module.vpc.vpc_id
  subnet_ids = module.vpc.private_subnets

  addons = {
    coredns                = {}
    kube-proxy             = {}
    eks-pod-identity-agent = { before_compute = true }
    # NetworkPolicy enforcement is off in the VPC CNI unless enabled: without it every NetworkPolicy of
    # infra/k8s and of `pdserve promote` is accepted but not enforced (AWS EKS user guide,
    # docs.aws.amazon.com/eks/latest/userguide/cni-network-policy-configure.html).
    vpc-cni = {
      before_compute       = true
      configuration_values = jsonencode({ enableNetworkPolicy = "true" })
    }
    aws-fsx-csi-driver = {
      pod_identity_association = [{
        role_arn        = aws_iam_role.fsx_csi.arn
        service_account = "fsx-csi-controller-sa"
      }]
    }
    amazon-cloudwatch-observability = {
      configuration_values = local.cloudwatch_observability_config
      pod_identity_association = [{
        role_arn        = aws_iam_role.cloudwatch_agent.arn
        service_account = "cloudwatch-agent"
      }]
    }
  }

  # A small on-demand group for system pods and the Karpenter controller; GPUs come from Karpenter.
  eks_managed_node_groups = {
    system = {
      ami_type       = "AL2023_x86_64_STANDARD"
      instance_types = ["m7i.xlarge"]
      min_size       = 2
      max_size       = 4
      desired_size   = 2
      labels         = { "pdserve.io/pool" = "system" }
    }
  }

  # The GPU nodes Karpenter launches get this security group only (infra/k8s/karpenter/ec2nodeclass.yaml). EFA's
  # OS-bypass traffic (NIXL over LIBFABRIC between p5 workers) needs a group that allows all traffic to and from
  # itself, in and out (AWS EC2 user guide, docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-start.html).
  node_security_group_additional_rules = {
    ingress_self_all_efa = {
      description = "Node to node, all protocols (EFA)"
      protocol    = "-1"
      from_port   = 0
      to_port     = 0
      type        = "ingress"
      self        = true
    }
    egress_self_all_efa = {
      description = "Node to node, all protocols (EFA)"
      protocol    = "-1"
      from_port   = 0
      to_port     = 0
      type        = "egress"
      self        = true
    }
  }

  node_security_group_tags = {
    "karpenter.sh/discovery" = var.cluster_name
  }
}
