"""LocalDeployment wiring (runtime.server.launch), checked without starting vLLM or the runtime.

Specification: one prefill and one decode worker at most per pool locally, CPU dtype override, the runtime
pointed at exactly those workers; with router="kv" the runtime gets the router settings, block size,
tokenizer folder and each worker's KV-event endpoint; a bad router name is rejected; stopping says one
`stopped` line per process it stops, the runtime's included (stand-in processes run in their place).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from runtime.config import DeploymentSpec, ModelRef, PoolSpec, RouterSpec
from runtime.server.launch import LocalDeployment


def _spec(**kw) -> DeploymentSpec:
    return DeploymentSpec(model=ModelRef(name="tiny", path="/m"), prefill=PoolSpec(tp=1, replicas=3),
                          decode=PoolSpec(tp=2, replicas=4), **kw)


def _flag_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_pools_are_capped_and_runtime_points_at_the_workers(tmp_path):
    dep = LocalDeployment(_spec(), Path("/m"), log_dir=tmp_path)
    assert [w.role for w in dep.workers] == ["prefill", "decode"]
    assert all(w.args[w.args.index("--dtype") + 1] == "float32" for w in dep.workers)
    args = dep.runtime.args
    assert _flag_values(args, "--prefill-url") == [dep.prefill_workers[0].base_url]
    assert _flag_values(args, "--decode-url") == [dep.decode_workers[0].base_url]
    assert "--router" not in args
    assert dep.decode_metrics_url == dep.decode_workers[0].metrics_url
    assert dep.runtime_url == f"http://127.0.0.1:{dep.runtime.port}"


def test_aggregated_spec_starts_no_prefill_worker(tmp_path):
    spec = DeploymentSpec(model=ModelRef(name="tiny"), prefill=PoolSpec(replicas=0, min_replicas=0))
    dep = LocalDeployment(spec, Path("/m"), log_dir=tmp_path)
    assert dep.prefill_workers == [] and dep.prefill_metrics_url is None
    assert _flag_values(dep.runtime.args, "--prefill-url") == []


def test_kv_router_gets_settings_tokenizer_and_event_endpoints(tmp_path):
    spec = _spec(router=RouterSpec(policy="kv_aware", disagg_min_uncached_tokens=64))
    dep = LocalDeployment(spec, Path("/models/tiny"), log_dir=tmp_path, router="kv", enable_kv_events=True)
    args = dep.runtime.args
    assert _flag_values(args, "--router") == ["kv"]
    assert json.loads(_flag_values(args, "--router-spec")[0])["disagg_min_uncached_tokens"] == 64
    assert _flag_values(args, "--block-size") == [str(spec.engine.block_size_tokens)]
    assert _flag_values(args, "--tokenizer-dir") == ["/models/tiny"]
    assert _flag_values(args, "--prefill-kv-events") == [dep.prefill_workers[0].kv_events_endpoint]
    assert _flag_values(args, "--decode-kv-events") == [dep.decode_workers[0].kv_events_endpoint]


def test_unknown_router_is_rejected():
    with pytest.raises(ValueError, match="router"):
        LocalDeployment(_spec(), Path("/m"), router="magic")


def test_stop_before_start_is_harmless_and_says_nothing(tmp_path):
    said: list[str] = []
    console = type("Lines", (), {"print": lambda self, msg: said.append(msg)})()
    LocalDeployment(_spec(), Path("/m"), log_dir=tmp_path, console=console).stop()
    assert said == []


def test_local_workers_use_ucx_even_when_the_spec_names_libfabric(tmp_path):
    from runtime.config import EngineSpec

    spec = _spec(engine=EngineSpec(kv_backends=["LIBFABRIC"]))
    dep = LocalDeployment(spec, Path("/m"), log_dir=tmp_path)
    for w in dep.workers:
        cfg = json.loads(w.args[w.args.index("--kv-transfer-config") + 1])
        assert cfg["kv_connector_extra_config"]["backends"] == ["UCX"]
    assert spec.engine.kv_backends == ["LIBFABRIC"]  # the spec itself is untouched


def test_cpu_runtime_nudges_prefill_workers_unless_turned_off(tmp_path):
    from runtime.server.launch import CPU_PREFILL_NUDGE_AFTER_S

    args = LocalDeployment(_spec(), Path("/m"), log_dir=tmp_path).runtime.args
    assert _flag_values(args, "--prefill-nudge-after-s") == [str(CPU_PREFILL_NUDGE_AFTER_S)]
    args = LocalDeployment(_spec(), Path("/m"), log_dir=tmp_path, prefill_nudge_after_s=3.5).runtime.args
    assert _flag_values(args, "--prefill-nudge-after-s") == ["3.5"]
    args = LocalDeployment(_spec(), Path("/m"), log_dir=tmp_path, prefill_nudge_after_s=0).runtime.args
    assert "--prefill-nudge-after-s" not in args


def test_the_runtime_is_told_the_workers_kv_lease(tmp_path):
    from runtime.config import EngineSpec

    spec = DeploymentSpec(model=ModelRef(name="m", path=str(tmp_path)), engine=EngineSpec(kv_lease_s=45))
    args = LocalDeployment(spec, tmp_path, log_dir=tmp_path).runtime.args
    assert args[args.index("--kv-lease-s") + 1] == "45"
    assert "--kv-lease-s" not in LocalDeployment(DeploymentSpec(model=ModelRef(name="m", path=str(tmp_path))),
                                                 tmp_path, log_dir=tmp_path).runtime.args


def test_stop_says_one_stopped_line_per_process_the_runtime_included(tmp_path):
    said: list[str] = []
    console = type("Lines", (), {"print": lambda self, msg: said.append(msg)})()
    dep = LocalDeployment(_spec(), Path("/m"), log_dir=tmp_path, console=console)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]  # a real process in each one's place
    try:
        for proc in [dep.runtime, *dep.workers]:
            proc.args = sleeper
            proc.start()
        procs = [dep.runtime._proc, *(w._proc for w in dep.workers)]
    finally:
        dep.stop()
    assert said == [f"stopped pdserve runtime {dep.runtime_url}",
                    *(f"stopped {w.role} worker {w.base_url}" for w in dep.workers)]
    assert all(p.poll() is not None for p in procs)
    dep.stop()  # a second stop stops nothing and says nothing
    assert len(said) == 1 + len(dep.workers)

