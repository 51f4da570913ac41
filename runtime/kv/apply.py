"""Apply decoded vLLM KV events to a :class:`~runtime.kv.index.PrefixIndex` (pure).

The router re-hashes the ``token_ids`` carried by every ``BlockStored`` with its own chained hash
(runtime/kv/hashing.py) and keeps, per worker, a map ``engine block hash -> router block hash`` so that
``BlockRemoved`` (which carries engine hashes only) and the ``parent_block_hash`` of later events can be
translated. The engine's hash seed or algorithm therefore never has to match the router's.

The map counts stores per engine hash: vLLM's block pool can hold two physical blocks with one hash (two
requests computed the same prefix at once; vllm/v1/core/block_pool.py ``BlockHashToBlockMap.insert`` keeps
both) and then reports ``BlockStored`` twice (once per block that was not ``already_cached``) and, on
eviction, ``BlockRemoved`` twice. The translation of an engine hash lives until its last copy is removed
(the index counts the copies too), so the index never keeps a block the worker lacks nor drops one it still
holds. This relies on vLLM's default KV event report mode: ``kv_cache_report_mode="full"`` re-sends
``BlockStored`` for every prefix-cache hit with no matching removal, so the runtime drops that per-request
setting from client ``vllm_xargs`` (runtime/server/model.py). A store of other content under an engine
hash already held replaces it (the old router block leaves the index with all its copies).

When a ``BlockStored`` carries no token ids (the simulator replaying Mooncake ``hash_ids``), the engine
hashes are used as router hashes unchanged; the caller then routes with the same ids.

A ``BlockStored`` whose parent the router has never seen (events missed before subscribing, or a ZMQ
drop) cannot be chained; its blocks are skipped and counted in ``ApplyStats.num_orphan_blocks`` until
the worker's cache is rebuilt — under-reporting overlap, never reporting a block the worker lacks.

Events are applied one by one: an event that cannot be applied (another block size, a token count that
does not fit its blocks) is skipped and counted, the rest of the batch still applies, and only then is
:class:`KvEventError` raised. ``BlockStored`` without tokens (``token_ids=()``) is skipped and counted
(see runtime/kv/events.py).

Tiers: each event goes to the index of its ``medium`` — the GPU index, or the offload tier's index given
in ``tiers`` (``"CPU"``, ``"STORAGE"``: runtime/kv/tiers.py); events of a medium without an index are
skipped and counted. Each medium keeps its own translation table (a CPU-tier ``BlockRemoved`` drops the CPU
copy only); a ``parent_block_hash`` unknown to its medium is looked up in the worker's other media (one
engine hash space: the offloading connector reports the GPU block hashes). An offload tier's ``BlockStored``
whose engine hashes the worker's other media already translate takes those router hashes: vLLM 0.28's
offloading events carry no ``extra_keys`` (cache salt, LoRA), and the engine hash already covers them. Only
a block offloaded after its GPU entry left is hashed from its tokens alone. ``AllBlocksCleared`` clears every
medium of the worker: the index may under-report after a reset, never report a block the worker lacks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

from runtime.kv.events import GPU_MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from runtime.kv.hashing import block_hashes
from runtime.kv.index import PrefixIndex


class KvEventError(ValueError):
    """An event contradicts the router's configuration (e.g. another block size); names the field.

    Raised by :meth:`KvEventApplier.apply` after the batch's other events were applied; ``stats`` holds
    that call's counters (None when raised for a single event).
    """

    def __init__(self, message: str, stats: ApplyStats | None = None) -> None:
        super().__init__(message)
        self.stats = stats


@dataclass(slots=True)
class ApplyStats:
    """Counters of one :meth:`KvEventApplier.apply` call.

    ``num_rejected_events``: events that contradict the configuration (not applied; ``apply`` raises
    after the batch). ``num_skipped_events``: events of a medium without an index, or without tokens.
    ``num_repeated_blocks``: stored blocks the worker already held under that hash (counted as another copy).
    """

    num_stored_blocks: int = 0
    num_removed_blocks: int = 0
    num_orphan_blocks: int = 0
    num_cleared: int = 0
    num_rejected_events: int = 0
    num_skipped_events: int = 0
    num_repeated_blocks: int = 0


class KvEventApplier:
    """Translates engine block hashes to router hashes and updates the index.

    Args:
        index: the router's prefix index (workers must be added to it before their events arrive).
        block_size_tokens: the workers' ``--block-size``; a ``BlockStored`` with another ``block_size``
            raises :class:`KvEventError` (its token boundaries would never match a prompt's).
        tiers: ``{medium: index}`` of the offload tiers to index (workers must be added to each); events
            of other media than these and GPU are skipped.
    """

    def __init__(self, index: PrefixIndex, block_size_tokens: int,
                 tiers: Mapping[str, PrefixIndex] | None = None) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be > 0, got {block_size_tokens}")
        self.index = index
        self.block_size_tokens = block_size_tokens
        self._indexes: dict[str, PrefixIndex] = {GPU_MEDIUM: index, **(tiers or {})}
        # per worker, per medium: engine hash -> [router hash, copies the worker holds]
        self._engine_to_router: dict[str, dict[str, dict[Hashable, list]]] = {}

    def forget_worker(self, worker_id: str) -> None:
        """Drop the hash translation table of a removed worker."""
        self._engine_to_router.pop(worker_id, None)

    def apply(self, worker_id: str, events: Iterable[KvEvent]) -> ApplyStats:
        """Apply ``events`` of ``worker_id`` in order, each on its own (a bad one is skipped).

        Raises:
            runtime.kv.index.UnknownWorkerError: when ``worker_id`` is not in the index (nothing applied).
            KvEventError: after every other event was applied, when some ``BlockStored`` had another block
                size, a token count that is not ``len(block_hashes) * block_size`` or tokens/extra keys
                the router cannot hash; the message names the first and counts them, ``.stats`` holds
                the counters.
        """
        self.index.num_blocks(worker_id)  # raises UnknownWorkerError early
        tables = self._engine_to_router.setdefault(worker_id, {})
        stats = ApplyStats()
        first_error: KvEventError | None = None
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                tables.clear()
                for idx in self._indexes.values():
                    idx.clear(worker_id)
                stats.num_cleared += 1
                continue
            if not isinstance(ev, (BlockStored, BlockRemoved)):
                continue
            medium = GPU_MEDIUM if ev.medium is None else ev.medium
            index = self._indexes.get(medium)
            if index is None:
                stats.num_skipped_events += 1  # a tier the router does not index
                continue
            table = tables.setdefault(medium, {})
            if isinstance(ev, BlockStored):
                try:
                    self._stored(worker_id, index, table, tables, ev, stats)
                except KvEventError as exc:
                    stats.num_rejected_events += 1
                    first_error = first_error or exc
                except (TypeError, ValueError) as exc:  # e.g. unhashable token ids of a hand-built event
                    stats.num_rejected_events += 1
                    first_error = first_error or KvEventError(f"BlockStored from worker {worker_id!r} cannot "
                                                              f"be hashed: {exc}")
            else:
                router_hashes = []
                for h in ev.block_hashes:
                    # never seen (orphan, stored before we subscribed): the engine hash is tried as is
                    entry = table.get(h)
                    if entry is None:
                        router_hashes.append(h)
                    else:  # the index counts copies too; the translation lives as long as one copy does
                        router_hashes.append(entry[0])
                        entry[1] -= 1
                        if entry[1] <= 0:
                            del table[h]
                index.remove(worker_id, router_hashes)
                stats.num_removed_blocks += len(ev.block_hashes)
        if first_error is not None:
            raise KvEventError(f"{stats.num_rejected_events} KV event(s) of worker {worker_id!r} not applied "
                               f"(the others were); first: {first_error}", stats)
        return stats

    def _remember(self, worker_id: str, index: PrefixIndex, table: dict[Hashable, list],
                  engine_hashes: Iterable[Hashable], router_hashes: Iterable[Hashable], stats: ApplyStats) -> None:
        """Record blocks stored on ``worker_id``, one more copy each (see the module docstring)."""
        stored = []
        for eh, rh in zip(engine_hashes, router_hashes):
            entry = table.get(eh)
            if entry is not None and entry[0] == rh:
                entry[1] += 1
                stats.num_repeated_blocks += 1
            else:
                if entry is not None:  # other content under this hash: its old block is no longer there
                    index.remove(worker_id, [entry[0]] * entry[1])
                table[eh] = [rh, 1]
            stored.append(rh)
        index.store(worker_id, stored)
        stats.num_stored_blocks += len(stored)

    @staticmethod
    def _translated(tables: dict[str, dict[Hashable, list]], engine_hash: Hashable) -> Hashable | None:
        """The router hash some medium of the worker holds for ``engine_hash`` (None: none does)."""
        for t in tables.values():
            entry = t.get(engine_hash)
            if entry is not None:
                return entry[0]
        return None

    def _stored(self, worker_id: str, index: PrefixIndex, table: dict[Hashable, list],
                tables: dict[str, dict[Hashable, list]], ev: BlockStored, stats: ApplyStats) -> None:
        n = len(ev.block_hashes)
        if ev.token_ids is None:
            self._remember(worker_id, index, table, ev.block_hashes, ev.block_hashes, stats)
            return
        if n and not ev.token_ids:  # a vLLM event without tokens: nothing the router can hash
            stats.num_skipped_events += 1
            return
        if index is not self.index and not ev.extra_keys:
            known = [self._translated(tables, h) for h in ev.block_hashes]
            if None not in known:
                self._remember(worker_id, index, table, ev.block_hashes, known, stats)
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
        parent: Hashable | None = None
        if ev.parent_block_hash is not None:
            entry = table.get(ev.parent_block_hash)
            # the parent may be known in another medium only (one engine hash space)
            parent = entry[0] if entry is not None else self._translated(tables, ev.parent_block_hash)
            if parent is None:
                stats.num_orphan_blocks += n
                return
        ours = block_hashes(ev.token_ids, self.block_size_tokens, parent,
                            extra_keys=ev.extra_keys)
        self._remember(worker_id, index, table, ev.block_hashes, ours, stats)
