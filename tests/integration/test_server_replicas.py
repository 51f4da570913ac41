"""Three runtime replicas in front of the same workers elect one planner leader.

Real processes on 127.0.0.1: a prefill and a decode engine stand-in (bench/engine_standin.py: vLLM's OpenAI
routes and /metrics gauge names) and three `python -m runtime.server --planner dry-run --leader-election file`
sharing one lease file. Specification: every replica ticks and exports its decision, exactly one actuates
(`pdserve_planner_leader` 1, `pdserve_planner_actuations_total` growing; the lease file names its process);
after that one is killed (SIGKILL through its own handle: no release), another holds the lease within one
planner interval and actuates from its next tick, and still only one replica actuates.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runtime.engines.metrics import sample_sum
from runtime.engines.vllm_worker import free_port
from runtime.paths import REPO_ROOT
from tests.integration.test_server_planner import QWEN3_0_6B, _stop, _wait_http
from tests.integration.test_server_replicas_load import _tokenizer

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

INTERVAL_S = 3.0


def _gauges(c: httpx.Client, rt) -> dict[str, float] | None:
    try:
        text = c.get(f"{rt.url}/metrics").text
    except httpx.HTTPError:
        return None
    if "pdserve_planner_ticks_total" not in text:
        return None
    return {n: sample_sum(text, f"pdserve_planner_{n}") for n in ("leader", "actuations_total", "ticks_total",
                                                                   "decode_replicas")}


def _holder(lease: Path) -> str:
    try:
        return json.loads(lease.read_text()).get("holder") or ""
    except (OSError, ValueError):
        return ""


def test_one_of_three_replicas_actuates_and_another_takes_over_when_it_dies(tmp_path):
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
    from runtime.server.launch import RuntimeProcess

    ports = [free_port(), free_port()]
    workers = [subprocess.Popen([sys.executable, str(REPO_ROOT / "bench/engine_standin.py"), "--port", str(p),
                                 "--model", "m", "--engine-id", f"w{i}"]) for i, p in enumerate(ports)]
    lease = tmp_path / "planner-leader.json"
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    _tokenizer(tmp_path / "tok")  # the KV router measures each replica's share of the traffic
    spec = DeploymentSpec(model=ModelRef(name="m"), gpu="H100-SXM",
                          prefill=PoolSpec(replicas=1, min_replicas=1, max_replicas=4),
                          decode=PoolSpec(replicas=1, min_replicas=1, max_replicas=4),
                          planner=PlannerSpec(mode="sla", predictor="constant"))
    rts = [RuntimeProcess("m", prefill_urls=[f"http://127.0.0.1:{ports[0]}"],
                          decode_urls=[f"http://127.0.0.1:{ports[1]}"], log_path=tmp_path / f"runtime-{i}.log",
                          extra_args=["--planner", "dry-run", "--planner-interval-s", str(INTERVAL_S),
                                      "--deployment-spec", spec.model_dump_json(),
                                      "--model-config", str(tmp_path / "config.json"),
                                      "--leader-election", "file", "--leader-lease-file", str(lease),
                                      "--router", "kv", "--tokenizer-dir", str(tmp_path / "tok")])
           for i in range(3)]
    try:
        for p in ports:
            _wait_http(f"http://127.0.0.1:{p}/health")
        for rt in rts:
            rt.start()
        for rt in rts:
            rt.wait_ready(180)
        with httpx.Client(timeout=5) as c:
            # every replica ticks at least twice; then exactly one is leader and only it has actuated
            deadline = time.monotonic() + 60
            while True:
                g = [_gauges(c, rt) for rt in rts]
                if all(x is not None and x["ticks_total"] >= 2 for x in g):
                    break
                assert time.monotonic() < deadline, [rt._tail() for rt in rts]
                time.sleep(0.3)
            leaders = [i for i, x in enumerate(g) if x["leader"] == 1]
            assert len(leaders) == 1, g
            (lead,) = leaders
            assert g[lead]["actuations_total"] >= 1
            assert all(x["actuations_total"] == 0 for i, x in enumerate(g) if i != lead), g
            assert all(x["decode_replicas"] >= 1 for x in g)  # followers compute and export their decisions
            assert _holder(lease).endswith(f"/pid-{rts[lead]._proc.pid}")

            rts[lead]._proc.kill()  # a lost leader: no release, the lease must expire
            killed_at = time.monotonic()
            rts[lead].stop()
            rest = [rt for i, rt in enumerate(rts) if i != lead]
            pids = {f"/pid-{rt._proc.pid}" for rt in rest}
            while not any(_holder(lease).endswith(p) for p in pids):
                assert time.monotonic() - killed_at <= INTERVAL_S, "no replica took the lease within an interval"
                time.sleep(0.05)
            took_s = time.monotonic() - killed_at
            new = next(rt for rt in rest if _holder(lease).endswith(f"/pid-{rt._proc.pid}"))
            before = _gauges(c, new)["actuations_total"]
            deadline = time.monotonic() + 3 * INTERVAL_S  # its next tick actuates
            while True:
                g2 = {id(rt): _gauges(c, rt) for rt in rest}
                if g2[id(new)]["actuations_total"] > before and g2[id(new)]["leader"] == 1:
                    break
                assert time.monotonic() < deadline, (took_s, g2, new._tail())
                time.sleep(0.2)
            other = next(rt for rt in rest if rt is not new)
            assert g2[id(other)]["leader"] == 0 and g2[id(other)]["actuations_total"] == 0, g2
    finally:
        for rt in rts:
            rt.stop()
        for w in workers:
            _stop(w)
