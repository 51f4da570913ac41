"""Three runtime replicas in front of the same workers elect one planner leader.

Real processes on 127.0.0.1: a prefill and a decode engine stand-in (bench/engine_standin.py: vLLM's OpenAI
routes and /metrics gauge names) and three `python -m runtime.server --planner dry-run --leader-election file`
sharing one lease file. Specification: every replica ticks and exports its decision, exactly one actuates
(`pdserve_planner_leader` 1, `pdserve_planner_actuations_total` growing; the lease file names its process);
after that one is killed (SIGKILL through its own handle: no release), another holds the lease within one
planner interval and actuates from its next tick, and still only one replica actuates.

A loaded machine may pause a replica for seconds. A leader paused past its renew deadline loses the lease by
design, so the checks read the lease record's transition count (it grows each time the lease changes hands):
"only the holder actuates" is checked over stretches in which the lease stayed with one holder, and "never
actuated" where the count shows that a replica never held it. The takeover bound is the election's design
(`ElectionConfig.for_interval`, unit-tested on its own clock in tests/unit/test_leadership.py) read from the
lease record the replicas write; the takeover measured here is allowed the interval plus one lease, as a
paused replica takes over late by the length of its pause, which no clock of the test can leave out.
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
from runtime.planner.leadership import ElectionConfig
from tests.integration.test_server_planner import QWEN3_0_6B, _stop, _wait_http
from tests.integration.test_server_replicas_load import _tokenizer

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

INTERVAL_S = 3.0
WAIT_S = 120.0  # for what a healthy run shows within a few intervals


def _gauges(c: httpx.Client, rt) -> dict[str, float] | None:
    try:
        text = c.get(f"{rt.url}/metrics").text
    except httpx.HTTPError:
        return None
    if "pdserve_planner_ticks_total" not in text:
        return None
    return {n: sample_sum(text, f"pdserve_planner_{n}") for n in ("leader", "actuations_total", "ticks_total",
                                                                   "decode_replicas")}


def _all_gauges(c: httpx.Client, rts: list, deadline: float) -> list[dict[str, float]]:
    while True:
        g = [_gauges(c, rt) for rt in rts]
        if all(x is not None for x in g):
            return g
        assert time.monotonic() < deadline, [rt._tail() for rt in rts]
        time.sleep(0.3)


def _record(lease: Path) -> dict:
    try:
        return json.loads(lease.read_text())
    except (OSError, ValueError):
        return {}


def _holder_index(record: dict, rts: list) -> int | None:
    holder = record.get("holder") or ""
    return next((i for i, rt in enumerate(rts) if holder.endswith(f"/pid-{rt._proc.pid}")), None)


def _hands(record: dict) -> tuple[str, int]:
    """Who holds the lease and how often it changed hands: equal before and after a stretch, the lease stayed
    with that holder throughout (taking it, from a holder or a release, adds one transition)."""
    return record.get("holder") or "", int(record.get("transitions", -1))


def _one_actuator(c: httpx.Client, rts: list, lease: Path, deadline: float):
    """Observe stretches in which every replica of `rts` ticks twice, until one in which the lease stayed with
    one of them that reports leader 1 and actuated; in every such stretch no other replica actuated, and at its
    last tick (decided wholly within the stretch) none reported leader 1. Stretches in which the lease changed
    hands are observed anew. Returns (holder's index, gauges at the stretch's start, gauges at its end)."""
    while True:
        hands = _hands(_record(lease))
        g0 = _all_gauges(c, rts, deadline)
        while True:
            g1 = _all_gauges(c, rts, deadline)
            if all(b["ticks_total"] >= a["ticks_total"] + 2 for a, b in zip(g0, g1)):
                break
            assert time.monotonic() < deadline, (g0, g1)
            time.sleep(0.3)
        after = _record(lease)
        lead = _holder_index(after, rts)
        if _hands(after) == hands and lead is not None:
            for i in range(len(rts)):
                if i != lead:
                    assert g1[i]["actuations_total"] == g0[i]["actuations_total"], (lead, g0, g1)
                    assert g1[i]["leader"] == 0, (lead, g0, g1)
            if g1[lead]["leader"] == 1 and g1[lead]["actuations_total"] > g0[lead]["actuations_total"]:
                return lead, g0, g1
        assert time.monotonic() < deadline, ("no stretch with one leader that actuated", hands, after, g0, g1)


def test_one_of_three_replicas_actuates_and_another_takes_over_when_it_dies(tmp_path):
    from runtime.config import DeploymentSpec, ModelRef, PlannerSpec, PoolSpec
    from runtime.server.launch import RuntimeProcess

    election = ElectionConfig.for_interval(INTERVAL_S)
    assert election.takeover_bound_s <= INTERVAL_S
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
        with httpx.Client(timeout=30) as c:
            # every replica ticks; exactly one is leader and only it actuates
            lead, _, g = _one_actuator(c, rts, lease, time.monotonic() + WAIT_S)
            assert all(x["decode_replicas"] >= 1 for x in g)  # followers compute and export their decisions
            record = _record(lease)
            # the replicas size the election from the planner interval: a lost leader is replaced within it
            assert record["lease_duration_s"] == pytest.approx(election.lease_duration_s), record
            if record["transitions"] == 0:  # the lease never changed hands: no other replica ever actuated
                assert all(x["actuations_total"] == 0 for i, x in enumerate(g) if i != lead), g

            lead = _holder_index(_record(lease), rts)  # the holder now (a paused one may have lost the lease)
            assert lead is not None, _record(lease)
            rts[lead]._proc.kill()  # a lost leader: no release, the lease must expire
            killed_at = time.monotonic()
            rts[lead].stop()
            rest = [rt for i, rt in enumerate(rts) if i != lead]
            allowed_s = INTERVAL_S + election.lease_duration_s  # the interval, plus a lease for a paused replica
            while True:
                now = time.monotonic()  # before the read: a pause of the test itself counts for the replicas
                taken = _record(lease)
                if _holder_index(taken, rest) is not None:
                    break
                assert now - killed_at <= allowed_s, ("no replica took the lease within an interval", taken)
                time.sleep(0.05)
            new = _holder_index(taken, rest)
            base = _all_gauges(c, rest, time.monotonic() + WAIT_S)
            # it actuates from its next tick: of its ticks since the takeover was seen, only the one then under
            # way may have missed it, and one more that a scrape caught counted but not yet actuated, or that a
            # renewal paused past its renew deadline left without leadership
            deadline = time.monotonic() + WAIT_S
            while True:
                g2 = _all_gauges(c, rest, deadline)
                now_hands = _hands(_record(lease))
                if now_hands != _hands(taken):
                    break  # the lease moved on (a paused holder loses it by design): checked below
                if g2[new]["actuations_total"] > base[new]["actuations_total"]:
                    idle = ((g2[new]["ticks_total"] - base[new]["ticks_total"])
                            - (g2[new]["actuations_total"] - base[new]["actuations_total"]))
                    assert idle <= 2, (base, g2)
                    break
                assert time.monotonic() < deadline, ("the new holder never actuated", base, g2, rest[new]._tail())
                time.sleep(0.2)
            # still only one replica actuates
            lead2, _, g3 = _one_actuator(c, rest, lease, time.monotonic() + WAIT_S)
            if _record(lease)["transitions"] == 1:  # one change of hands, the takeover: the other never held it
                assert lead2 == new, (lead2, new)
                assert g3[1 - new]["leader"] == 0 and g3[1 - new]["actuations_total"] == 0, g3
    finally:
        for rt in rts:
            rt.stop()
        for w in workers:
            _stop(w)
