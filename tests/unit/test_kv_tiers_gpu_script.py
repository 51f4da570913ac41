"""bench/gpu_kv_tiers.py: the committed plan is what pdserve renders now, and `measure` runs end to end on the CPU
(link and disk parts; the vLLM part needs CUDA and says so)."""

import json
from pathlib import Path

from tests.scripts import load_script

script = load_script("bench/gpu_kv_tiers.py")
REPO = Path(__file__).resolve().parents[2]


def test_the_committed_plan_is_the_current_render(tmp_path):
    out = tmp_path / "plan.json"
    assert script.main(["plan", "--out", str(out)]) == 0
    fresh = json.loads(out.read_text())
    assert fresh == json.loads((REPO / "bench/gpu_kv_tiers_plan.json").read_text())
    cfgs = fresh["kv_transfer_configs"]
    assert cfgs["pd_worker"]["kv_connector"] == "MultiConnector"
    assert cfgs["aggregated"]["kv_connector"] == "OffloadingConnector"
    assert cfgs["aggregated"]["kv_connector_extra_config"]["cpu_bytes_to_use"] == int(script.CPU_TIER_GIB * 2**30)


def test_measure_quick_on_the_cpu_prints_one_json_line(tmp_path, capsys):
    out = tmp_path / "res" / "kv.json"
    assert script.main(["measure", "--device", "cpu", "--quick", "--out", str(out),
                        "--disk-dir", str(tmp_path / "disk")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    d = json.loads(lines[-1])
    assert d == json.loads(out.read_text())
    assert {r["dir"] for r in d["link"]} == {"h2d", "d2h"} and all(r["bytes_per_s"] > 0 for r in d["link"])
    assert d["disk"]["read_bytes_per_s"] > 0 and d["disk"]["bytes"] == 8 << 20
    assert not list((tmp_path / "disk").iterdir())  # the probe file is removed
    assert "vllm" in d["skipped"]


def test_prometheus_samples_are_summed_over_labels_and_prefixes_do_not_match():
    text = ('vllm:kv_offload_load_bytes_total{engine="0"} 10.0\n'
            'vllm:kv_offload_load_bytes_total{engine="1"} 5.0\n'
            'vllm:kv_offload_load_bytes_totalx 99\n# HELP vllm:kv_offload_load_bytes_total x\n')
    assert script._metric(text, "vllm:kv_offload_load_bytes_total") == 15.0
