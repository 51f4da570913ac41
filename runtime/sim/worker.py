"""Simulated worker KV cache: capacity in blocks, prefix hits, LRU eviction, vLLM-style events (pure).

Models vLLM's v1 prefix cache (``vllm/v1/core/block_pool.py``): a request hits the longest run of its
leading blocks that are cached; its blocks are pinned (reference-counted) while it runs; freed blocks
stay cached and are evicted least-recently-used first when a new request needs room; every newly
cached block is announced with ``BlockStored`` and every eviction with ``BlockRemoved`` — the same
event values the router receives from real workers (runtime/kv/events.py), here with ``token_ids=None``
because trace blocks are already hashes.

When pinned blocks alone exceed the capacity the cache over-commits (counted in ``num_overflow_blocks``)
instead of preempting; with the bench's capacity (thousands of blocks) this does not happen.

Offload tier (``offload_capacity_blocks > 0``): models vLLM's ``OffloadingConnector`` CPU tier
(vllm/v1/kv_offload/cpu, LRU policy): every block newly computed on the GPU is also stored in the tier
(write-through, ``BlockStored`` with ``medium=offload_medium``); the tier evicts least-recently-used blocks
(``BlockRemoved`` with that medium); a request whose GPU prefix is followed by blocks the tier holds loads
them (they become GPU blocks again and are touched in the tier). :meth:`acquire_tiered` reports the loaded
run apart from the GPU hit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from runtime.kv.events import BlockRemoved, BlockStored, KvEvent


class SimKvCache:
    """One worker's prefix cache.

    Args:
        capacity_blocks: KV blocks the worker holds (> 0).
        block_size_tokens: tokens per block, copied into ``BlockStored.block_size``.
    """

    def __init__(self, capacity_blocks: int, block_size_tokens: int, *, offload_capacity_blocks: int = 0,
                 offload_medium: str = "CPU") -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        if offload_capacity_blocks < 0:
            raise ValueError(f"offload_capacity_blocks must be >= 0, got {offload_capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size_tokens = block_size_tokens
        self.offload_capacity_blocks = offload_capacity_blocks
        self.offload_medium = offload_medium
        self._offload: OrderedDict[Hashable, None] = OrderedDict()  # offload tier, least recently used first
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # unpinned cached blocks, oldest first
        self._pinned: dict[Hashable, int] = {}  # cached blocks in use -> refcount
        self.num_overflow_blocks = 0

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def __contains__(self, h: Hashable) -> bool:
        return h in self._pinned or h in self._lru

    def blocks(self) -> set[Hashable]:
        """All cached block hashes (pinned or not)."""
        return set(self._lru) | set(self._pinned)

    def prefix_hits(self, hashes: Sequence[Hashable]) -> int:
        """Number of leading blocks of ``hashes`` that are cached (no side effects)."""
        n = 0
        for h in hashes:
            if h not in self._pinned and h not in self._lru:
                break
            n += 1
        return n

    def offload_holds(self, h: Hashable) -> bool:
        """Whether the offload tier holds block ``h``."""
        return h in self._offload

    def acquire(self, hashes: Sequence[Hashable]) -> tuple[int, list[KvEvent]]:
        """Start a request: pin its blocks, caching the missing ones (evicting LRU blocks).

        Returns:
            ``(hit_blocks, events)``: the leading blocks that were already cached (on the GPU or loaded
            from the offload tier), and the ``BlockRemoved`` / ``BlockStored`` events this caused, in order.
        """
        hit, loaded, events = self.acquire_tiered(hashes)
        return hit + loaded, events

    def acquire_tiered(self, hashes: Sequence[Hashable]) -> tuple[int, int, list[KvEvent]]:
        """:meth:`acquire`, with the offload tier's part apart.

        Returns:
            ``(gpu_hit_blocks, loaded_blocks, events)``: the leading blocks cached on the GPU, the blocks
            right after them loaded from the offload tier, and the events (GPU, then offload tier).
        """
        hit = self.prefix_hits(hashes)
        loaded = 0
        off = self._offload
        while hit + loaded < len(hashes) and hashes[hit + loaded] in off:
            off.move_to_end(hashes[hit + loaded])
            loaded += 1
        events: list[KvEvent] = []
        for h in hashes:
            if h in self._pinned:
                self._pinned[h] += 1
            elif h in self._lru:
                del self._lru[h]
                self._pinned[h] = 1
        new = [h for h in hashes[hit:] if h not in self._pinned]
        # duplicates inside the new part (not possible for chained hashes, but stay safe)
        new = list(dict.fromkeys(new))
        room = self.capacity_blocks - len(self)
        need = len(new) - room
        if need > 0:
            evicted: list[Hashable] = []
            while need > 0 and self._lru:
                h, _ = self._lru.popitem(last=False)
                evicted.append(h)
                need -= 1
            if evicted:
                events.append(BlockRemoved(tuple(evicted)))
            self.num_overflow_blocks += max(0, need)
        if new:
            for h in new:
                self._pinned[h] = 1
            parent = hashes[hit - 1] if hit > 0 else None
            events.append(BlockStored(tuple(new), parent, None, self.block_size_tokens))
            if self.offload_capacity_blocks:
                events += self._offload_store(new, parent)
        return hit, loaded, events

    def _offload_store(self, blocks: list[Hashable], parent: Hashable | None) -> list[KvEvent]:
        off = self._offload
        fresh = [h for h in blocks if h not in off][: self.offload_capacity_blocks]
        out: list[KvEvent] = []
        need = len(off) + len(fresh) - self.offload_capacity_blocks
        if need > 0:
            evicted = [off.popitem(last=False)[0] for _ in range(need)]
            out.append(BlockRemoved(tuple(evicted), self.offload_medium))
        for h in fresh:
            off[h] = None
        if fresh:
            out.append(BlockStored(tuple(fresh), parent, None, self.block_size_tokens, medium=self.offload_medium))
        return out

    def release(self, hashes: Sequence[Hashable]) -> None:
        """End a request: unpin its blocks; they stay cached as most recently used.

        Blocks are freed tail first (as vLLM's ``KVCacheManager.free`` does), so a prompt's last blocks
        are evicted before its first ones and cached prefixes stay prefixes.
        """
        for h in reversed(hashes):
            n = self._pinned.get(h)
            if n is None:
                continue
            if n > 1:
                self._pinned[h] = n - 1
            else:
                del self._pinned[h]
                self._lru[h] = None

    def clear(self) -> None:
        """Drop every unpinned block and the offload tier (vLLM ``reset_prefix_cache``)."""
        self._lru.clear()
        self._offload.clear()
