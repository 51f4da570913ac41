"""Subscribe to the KV-cache events of vLLM workers over ZMQ (adapter: sockets; decoding in runtime.kv.events).

vLLM's ZMQ publisher (`--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:PORT","topic":"kv-events"}'`,
vllm/distributed/kv_events.py) sends multipart messages `[topic, seq (8 bytes big-endian), msgpack payload]`
from a PUB socket. `KvEventSubscriber` keeps one SUB socket per worker in the running asyncio loop and hands
each decoded batch to a callback, in arrival order per worker. Gaps in the sequence numbers (a slow
subscriber, a restarted worker) are counted; the router's index then lags until later events correct it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from runtime.kv.events import KvEventBatch, KvEventDecodeError, decode_multipart

log = logging.getLogger(__name__)

OnBatch = Callable[[str, KvEventBatch], None]


@dataclass
class SubscriberStats:
    """Per-worker counters: batches received, decode errors, sequence gaps (missed batches)."""

    num_batches: dict[str, int] = field(default_factory=dict)
    num_decode_errors: dict[str, int] = field(default_factory=dict)
    num_missed_batches: dict[str, int] = field(default_factory=dict)


class KvEventSubscriber:
    """SUB sockets on every worker's KV-event endpoint, feeding `on_batch(worker_id, batch)`.

    Args:
        endpoints: `{worker_id: "tcp://host:port"}` (from configuration / WorkerProcess.kv_events_endpoint).
        on_batch: called in the event loop for each decoded batch; exceptions are logged, not raised.
        topic: ZMQ topic prefix to subscribe to ("" = everything).
    """

    def __init__(self, endpoints: Mapping[str, str], on_batch: OnBatch, *, topic: str = "kv-events") -> None:
        self.endpoints = dict(endpoints)
        self.on_batch = on_batch
        self.topic = topic
        self.stats = SubscriberStats()
        self._tasks: list[asyncio.Task] = []
        self._ctx = None
        self._last_seq: dict[str, int] = {}

    def start(self) -> None:
        """Connect and start one reader task per worker in the running loop."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        for worker_id, endpoint in self.endpoints.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
            sock.connect(endpoint)
            self._tasks.append(asyncio.get_running_loop().create_task(self._read(worker_id, sock)))

    async def _read(self, worker_id: str, sock) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    _, seq, batch = decode_multipart(frames)
                except KvEventDecodeError as exc:
                    self.stats.num_decode_errors[worker_id] = self.stats.num_decode_errors.get(worker_id, 0) + 1
                    log.warning("worker %s: undecodable KV-event frame: %s", worker_id, exc)
                    continue
                last = self._last_seq.get(worker_id)
                if last is not None and seq > last + 1:
                    self.stats.num_missed_batches[worker_id] = (
                        self.stats.num_missed_batches.get(worker_id, 0) + seq - last - 1)
                self._last_seq[worker_id] = seq
                self.stats.num_batches[worker_id] = self.stats.num_batches.get(worker_id, 0) + 1
                try:
                    self.on_batch(worker_id, batch)
                except Exception:  # a bad batch must not kill the subscription
                    log.exception("worker %s: applying KV events failed", worker_id)
        finally:
            sock.close(linger=0)

    async def stop(self) -> None:
        """Cancel the readers and close the sockets."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
