"""NVIDIA Dynamo's router as a peer in bench/router.py (runs where ``ai-dynamo-runtime`` is installed).

Two measurements, on exactly the inputs pdserve's router gets:

* ``RadixTree.find_matches`` latency on the synthetic 64-worker / 128-block queries of
  ``bench/router.py:synthetic_index_workload`` (events applied with ``apply_event`` in Dynamo's JSON
  event format, ``tokens_hash`` = our block id, so both indexes hold the same blocks).
* Policy ``dynamo``: Dynamo's real ``SelectionService`` (index + cost + load bookkeeping, no etcd/NATS)
  replays the trace on the same simulated workers (runtime/sim). Each simulated worker publishes its KV
  events in vLLM's ZMQ format (``[topic, seq, msgpack EventBatch]``) on a loopback PUB socket that the
  service subscribes to (``upsert_worker`` with ``kv_events_endpoint``). Trace blocks become synthetic
  token ids (block ``h`` → 512 tokens derived from ``h``), because the service hashes token ids itself.
  After each event batch a sentinel block is published and awaited, so the service's index is as
  current as pdserve's (no advantage from event lag either way). Requests are booked with
  ``select_and_reserve``, ``prefill_complete`` at first token and ``free_reservation`` at completion.
  Dynamo breaks ties randomly even at temperature 0: results are averaged over ``--dynamo-seeds`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
try:
    from dynamo._core import RadixTree, SelectionService  # type: ignore[import-not-found]
except ImportError as exc:  # run as a script, or imported where Dynamo is absent: say where it runs
    raise SystemExit(f"{exc}: bench/router_dynamo_peer.py is bench/router.py's Dynamo peer; it needs "
                     "ai-dynamo-runtime (run bench/router.py --help for the venv it uses)") from exc

from runtime.kv.events import BlockRemoved, BlockStored, KvEvent

SENTINEL_BASE = 7_000_000_000


def _tokens(h: int) -> list[int]:
    """512 synthetic token ids that identify block id ``h`` (unique for h < 1e10)."""
    return [h % 100_003, h // 100_003 + 1] * 256


@dataclass(frozen=True)
class _Decision:
    prefill_worker: str | None
    decode_worker: str


class DynamoSelectionRouter:
    """Adapter: Dynamo ``SelectionService`` behind the replay's RouterLike interface."""

    def __init__(self, worker_ids: Sequence[str], capacity_blocks: int, block_size: int = 512) -> None:
        self.loop = asyncio.new_event_loop()
        self.svc = SelectionService(indexer_threads=1)
        self.ctx = zmq.Context()
        self.pubs: dict[str, zmq.Socket] = {}
        self.num: dict[str, int] = {}
        self.name: dict[int, str] = {}
        self.seq: dict[str, int] = {}
        self.block_size = block_size
        self._sentinel = SENTINEL_BASE
        for i, wid in enumerate(worker_ids, start=1):
            sock = self.ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, 0)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            self.pubs[wid], self.num[wid], self.name[i], self.seq[wid] = sock, i, wid, 0
            self._run(self.svc.upsert_worker, {
                "worker_id": i, "endpoint": f"tcp://127.0.0.1:{port}", "kv_events_endpoint": f"tcp://127.0.0.1:{port}",
                "block_size": block_size, "total_kv_blocks": capacity_blocks})
        for wid in worker_ids:  # ZMQ slow joiner: wait until each subscription delivers
            self._sync(wid)

    def _run(self, make, *a):
        """Run ``make(*a)`` (a Dynamo async method) on our loop; pyo3 needs the loop running at call time."""
        async def call():
            return await make(*a)
        return self.loop.run_until_complete(call())

    def close(self) -> None:
        self.svc.shutdown()
        for s in self.pubs.values():
            s.close(linger=0)
        self.ctx.term()
        self.loop.close()

    # ---------------------------------------------------------------- events
    def _publish(self, wid: str, events: list[list[object]]) -> None:
        payload = msgspec.msgpack.encode([time.time(), events, 0])  # [ts, events, data_parallel_rank]
        self.pubs[wid].send_multipart([b"", self.seq[wid].to_bytes(8, "big"), payload])
        self.seq[wid] += 1

    def _sync(self, wid: str, timeout_s: float = 10.0) -> None:
        """Publish a sentinel block and wait until the service shows it on ``wid``, then drop it."""
        self._sentinel += 1
        s = self._sentinel
        deadline = time.monotonic() + timeout_s
        while True:
            self._publish(wid, [["BlockStored", [s], None, _tokens(s), self.block_size, None, None]])
            for _ in range(200):
                r = self._run(self.svc.overlap_scores, {"token_ids": _tokens(s)})
                if any(w["worker_id"] == self.num[wid] and w["device_blocks"] >= 1 for w in r["workers"]):
                    self._publish(wid, [["BlockRemoved", [s], None]])
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Dynamo never applied the KV events of {wid}")
                time.sleep(0.0005)

    def apply_kv_events(self, worker_id: str, events: Iterable[KvEvent], now_s: float) -> None:
        out: list[list[object]] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                toks: list[int] = []
                for h in ev.block_hashes:
                    toks.extend(_tokens(int(h)))  # type: ignore[arg-type]
                out.append(["BlockStored", list(ev.block_hashes), ev.parent_block_hash, toks, self.block_size,
                            None, None])
            elif isinstance(ev, BlockRemoved):
                out.append(["BlockRemoved", list(ev.block_hashes), None])
            else:
                out.append(["AllBlocksCleared"])
        if out:
            self._publish(worker_id, out)
            self._sync(worker_id)

    # ---------------------------------------------------------------- routing
    def route(self, request_id: str, *, now_s: float, block_hashes: Sequence[Hashable],
              num_prompt_tokens: int) -> _Decision:
        toks: list[int] = []
        for h in block_hashes:
            toks.extend(_tokens(int(h)))  # type: ignore[arg-type]
        r = self._run(self.svc.select_and_reserve, {"token_ids": toks, "selection_id": request_id})
        return _Decision(None, self.name[int(r["worker_id"])])

    def on_first_token(self, request_id: str) -> None:
        self._run(self.svc.prefill_complete, request_id)

    def on_complete(self, request_id: str) -> None:
        self._run(self.svc.free_reservation, request_id)


# -------------------------------------------------------------------- measurements
def radix_latency_repeated(repeats: int) -> dict[str, float]:
    """Median over ``repeats`` runs of each percentile of :func:`radix_latency` (as bench/router.py does
    for pdserve's index)."""
    import statistics

    runs = [radix_latency() for _ in range(max(1, repeats))]
    return {k: round(statistics.median(r[k] for r in runs), 4 if k.endswith("frac") else 2) for k in runs[0]}


def radix_latency(seed: int = 0) -> dict[str, float]:
    """p50/p99 µs of ``RadixTree.find_matches`` on bench/router.py's synthetic queries, with the same
    preemption filter as pdserve's index (process-wide involuntary context switches, so a preempted
    RadixTree worker thread is excluded too)."""
    from bench.router import summarize, synthetic_index_workload, timed

    stored, queries = synthetic_index_workload(seed)
    tree = RadixTree()
    eid = 0
    for w, chains in enumerate(stored):
        for chain in chains:
            ev = {"event_id": eid, "data": {"stored": {"parent_hash": None, "blocks": [
                {"block_hash": h, "tokens_hash": h} for h in chain]}}}
            tree.apply_event(w, json.dumps(ev).encode())
            eid += 1
    lat: list[tuple[float, bool]] = []
    for q in queries:
        timed(lat, tree.find_matches, q)
    out = summarize("radix", lat)
    out["radix_lookups_per_s"] = round(len(lat) / (sum(us for us, _ in lat) / 1e6))
    return out


def dynamo_results(args: argparse.Namespace) -> dict:
    """Dynamo's RadixTree latency and its SelectionService replayed on the trace (mean of seeds)."""
    from bench.router import mean_metrics, metrics, prepare
    from runtime.sim.replay import replay
    from runtime.sim.trace import MOONCAKE_BLOCK_TOKENS, oracle_hit_rate

    out: dict = {"package": "ai-dynamo-runtime"}
    try:
        from importlib.metadata import version

        out["version"] = version("ai-dynamo-runtime")
    except Exception:  # pragma: no cover - metadata missing
        out["version"] = None
    out.update(radix_latency_repeated(getattr(args, "timing_repeats", 5)))
    reqs, workers, timing, capacity, _ = prepare(args)
    oracle = oracle_hit_rate(reqs)
    runs = []
    t0 = time.time()
    for _ in range(max(1, args.dynamo_seeds)):
        router = DynamoSelectionRouter([w.worker_id for w in workers], capacity, MOONCAKE_BLOCK_TOKENS)
        try:
            runs.append(metrics(replay(reqs, router, workers, timing, MOONCAKE_BLOCK_TOKENS), oracle))
        finally:
            router.close()
    out["policy"] = mean_metrics(runs)
    out["replay_wall_s"] = round(time.time() - t0, 1)
    return out
