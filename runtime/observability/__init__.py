"""Operating pdserve: the alert rules (`alerts`) and Grafana dashboards (`dashboards`) as code, written into
infra/k8s/prometheus by `python -m runtime.docs_gen`, and documented in docs/operations.md."""
