# CloudWatch: the Amazon CloudWatch Observability EKS add-on (enabled in vpc_eks.tf, settings here) (CloudWatch agent + Fluent Bit: Container Insights
# with enhanced observability, container logs) and the pdserve runtime's Prometheus metrics, scraped by the same
# agent and sent to CloudWatch as embedded-metric-format logs (namespace ContainerInsights/Prometheus). The
# in-cluster Prometheus (infra/k8s/prometheus) keeps the full series for the dashboards and alert rules; CloudWatch
# gets the counters and gauges (the agent's EMF processor does not export histogram buckets, so latency reaches
# CloudWatch as the planner's observed p90 gauges).

resource "aws_iam_role" "cloudwatch_agent" {
  name               = "${var.cluster_name}-cloudwatch-agent"
  assume_role_policy = data.aws_iam_policy_document.pod_identity_trust.json
}

resource "aws_iam_role_policy_attachment" "cloudwatch_agent" {
  role       = aws_iam_role.cloudwatch_agent.name
  policy_arn = "arn:aws:iam::aws:policy/CloudWatchAgentServerPolicy"
}

locals {
  cloudwatch_prometheus_log_group = "/aws/containerinsights/${var.cluster_name}/prometheus"

  # The runtime pods KServe creates for every InferenceService in namespace pdserve, port 8080, /metrics
  # (kserve/clusterservingruntime.yaml).
  cloudwatch_prometheus_scrape = {
    global = { scrape_interval = "30s", scrape_timeout = "10s" }
    scrape_configs = [{
      job_name              = "pdserve-runtime"
      metrics_path          = "/metrics"
      kubernetes_sd_configs = [{ role = "pod", namespaces = { names = ["pdserve"] } }]
      relabel_configs = [
        { source_labels = ["__meta_kubernetes_pod_label_serving_kserve_io_inferenceservice"], regex = ".+", action = "keep" },
        { source_labels = ["__meta_kubernetes_pod_container_port_number"], regex = "8080", action = "keep" },
        { source_labels = ["__meta_kubernetes_namespace"], target_label = "Namespace" },
        { source_labels = ["__meta_kubernetes_pod_label_serving_kserve_io_inferenceservice"], target_label = "InferenceService" },
        { source_labels = ["__meta_kubernetes_pod_name"], target_label = "pod_name" },
      ]
    }]
  }

  cloudwatch_agent_config = {
    logs = {
      metrics_collected = {
        kubernetes = { enhanced_container_insights = true }
        prometheus = {
          cluster_name           = var.cluster_name
          log_group_name         = local.cloudwatch_prometheus_log_group
          prometheus_config_path = "/etc/prometheusconfig/prometheus.yaml"
          emf_processor = {
            metric_declaration = [{
              source_labels    = ["job"]
              label_matcher    = "^pdserve-runtime$"
              dimensions       = [["ClusterName", "Namespace", "InferenceService"]]
              metric_selectors = ["^pdserve_requests_total$", "^pdserve_requests_in_flight$", "^pdserve_prefill_fallbacks_total$", "^pdserve_migrations_total$", "^pdserve_kv_lease_expiries_total$", "^pdserve_kv_late_reads_total$", "^pdserve_worker_breaker_state$", "^pdserve_requests_shed_total$", "^pdserve_planner_.*"]
            }]
          }
        }
      }
    }
  }

  # The add-on's configuration_values (its Helm chart's values, aws-observability/helm-charts
  # amazon-cloudwatch-observability): the agent's config, its Prometheus scrape config, container logs.
  cloudwatch_observability_config = jsonencode({
    agent = {
      config = local.cloudwatch_agent_config
      # the agent runs on every node: the target allocator hands each runtime pod to one agent, not to all
      prometheus = { config = local.cloudwatch_prometheus_scrape, targetAllocator = { enabled = true } }
    }
    containerLogs = { enabled = true }
  })
}
