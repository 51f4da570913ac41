"""bench/frontend.py end to end on a small load: real stand-in engines, the real runtime, one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.scripts import REPO


def _run(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/frontend.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={"PATH": "/usr/bin:/bin"})  # no vllm-router on this PATH


def test_frontend_bench_reports_pdserve_against_direct(tmp_path):
    r = _run("--rates", "4,8", "--duration-s", "1.5", "--max-tokens", "6", "--logs", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["bench"] == "frontend" and line["outputs_equal"] is True
    assert line["vllm_router"] is None and line["pdserve_vs_vllm_router_rps_per_core"] is None
    assert line["pdserve_vs_vllm_router_rps_per_core_by_rate"] is None
    direct, pd = line["per_rate"]["direct"], line["per_rate"]["pdserve"]
    assert set(direct) == {"4.0", "8.0"} and set(pd) <= set(direct)
    for rate, s in pd.items():
        assert s["errors"] == 0 and s["done"] == s["offered"] == direct[rate]["offered"] > 0
        assert s["cpu_s"] > 0 and s["ttft_p50_s"] > 0
    # the P/D reference: the client made both legs itself, at the same rates, with the same answers
    ref = line["per_rate"]["direct_pd"]
    assert set(ref) == set(direct)
    for rate, s in ref.items():
        assert s["errors"] == 0 and s["done"] == s["offered"] == direct[rate]["offered"] > 0
        assert s["cpu_s"] is None and s["ttft_p50_s"] > 0
    # every request through pdserve and the P/D reference was one prefill whose kv_transfer_params reached its
    # decode (plus one correctness answer each)
    assert line["prefills"] == line["remote_decodes"] == 2 + sum(s["done"] for s in [*pd.values(), *ref.values()])
    summary = line["pdserve"]
    assert summary["capacity_rps"] in (0.0, 4.0, 8.0)
    if summary["capacity_rps"]:
        assert summary["requests_per_cpu_s"] > 0 and summary["at_rps"] in (4.0, 8.0)
        at = str(summary["at_rps"])
        over_pd = (pd[at]["ttft_p50_s"] - ref[at]["ttft_p50_s"]) * 1000.0
        assert summary["added_ttft_over_pd_p50_ms"] == round(over_pd, 2)


def test_frontend_bench_refuses_a_missing_router_binary(tmp_path):
    r = _run("--vllm-router", str(tmp_path / "nope"), timeout=60)
    assert r.returncode == 2 and "no such executable" in r.stderr


def test_frontend_bench_spreads_load_over_runtime_replicas(tmp_path):
    r = _run("--rates", "6", "--duration-s", "1.5", "--max-tokens", "4", "--replicas", "2", "--logs", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["outputs_equal"] is True
    many = line["per_rate"]["pdserve_x2"]["6.0"]
    assert many["errors"] == 0 and many["done"] == many["offered"] > 0 and many["cpu_s"] > 0
    # both replica processes were started and served: each has its own log and answered the correctness gate
    assert len(list(tmp_path.glob("pdserve_x2-*.log"))) == 2
    one = line["per_rate"]["pdserve"]["6.0"]
    # 4 correctness answers with a prefill leg (direct_pd, pdserve, 2 replicas; direct has none) + every request
    ref = line["per_rate"]["direct_pd"]["6.0"]
    assert line["prefills"] == line["remote_decodes"] == 4 + one["done"] + many["done"] + ref["done"]
    rep = line["pdserve_replicas"]
    assert rep["replicas"] == 2 and set(rep["requests_per_cpu_s_vs_one_by_rate"]) <= {"6.0"}


def test_frontend_bench_refuses_zero_replicas(tmp_path):
    r = _run("--replicas", "0", timeout=60)
    assert r.returncode == 2 and "--replicas must be >= 1" in r.stderr
