"""Subscribe to the KV-cache events of vLLM workers over ZMQ (adapter: sockets; decoding in runtime.kv.events).

vLLM's ZMQ publisher (`--kv-events-config '{"publisher":"zmq","endpoint":"tcp://*:PORT","topic":"kv-events"}'`,
vllm/distributed/kv_events.py) sends multipart messages `[topic, seq (8 bytes big-endian), msgpack payload]`
from a PUB socket. `KvEventSubscriber` keeps one SUB socket and one reader task per worker in the running
asyncio loop and hands each decoded batch to a callback, in arrival order per worker.

Events are incremental, so one lost batch (a slow subscriber overflowing ZMQ's high-water mark) can leave
the router believing forever in a block the worker evicted. A gap in the sequence numbers (missed batches)
or a sequence number that does not move forward (the worker restarted: vLLM's publisher counts from 0 again,
with an empty cache), and a batch with malformed events (left out by the decoder: one may have been a
removal) therefore resynchronise: the batch is handed on with an `AllBlocksCleared` in front, so the
worker's index entries and hash translations are dropped and rebuilt from the events that follow — the
router under-reports that worker's cache until then, it never reports a block the worker lacks. All are
counted (`SubscriberStats.num_missed_batches`, `num_invalid_events`, `num_resyncs`) and logged. A message
that fails to decode at all is counted (`num_decode_errors`) and dropped: the gap it leaves resyncs.

Workers come and go at run time (discovery, runtime/server/discovery_sync.py): `add(worker_id, endpoint)`
opens a subscription, `remove(worker_id)` closes it at once — once `remove` returns, no further batch of that
worker reaches the callback, so a worker dropped from the router index cannot re-enter it through a late
event.

A worker with data parallelism (`--data-parallel-size N`) publishes one stream per DP rank: rank r's publisher
binds the configured endpoint's port + r (vLLM's `ZmqEventPublisher.offset_endpoint_port`) and labels its
batches `data_parallel_rank` r. `rank_endpoint` gives rank r's endpoint; each rank is subscribed under its
own id (runtime.server.routing `WorkerEndpoint.kv_event_subscriptions`). On a worker spanning nodes r is the
global rank (vLLM's `data_parallel_index`) and the publisher binds on the node that runs the rank, so its host
is that pod's (runtime/deploy/discovery.py `PoolMembership.rank_endpoints`), its port still the port + r.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from runtime.kv.events import AllBlocksCleared, KvEventBatch, KvEventDecodeError, decode_multipart

log = logging.getLogger(__name__)

OnBatch = Callable[[str, KvEventBatch], None]


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The KV-event endpoint of data-parallel rank `rank` of a worker whose publisher is configured at
    `endpoint`: the endpoint itself for rank 0, else its TCP port + `rank` (vLLM 0.28
    `ZmqEventPublisher.offset_endpoint_port`).

    Raises:
        ValueError: `rank` < 0, or `rank` > 0 with an endpoint that is not "tcp://host:port" (vLLM offsets
            only TCP ports; it refuses an ipc endpoint with data parallelism).
    """
    if rank < 0:
        raise ValueError(f"data-parallel rank {rank} < 0")
    if rank == 0:
        return endpoint
    base, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"KV-event endpoint {endpoint!r}: data-parallel rank {rank} needs a tcp://host:port "
                         "endpoint (vLLM publishes rank r on the port + r)")
    return f"{base}:{int(port) + rank}"


@dataclass
class SubscriberStats:
    """Per-worker counters of the current subscriptions: batches received, undecodable frames, malformed
    events left out of decoded batches, sequence gaps (missed batches), resynchronisations (a gap, a
    restarted worker or malformed events in a batch; see the module docstring). A removed worker's counters
    are dropped with its subscription (keys ⊆ subscribed workers); `num_opened`/`num_closed` count
    subscriptions opened and closed over the subscriber's life."""

    num_batches: dict[str, int] = field(default_factory=dict)
    num_decode_errors: dict[str, int] = field(default_factory=dict)
    num_invalid_events: dict[str, int] = field(default_factory=dict)
    num_missed_batches: dict[str, int] = field(default_factory=dict)
    num_resyncs: dict[str, int] = field(default_factory=dict)
    num_opened: int = 0
    num_closed: int = 0

    def forget(self, worker_id: str) -> None:
        """Drop one worker's counters."""
        for d in (self.num_batches, self.num_decode_errors, self.num_invalid_events, self.num_missed_batches,
                  self.num_resyncs):
            d.pop(worker_id, None)

    @staticmethod
    def bump(counter: dict[str, int], worker_id: str, n: int = 1) -> None:
        """Add `n` to one worker's entry of `counter`."""
        counter[worker_id] = counter.get(worker_id, 0) + n


def _log_reader_end(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s: KV-event reader ended: %r (the router's index of this worker now lags)",
                  task.get_name(), task.exception())


class KvEventSubscriber:
    """SUB sockets on every worker's KV-event endpoint, feeding `on_batch(worker_id, batch)`.

    Args:
        endpoints: initial `{worker_id: "tcp://host:port" or "ipc:///path"}` (configuration /
            WorkerProcess.kv_events_endpoint);
            more are added with `add` and dropped with `remove`, before or after `start`.
        on_batch: called in the event loop for each decoded batch; exceptions are logged, not raised.
        topic: ZMQ topic prefix to subscribe to ("" = everything).

    `endpoints` holds the current subscriptions (`{worker_id: endpoint}`); after `start`, each has a reader
    task and a socket until `remove` or `stop`.
    """

    def __init__(self, endpoints: Mapping[str, str], on_batch: OnBatch, *, topic: str = "kv-events") -> None:
        self.endpoints = dict(endpoints)
        self.on_batch = on_batch
        self.topic = topic
        self.stats = SubscriberStats()
        self._tasks: dict[str, asyncio.Task] = {}
        self._socks: dict[str, object] = {}
        self._ctx = None
        self._last_seq: dict[str, int] = {}

    @property
    def active_workers(self) -> tuple[str, ...]:
        """Sorted ids of the workers with an open socket and a running reader (empty before `start`)."""
        return tuple(sorted(self._tasks))

    def start(self) -> None:
        """Connect and start one reader task per worker in the running loop.

        Raises:
            ValueError: an endpoint ZMQ cannot connect to (message names the worker and endpoint); the
                subscriptions opened before it stay open (close them with `stop`).
        """
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        for worker_id, endpoint in list(self.endpoints.items()):
            if worker_id not in self._tasks:
                self._open(worker_id, endpoint)

    def add(self, worker_id: str, endpoint: str) -> bool:
        """Subscribe to `worker_id`'s events at `endpoint` ("tcp://host:port", IPv6 hosts in brackets; or
        "ipc:///path", a same-host worker's Unix socket).

        Before `start` the endpoint is only recorded. A worker already subscribed elsewhere is
        resubscribed (its old socket closed, its counters reset).

        Returns:
            False when the worker is already subscribed to `endpoint` (nothing done), else True.

        Raises:
            ValueError: ZMQ cannot connect to `endpoint` (nothing recorded; an old subscription of the
                worker is closed).
        """
        if self.endpoints.get(worker_id) == endpoint:
            return False
        self.remove(worker_id)
        if self._ctx is not None:
            self._open(worker_id, endpoint)
        self.endpoints[worker_id] = endpoint
        return True

    def remove(self, worker_id: str) -> bool:
        """Unsubscribe `worker_id`: cancel its reader, close its socket and drop its counters; no batch
        of it reaches `on_batch` afterwards. Returns False for an unknown worker."""
        if self.endpoints.pop(worker_id, None) is None:
            return False
        task = self._tasks.pop(worker_id, None)
        sock = self._socks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        if sock is not None:
            sock.close(linger=0)
            self.stats.num_closed += 1
        self._last_seq.pop(worker_id, None)
        self.stats.forget(worker_id)
        return True

    def _open(self, worker_id: str, endpoint: str) -> None:
        import zmq

        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            if "://[" in endpoint:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"worker {worker_id!r}: cannot subscribe to KV events at {endpoint!r}: {exc}") from None
        self._socks[worker_id] = sock
        task = asyncio.get_running_loop().create_task(self._read(worker_id, sock), name=f"kv-events:{worker_id}")
        task.add_done_callback(_log_reader_end)
        self._tasks[worker_id] = task
        self.stats.num_opened += 1

    async def _read(self, worker_id: str, sock) -> None:
        try:
            while True:
                frames = await sock.recv_multipart()
                try:
                    _, seq, batch = decode_multipart(frames)
                except Exception as exc:  # noqa: BLE001 - not only KvEventDecodeError: nothing restarts a reader
                    # the message is lost like a missed batch: the seq gap it leaves resyncs the worker
                    self.stats.bump(self.stats.num_decode_errors, worker_id)
                    log.warning("worker %s: undecodable KV-event frame: %s", worker_id,
                                exc if isinstance(exc, KvEventDecodeError) else repr(exc))
                    continue
                if batch.num_invalid_events:
                    self.stats.bump(self.stats.num_invalid_events, worker_id, batch.num_invalid_events)
                    log.warning("worker %s: %d malformed KV event(s) skipped, first: %s; its index entry is "
                                "cleared and rebuilt from new events", worker_id, batch.num_invalid_events,
                                batch.first_error)
                batch = self._check_seq(worker_id, seq, batch)
                self.stats.bump(self.stats.num_batches, worker_id)
                try:
                    self.on_batch(worker_id, batch)
                except Exception:  # a bad batch must not kill the subscription
                    log.exception("worker %s: applying KV events failed", worker_id)
        finally:
            sock.close(linger=0)

    def _check_seq(self, worker_id: str, seq: int, batch: KvEventBatch) -> KvEventBatch:
        """Track `worker_id`'s sequence number; after a gap or a reset, `batch` with an `AllBlocksCleared`
        in front (the worker's index entry is rebuilt from here on). A batch with malformed events is a
        resync too: the decoder has put the `AllBlocksCleared` in front already (runtime.kv.events)."""
        last = self._last_seq.get(worker_id)
        self._last_seq[worker_id] = seq
        if last is None or seq == last + 1:
            if not batch.num_invalid_events:
                return batch
        elif seq > last + 1:
            self.stats.bump(self.stats.num_missed_batches, worker_id, seq - last - 1)
            log.warning("worker %s: %d KV-event batch(es) missed (seq %d after %d); its index entry is "
                        "cleared and rebuilt from new events", worker_id, seq - last - 1, seq, last)
        else:
            log.warning("worker %s: KV-event seq went back from %d to %d (worker restarted?); its index "
                        "entry is cleared and rebuilt from new events", worker_id, last, seq)
        self.stats.bump(self.stats.num_resyncs, worker_id)
        if batch.events and isinstance(batch.events[0], AllBlocksCleared):
            return batch  # cleared first already: one clear is the whole resync
        return replace(batch, events=(AllBlocksCleared(), *batch.events))

    async def stop(self) -> None:
        """Cancel the readers, close the sockets and the ZMQ context (`endpoints` is kept: `start` again
        resubscribes).

        Raises:
            asyncio.CancelledError: when the task calling `stop` is cancelled meanwhile (the sockets and the
                context are closed first).
        """
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        cancelled = False
        try:
            # return_exceptions: the readers' own cancellation (and errors) are results, not raised here;
            # a CancelledError that escapes is the caller's own cancellation
            await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            cancelled = True
        self.stats.num_closed += len(self._socks)
        for sock in self._socks.values():
            sock.close(linger=0)
        self._tasks.clear()
        self._socks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if cancelled:
            raise asyncio.CancelledError
