"""bench/fleet_scale.py at a tiny size (48 GPUs, 3 minutes): one JSON line from the runtime's own planner and
router, and the request view of the synthetic shapes it replays (runtime/sim/shapes.py `generate_requests`)."""

import json

import numpy as np
import pytest

from runtime.sim import shapes
from tests.scripts import load_script

pytest.importorskip("runtime.perf.model")


def test_prints_one_json_line_with_planner_and_router_costs(tmp_path, capsys):
    bench = load_script("bench/fleet_scale.py")
    out = tmp_path / "fleet.json"
    d = bench.main(["--gpus", "48", "--duration-s", "180", "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and json.loads(lines[0]) == d == json.loads(out.read_text())
    p, r = d["planner"], d["router"]
    assert d["requests"] > 0 and d["rate_scale"] > 0
    for k in ("slo_attainment", "slo_attainment_achievable", "ttft_attainment", "itl_attainment"):
        assert 0 <= p[k] <= 1
    assert p["slo_attainment"] <= min(p["ttft_attainment"], p["itl_attainment"])
    assert p["slo_attainment"] <= p["slo_attainment_achievable"]
    assert p["ticks"] == pytest.approx(180 / 30, abs=1) and 0 < p["tick_ms_p50"] <= p["tick_ms_p99"] <= p["tick_ms_max"]
    assert 0 < p["peak_gpus"] <= 48 and p["gpu_hours"] > 0
    assert r["workers"] == 6 and r["routes"] == d["requests"]  # 48 GPUs / TP8, every request routed once
    assert 0 < r["route_us_p50"] <= r["route_us_p99"] and 0 <= r["ttft_attainment"] <= 1
    assert 0 < r["hit_rate"] <= 1  # agentic sessions share their prefixes
    assert r["gpu_hours"] == pytest.approx(48 * 180 / 3600, rel=0.1)


def test_requests_are_the_generated_trace_with_session_prefix_blocks():
    t = shapes.generate("gamma_agentic", 2.0, 3, 600)
    reqs = shapes.generate_requests("gamma_agentic", 2.0, 3, 600, block_tokens=512)
    assert [q.input_tokens for q in reqs] == t.isl_tokens.tolist()
    assert np.allclose([q.arrival_s for q in reqs], t.arrival_s)
    assert all(len(q.hash_ids) == -(-q.input_tokens // 512) for q in reqs)
    firsts = [q.hash_ids[0] for q in reqs]
    assert len(set(firsts)) <= shapes.AGENT_SESSIONS < len(reqs)  # every request starts with its session's prefix
    chat = shapes.generate_requests("poisson_chat", 1.0, 0, 600)
    ids = [h for q in chat for h in q.hash_ids]
    assert len(ids) == len(set(ids))  # no shared prefix in the chat mix
    with pytest.raises(ValueError, match="block_tokens"):
        shapes.generate_requests("poisson_chat", block_tokens=0)
