"""The container image every pdserve KFP component runs in (built from kserve/Dockerfile.cpu or Dockerfile)."""

# Components run in the project image: nothing is pip-installed when a step starts (Google Cloud Pipeline
# Components pattern; docs/architecture.md#layers-and-the-dependency-rule).
PDSERVE_IMAGE = "public.ecr.aws/pdserve/pdserve-runtime:0.1.0"
