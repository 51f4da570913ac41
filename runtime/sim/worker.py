"""Simulated worker KV cache: capacity in blocks, prefix hits, LRU eviction, vLLM-style events (pure).

Models vLLM's v1 prefix cache (``vllm/v1/core/block_pool.py``): a request hits the longest run of its
leading blocks that are cached; its blocks are pinned (reference-counted) while it runs; freed blocks
stay cached and are evicted least-recently-used first when a new request needs room; every newly
cached block is announced with ``BlockStored`` and every eviction with ``BlockRemoved`` — the same
event values the router receives from real workers (runtime/kv/events.py), here with ``token_ids=None``
because trace blocks are already hashes.

When pinned blocks alone exceed the capacity the cache over-commits (counted in ``num_overflow_blocks``)
instead of preempting; with the bench's capacity (thousands of blocks) this does not happen.
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

    def __init__(self, capacity_blocks: int, block_size_tokens: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.block_size_tokens = block_size_tokens
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

    def acquire(self, hashes: Sequence[Hashable]) -> tuple[int, list[KvEvent]]:
        """Start a request: pin its blocks, caching the missing ones (evicting LRU blocks).

        Returns:
            ``(hit_blocks, events)``: the leading blocks that were already cached, and the
            ``BlockRemoved`` / ``BlockStored`` events this caused, in order.
        """
        hit = self.prefix_hits(hashes)
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
        return hit, events

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
        """Drop every unpinned block (vLLM ``reset_prefix_cache``)."""
        self._lru.clear()
