"""The metrics catalog (runtime.server.metrics) and the values the runtime and planner export for it: ITL,
in-flight requests, queue wait, predicted prefix tokens, the router's KV-event feed, GPUs against the budget."""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("kserve")

from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.engines.kv_events import SubscriberStats  # noqa: E402
from runtime.planner.types import PlannerConfig, ScalingDecision  # noqa: E402
from runtime.server.metrics import KvIndexCollector, catalog  # noqa: E402
from runtime.server.planner_loop import PlannerGauges  # noqa: E402
from tests.unit.test_server_model import FakeWorkers, _model, _request  # noqa: E402


def test_catalog_has_at_least_20_own_families_with_prometheus_names():
    own = [m for m in catalog() if m.source in ("runtime", "planner")]
    names = [m.name for m in catalog()]
    assert len(own) >= 20 and len(names) == len(set(names))
    for m in own:
        assert re.fullmatch(r"pdserve_[a-z0-9_]+", m.name), m.name
        assert m.name.endswith("_total") == (m.type == "counter"), m.name
        assert m.help, m.name
    assert {"vLLM", "DCGM exporter"} <= {m.source for m in catalog()}


async def test_a_request_records_itl_queue_wait_and_leaves_nothing_in_flight():
    model, reg = _model(FakeWorkers())
    await model.create_chat_completion(_request())  # decode answers 2 completion tokens
    labels = {"endpoint": "chat", "mode": "remote"}
    assert reg.get_sample_value("pdserve_itl_seconds_count", labels) == 1
    assert reg.get_sample_value("pdserve_queue_wait_seconds_count", {"endpoint": "chat"}) == 1
    assert reg.get_sample_value("pdserve_requests_in_flight", {"endpoint": "chat"}) == 0


async def test_a_stream_records_itl_and_leaves_nothing_in_flight():
    model, reg = _model(FakeWorkers())
    events = [e async for e in await model.create_chat_completion(_request(stream=True))]
    assert events[-1] == "data: [DONE]\n\n"
    assert reg.get_sample_value("pdserve_itl_seconds_count", {"endpoint": "chat", "mode": "remote"}) == 1
    assert reg.get_sample_value("pdserve_requests_in_flight", {"endpoint": "chat"}) == 0


class _Tokens:
    def token_ids(self, path, body):
        return list(range(20))


async def test_predicted_prefix_tokens_are_overlap_blocks_times_block_size_at_most_the_prompt():
    model, reg = _model(FakeWorkers())
    model.tokenizer = _Tokens()
    choose = model.pairing.choose
    model.pairing.block_size_tokens = 4
    for overlap, predicted in ((3, 12), (9, 20)):
        model.pairing.choose = lambda req, o=overlap: dataclasses.replace(choose(req), overlap_blocks=o)
        await model.create_chat_completion(_request())
    assert reg.get_sample_value("pdserve_prompt_tokens_total") == 40
    assert reg.get_sample_value("pdserve_prefix_predicted_tokens_total") == 12 + 20


def test_kv_index_collector_exports_per_worker_batches_gaps_and_age():
    reg = CollectorRegistry()
    col = KvIndexCollector()
    reg.register(col)
    assert reg.get_sample_value("pdserve_router_kv_event_age_seconds", {"worker": "p0"}) is None  # no source yet
    stats = SubscriberStats(num_batches={"p0": 5, "d0": 2}, num_missed_batches={"d0": 3})
    col.source = lambda: (stats, {"p0": 100.0, "d0": 130.0}, lambda: 160.0)
    assert reg.get_sample_value("pdserve_router_kv_event_batches_total", {"worker": "p0"}) == 5
    assert reg.get_sample_value("pdserve_router_kv_missed_batches_total", {"worker": "p0"}) == 0
    assert reg.get_sample_value("pdserve_router_kv_missed_batches_total", {"worker": "d0"}) == 3
    assert reg.get_sample_value("pdserve_router_kv_event_age_seconds", {"worker": "p0"}) == 60
    assert reg.get_sample_value("pdserve_router_kv_event_age_seconds", {"worker": "d0"}) == 30


def test_planner_gauges_export_gpus_budget_and_scale_events():
    reg = CollectorRegistry()
    g = PlannerGauges(reg)
    cfg = PlannerConfig(prefill_tp=2, decode_tp=4, gpu_budget=16)
    first = ScalingDecision(now_s=0, prefill_replicas=1, decode_replicas=1)
    g.export_gpus(first, cfg, None)
    assert reg.get_sample_value("pdserve_planner_gpus") == 6
    assert reg.get_sample_value("pdserve_planner_gpu_budget") == 16
    assert reg.get_sample_value("pdserve_planner_scale_events_total", {"pool": "prefill", "direction": "up"}) == 0
    g.export_gpus(ScalingDecision(now_s=1, prefill_replicas=2, decode_replicas=1), cfg, first)
    g.export_gpus(ScalingDecision(now_s=2, prefill_replicas=2, decode_replicas=0), cfg,
                  ScalingDecision(now_s=1, prefill_replicas=2, decode_replicas=1))
    assert reg.get_sample_value("pdserve_planner_scale_events_total", {"pool": "prefill", "direction": "up"}) == 1
    assert reg.get_sample_value("pdserve_planner_scale_events_total", {"pool": "decode", "direction": "down"}) == 1
    assert reg.get_sample_value("pdserve_planner_scale_events_total", {"pool": "decode", "direction": "up"}) == 0
