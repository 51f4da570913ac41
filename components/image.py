"""The container image every pdserve KFP component runs in (built from kserve/Dockerfile.cpu or Dockerfile)."""

# Components run in the project image: nothing is pip-installed when a step starts (GCPC pattern, DESIGN.md style 7).
PDSERVE_IMAGE = "public.ecr.aws/pdserve/pdserve-runtime:0.1.0"
