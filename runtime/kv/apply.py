"""Apply decoded vLLM KV events to a :class:`~runtime.kv.index.PrefixIndex` (pure).

The router re-hashes the ``token_ids`` carried by every ``BlockStored`` with its own chained hash
(runtime/kv/hashing.py) and keeps, per worker, a map ``engine block hash -> router block hash`` so that
``BlockRemoved`` (which carries engine hashes only) and the ``parent_block_hash`` of later events can be
translated. The engine's hash seed or algorithm therefore never has to match the router's.

The map counts stores per engine hash: vLLM's block pool can hold two physical blocks with one hash (two
requests computed the same prefix at once) and then reports ``BlockStored`` twice and, on eviction,
``BlockRemoved`` twice. The translation of an engine hash lives until its last copy is removed (the index
counts the copies too), so the index never keeps a block the worker lacks nor drops one it still holds.

When a ``BlockStored`` carries no token ids (the simulator replaying Mooncake ``hash_ids``), the engine
hashes are used as router hashes unchanged; the caller then routes with the same ids.

A ``BlockStored`` whose parent the router has never seen (events missed before subscribing, or a ZMQ
drop) cannot be chained; its blocks are skipped and counted in ``ApplyStats.num_orphan_blocks`` until
the worker's cache is rebuilt — under-reporting overlap, never reporting a block the worker lacks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from runtime.kv.hashing import block_hashes
from runtime.kv.index import PrefixIndex


class KvEventError(ValueError):
    """An event contradicts the router's configuration (e.g. another block size); names the field."""


@dataclass(slots=True)
class ApplyStats:
    """Counters of one :meth:`KvEventApplier.apply` call."""

    num_stored_blocks: int = 0
    num_removed_blocks: int = 0
    num_orphan_blocks: int = 0
    num_cleared: int = 0


class KvEventApplier:
    """Translates engine block hashes to router hashes and updates the index.

    Args:
        index: the router's prefix index (workers must be added to it before their events arrive).
        block_size_tokens: the workers' ``--block-size``; a ``BlockStored`` with another ``block_size``
            raises :class:`KvEventError` (its token boundaries would never match a prompt's).
    """

    def __init__(self, index: PrefixIndex, block_size_tokens: int) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
        self.index = index
        self.block_size_tokens = block_size_tokens
        # per worker: engine hash -> [router hash, copies the worker holds]
        self._engine_to_router: dict[str, dict[Hashable, list]] = {}

    def forget_worker(self, worker_id: str) -> None:
        """Drop the hash translation table of a removed worker."""
        self._engine_to_router.pop(worker_id, None)

    def apply(self, worker_id: str, events: Iterable[KvEvent]) -> ApplyStats:
        """Apply ``events`` of ``worker_id`` in order.

        Raises:
            runtime.kv.index.UnknownWorkerError: when ``worker_id`` is not in the index.
            KvEventError: on a block-size mismatch or a token count that is not
                ``len(block_hashes) * block_size``.
        """
        self.index.num_blocks(worker_id)  # raises UnknownWorkerError early
        table = self._engine_to_router.setdefault(worker_id, {})
        stats = ApplyStats()
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(worker_id, table, ev, stats)
            elif isinstance(ev, BlockRemoved):
                router_hashes = []
                for h in ev.block_hashes:
                    entry = table.get(h)
                    if entry is None:  # never seen (orphan, or stored before we subscribed)
                        router_hashes.append(h)
                    else:  # the index counts copies too; the translation lives as long as one copy does
                        router_hashes.append(entry[0])
                        entry[1] -= 1
                        if entry[1] <= 0:
                            del table[h]
                self.index.remove(worker_id, router_hashes)
                stats.num_removed_blocks += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                table.clear()
                self.index.clear(worker_id)
                stats.num_cleared += 1
        return stats

    @staticmethod
    def _remember(table: dict[Hashable, list], engine_hash: Hashable, router_hash: Hashable) -> None:
        entry = table.get(engine_hash)
        if entry is None or entry[0] != router_hash:
            table[engine_hash] = [router_hash, 1]
        else:
            entry[1] += 1

    def _stored(self, worker_id: str, table: dict[Hashable, list], ev: BlockStored,
                stats: ApplyStats) -> None:
        n = len(ev.block_hashes)
        if ev.token_ids is None:
            self.index.store(worker_id, ev.block_hashes)
            for h in ev.block_hashes:
                self._remember(table, h, h)
            stats.num_stored_blocks += n
            return
        if ev.block_size != self.block_size_tokens:
            raise KvEventError(
                f"BlockStored.block_size={ev.block_size} from worker {worker_id!r} != router "
                f"block_size_tokens={self.block_size_tokens}; set the same --block-size on every worker"
            )
        if len(ev.token_ids) != n * ev.block_size:
            raise KvEventError(
                f"BlockStored.token_ids has {len(ev.token_ids)} tokens from worker {worker_id!r}, "
                f"expected len(block_hashes)*block_size = {n}*{ev.block_size}"
            )
        if ev.parent_block_hash is None:
            parent: Hashable | None = None
        else:
            entry = table.get(ev.parent_block_hash)
            if entry is None:
                stats.num_orphan_blocks += n
                return
            parent = entry[0]
        ours = block_hashes(ev.token_ids, self.block_size_tokens, parent,  # type: ignore[arg-type]
                            extra_keys=ev.extra_keys)
        for eh, rh in zip(ev.block_hashes, ours):
            self._remember(table, eh, rh)
        self.index.store(worker_id, ours)
        stats.num_stored_blocks += n
