"""Use case: stage a model's weights into `<fsx_root>/models/<model_name>`, verified and published atomically.

The pipeline's stage step (`components/stage.py`) calls :func:`stage`; `pdserve stage` publishes into a folder
it is given and calls runtime.staging.stage.stage_model with its own options (FSx link, include/exclude).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from runtime.staging.layout import staged_model_dir


class StageRequest(BaseModel):
    """One model to stage from S3 (or a folder, or hf://) into the FSx mount."""

    model_config = ConfigDict(extra="forbid")

    source_uri: str = Field(description="Weights to stage: s3://bucket/prefix/, hf://org/repo or a local folder.")
    fsx_root: str = Field(description="FSx for Lustre mount path; the model lands in <fsx_root>/models/<model_name>.")
    model_name: str = Field(description="Served model name: a clean relative path (no '..', no leading '/').")
    s3_endpoint_url: str = Field("", description="S3-compatible endpoint (http(s)://host:port); empty: AWS S3. "
                                                 "Credentials come from the environment, never from the request.")


@dataclass(frozen=True)
class StageOutcome:
    """Where the model was published: ``path``, ``num_files``, ``total_bytes`` (bytes) and ``notes``."""

    name: str
    path: str
    num_files: int
    total_bytes: int
    source: str
    notes: list[str] = field(default_factory=list)

    def metadata(self) -> dict[str, Any]:
        """The KFP Model artifact's metadata: name, path, num_files, total_bytes, source."""
        return {"name": self.name, "path": self.path, "num_files": self.num_files,
                "total_bytes": self.total_bytes, "source": self.source}


def stage(request: StageRequest, *, s3_client: Any = None) -> StageOutcome:
    """Stage ``request.source_uri`` into ``<fsx_root>/models/<model_name>``, every byte verified.

    ``s3_client`` (boto3-like) reads an s3:// source; None: one made for ``s3_endpoint_url`` with credentials
    from the environment (AWS_ACCESS_KEY_ID/..., Pod Identity, IRSA).

    Raises:
        ValueError: ``model_name`` is not a clean relative path (checked before anything is written or a client
            made).
        runtime.staging.manifest.StagingError: missing bucket, empty prefix, checksum mismatch, unsafe key.
    """
    from runtime.staging.stage import stage_model

    dest = staged_model_dir(request.fsx_root, request.model_name)
    if s3_client is None and request.source_uri.startswith("s3://"):
        from runtime.staging.s3 import make_client

        s3_client = make_client(request.s3_endpoint_url or None, transfer_methods=False)
    manifest = stage_model(request.source_uri, dest, s3_client=s3_client, progress=False)
    return StageOutcome(request.model_name, str(dest), len(manifest.files), manifest.total_bytes, request.source_uri)
