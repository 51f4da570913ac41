"""The container image every pdserve KFP component runs in: the CPU build of the pdserve image (runtime/image.py).

Components run in the project image: nothing is pip-installed when a step starts (Google Cloud Pipeline
Components pattern; docs/architecture.md#layers-and-the-dependency-rule). No step needs a GPU (tune models the
GPUs, it does not use one), so they run in the CPU image (kserve/Dockerfile.cpu), not the CUDA one.
`pdserve compile --image` replaces this default in the compiled pipeline (pipelines/stage_tune_promote.py).
"""

from runtime.image import DEFAULT_IMAGE, cpu_image

STEP_IMAGE = cpu_image(DEFAULT_IMAGE)
