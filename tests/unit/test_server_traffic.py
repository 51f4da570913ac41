"""Recorded traffic (runtime.server.traffic.TrafficLog) fed by the runtime's P/D flow.

Specification: every finished request (streaming or not) appends one Mooncake-style line with the workers'
usage token counts and the wall-clock time, and nothing the client sent; the file is the input `pdserve tune
--trace` reads (and the Mooncake parser accepts); an existing log is appended to; a failing write is logged
once and never breaks a request.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

pytest.importorskip("kserve")

from prometheus_client import CollectorRegistry  # noqa: E402

from runtime.engines.client import VllmClient  # noqa: E402
from runtime.server.metrics import RuntimeMetrics  # noqa: E402
from runtime.server.model import PDModel  # noqa: E402
from runtime.server.pairing import RoundRobinPairing  # noqa: E402
from runtime.server.traffic import TrafficLog  # noqa: E402
from runtime.sim.trace import parse_mooncake  # noqa: E402
from runtime.tracking.traces import read_isl_osl  # noqa: E402
from tests.unit.test_server_model import FakeWorkers, _request  # noqa: E402


def _model(workers: FakeWorkers, log: TrafficLog, clock=None) -> PDModel:  # noqa: ANN001
    transport = httpx.MockTransport(workers.handler)
    kw = {} if clock is None else {"clock": clock}
    return PDModel("m", RoundRobinPairing(["http://prefill"], ["http://decode"]),
                   metrics=RuntimeMetrics(CollectorRegistry()),
                   client_factory=lambda url: VllmClient(url, transport=transport), traffic_log=log, **kw)


async def test_each_finished_request_appends_its_usage_and_nothing_the_client_sent(tmp_path):
    path = tmp_path / "t" / "traffic.jsonl"
    path.parent.mkdir()
    path.write_text('{"timestamp":1,"input_length":9,"output_length":9,"hash_ids":[]}\n')  # an earlier run's
    log = TrafficLog(path, wall_clock=lambda: 1_700_000_000.25)
    ticks = iter(range(0, 10_000, 2))  # the model's monotonic clock: every reading 2 s later than the last
    model = _model(FakeWorkers(), log, clock=lambda: float(next(ticks)))
    await model.create_chat_completion(_request(user="alice@example.com"))
    [e async for e in await model.create_chat_completion(_request(stream=True))]
    log.close()
    text = path.read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert [{k: v for k, v in x.items() if k != "timestamp"} for x in lines[1:]] == [
        {"input_length": 5, "output_length": 2, "hash_ids": []}] * 2
    # the timestamp is the ARRIVAL: the finish time less the request's latency (whole 2 s readings here)
    for x in lines[1:]:
        back = 1_700_000_000_250 - x["timestamp"]
        assert back >= 2000 and back % 2000 == 0
    assert "capital" not in text and "alice" not in text  # no prompt, no user field
    assert read_isl_osl(path) == [(9, 9), (5, 2), (5, 2)]
    assert [r.input_tokens for r in parse_mooncake(text.splitlines())] == [9, 5, 5]


async def test_a_failed_request_is_not_recorded(tmp_path):
    log = TrafficLog(tmp_path / "traffic.jsonl")
    model = _model(FakeWorkers(prefill_status=400, decode_status=400), log)
    await model.create_chat_completion(_request())  # both workers reject it: an error to the client
    assert log.lines == 0 and (tmp_path / "traffic.jsonl").read_text() == ""


def test_a_failing_write_is_logged_once_and_does_not_raise(tmp_path, caplog):
    log = TrafficLog(tmp_path / "traffic.jsonl")
    log.close()  # every later write fails
    with caplog.at_level(logging.WARNING, logger="runtime.server.traffic"):
        log.record(3, 4)
        log.record(3, 4)
    assert log.lines == 0
    assert [r.getMessage() for r in caplog.records if "cannot write" in r.getMessage()] != []
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1


def test_an_unwritable_path_fails_at_construction(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):
        TrafficLog(tmp_path / "file" / "traffic.jsonl")
