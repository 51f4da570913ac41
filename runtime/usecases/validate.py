"""Use case: check every pipeline parameter that needs no model and no network, before anything is staged.

The pipeline's first step (`components/validate.py`) calls :func:`validate`, so a run fails before staging
copies tens of GB when tune or promote would refuse its parameters anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from runtime.config import check_model_name
from runtime.usecases.tune import TuneSettings, check_tune_settings


class ValidateRequest(TuneSettings):
    """The pipeline's parameters: the tuning's (:class:`runtime.usecases.tune.TuneSettings`) and these."""

    model_name: str = Field(description="Served model name: a clean relative path (no '..', no leading '/').")
    traffic_upload_uri: str = Field("", description="s3://bucket/prefix/ promote's runtime ships its traffic "
                                                    "under; empty: off.")


@dataclass(frozen=True)
class ValidateOutcome:
    """The parameters passed; ``notes`` for people (none today)."""

    notes: list[str] = field(default_factory=list)


def validate(request: ValidateRequest) -> ValidateOutcome:
    """Check ``model_name`` (`check_model_name`), the tune parameters (`check_tune_settings`, including the form
    of ``traffic_trace_uri``; its contents are read by the tune step) and ``traffic_upload_uri`` ("" or
    ``s3://bucket/prefix/``, runtime.s3uri.check_upload_uri).

    Raises:
        ValueError: every bad parameter named in one message.
    """
    problems = []
    try:
        check_model_name(request.model_name)
    except ValueError as e:
        problems.append(str(e))
    try:
        check_tune_settings(request)
    except ValueError as e:
        problems.append(str(e))
    if request.traffic_upload_uri:
        from runtime.s3uri import check_upload_uri

        try:
            check_upload_uri(request.traffic_upload_uri)
        except ValueError as e:
            problems.append(str(e).replace("--traffic-upload", "traffic_upload_uri", 1))
    if problems:
        raise ValueError("; ".join(problems))
    return ValidateOutcome()
