"""The compiled KFP pipeline: every step mounts the FSx claim the `pvc_name` parameter names (the
InferenceService rendered by promote uses that parameter too, so the two can never point at different
claims), at the /fsx path the steps read."""

from __future__ import annotations

import pytest
import yaml

pytest.importorskip("kfp")

from pipelines.stage_tune_promote import FSX_MOUNT, compile_pipeline  # noqa: E402


def test_every_step_mounts_the_claim_named_by_the_pvc_name_parameter(tmp_path):
    docs = list(yaml.safe_load_all(compile_pipeline(tmp_path / "p.yaml").read_text()))
    platform = next(d for d in docs if "platforms" in d)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == {"exec-stage-weights", "exec-tune-tp", "exec-promote"}
    for name, ex in executors.items():
        (mount,) = ex["pvcMount"]
        assert mount["mountPath"] == FSX_MOUNT, name
        assert mount["pvcNameParameter"] == {"componentInputParameter": "pvc_name"}, name
