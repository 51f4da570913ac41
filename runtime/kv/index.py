"""Prefix index: which worker holds which KV blocks, and the longest cached prefix per worker (pure).

Layout (chosen for the router's hot path in CPython):

* ``block hash -> worker bitmask`` (one ``int``; bit ``b`` set when the worker with bit ``b`` holds it).
  Because block hashes are *chained* (runtime/kv/hashing.py), a hash identifies a whole prefix, so a flat
  dict replaces the radix tree of Dynamo/SGLang: the longest-prefix match of a ``k``-block prompt is
  ``k`` dict look-ups and ``k`` big-int ANDs, independent of the number of workers and of cache size
  (O(prompt blocks), the issue's requirement), and a worker's overlap is the position where its bit
  drops out of the running AND.
* ``worker -> {hash: refcount}`` so that a worker can be removed or cleared in O(its blocks), and so that
  two engine blocks mapping to the same router hash do not lose the entry when one is evicted.
* Approximate entries (workers that publish no KV events) additionally live in a per-worker
  ``OrderedDict hash -> expiry_s`` (insertion = expiry order for a constant TTL), purged lazily by
  ``expire(now_s)`` and bounded by an optional per-worker capacity in blocks (oldest first).

Invariants (tested by hypothesis in tests/unit/test_kv_index.py): ``match`` never reports a block that
was removed from, cleared on, expired on, or evicted from a worker, and never reports a removed worker.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence


class UnknownWorkerError(KeyError):
    """Raised when an operation names a worker the index does not hold."""


class PrefixIndex:
    """Worker → cached blocks, with O(prompt blocks) longest-prefix matching.

    Block hashes are any hashable values (router-computed ints, Mooncake ``hash_ids``, ...); the caller
    must use one hash space for ``store`` and ``match``.
    """

    __slots__ = ("_masks", "_bit_of", "_worker_of_bit", "_free_bits", "_blocks", "_ttl", "_ttl_cap")

    def __init__(self) -> None:
        self._masks: dict[Hashable, int] = {}
        self._bit_of: dict[str, int] = {}
        self._worker_of_bit: list[str | None] = []
        self._free_bits: list[int] = []
        self._blocks: dict[str, dict[Hashable, int]] = {}
        self._ttl: dict[str, OrderedDict[Hashable, float]] = {}
        self._ttl_cap: dict[str, int | None] = {}

    # ----------------------------------------------------------------- workers
    def add_worker(self, worker_id: str, *, approx_capacity_blocks: int | None = None) -> None:
        """Register ``worker_id`` (idempotent). ``approx_capacity_blocks`` bounds its approximate entries."""
        if worker_id in self._bit_of:
            self._ttl_cap[worker_id] = approx_capacity_blocks
            return
        bit = self._free_bits.pop() if self._free_bits else len(self._worker_of_bit)
        if bit == len(self._worker_of_bit):
            self._worker_of_bit.append(worker_id)
        else:
            self._worker_of_bit[bit] = worker_id
        self._bit_of[worker_id] = bit
        self._blocks[worker_id] = {}
        self._ttl[worker_id] = OrderedDict()
        self._ttl_cap[worker_id] = approx_capacity_blocks

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` and every block it held (a dead worker leaves the index). Idempotent."""
        if worker_id not in self._bit_of:
            return
        self.clear(worker_id)
        bit = self._bit_of.pop(worker_id)
        self._worker_of_bit[bit] = None
        self._free_bits.append(bit)
        del self._blocks[worker_id], self._ttl[worker_id], self._ttl_cap[worker_id]

    @property
    def workers(self) -> tuple[str, ...]:
        """Registered worker ids."""
        return tuple(self._bit_of)

    def num_blocks(self, worker_id: str) -> int:
        """Distinct blocks the index believes ``worker_id`` holds."""
        return len(self._worker_blocks(worker_id))

    def holds(self, worker_id: str, block_hash: Hashable) -> bool:
        """Whether the index believes ``worker_id`` holds ``block_hash``."""
        return block_hash in self._worker_blocks(worker_id)

    def _worker_blocks(self, worker_id: str) -> dict[Hashable, int]:
        try:
            return self._blocks[worker_id]
        except KeyError:
            raise UnknownWorkerError(f"worker {worker_id!r} is not in the prefix index") from None

    # ----------------------------------------------------------------- updates
    def store(self, worker_id: str, hashes: Iterable[Hashable]) -> None:
        """Record that ``worker_id`` holds ``hashes`` (precise, from a KV event)."""
        blocks = self._worker_blocks(worker_id)
        bit = 1 << self._bit_of[worker_id]
        masks = self._masks
        for h in hashes:
            n = blocks.get(h)
            if n is None:
                blocks[h] = 1
                masks[h] = masks.get(h, 0) | bit
            else:
                blocks[h] = n + 1

    def remove(self, worker_id: str, hashes: Iterable[Hashable]) -> None:
        """Record that ``worker_id`` evicted ``hashes`` (unknown hashes are ignored)."""
        blocks = self._worker_blocks(worker_id)
        ttl = self._ttl[worker_id]
        for h in hashes:
            n = blocks.get(h)
            if n is None:
                continue
            if n > 1 and h not in ttl:
                blocks[h] = n - 1
                continue
            self._drop(worker_id, blocks, h)
            ttl.pop(h, None)

    def clear(self, worker_id: str) -> None:
        """Forget every block of ``worker_id`` (vLLM ``AllBlocksCleared``)."""
        blocks = self._worker_blocks(worker_id)
        for h in list(blocks):
            self._drop(worker_id, blocks, h)
        self._ttl[worker_id].clear()

    def _drop(self, worker_id: str, blocks: dict[Hashable, int], h: Hashable) -> None:
        del blocks[h]
        m = self._masks[h] & ~(1 << self._bit_of[worker_id])
        if m:
            self._masks[h] = m
        else:
            del self._masks[h]

    def learn(self, worker_id: str, hashes: Sequence[Hashable], expires_at_s: float) -> list[Hashable]:
        """Approximate mode: assume ``worker_id`` holds ``hashes`` until ``expires_at_s``.

        Called with the router's own decisions for workers that publish no KV events (Dynamo's
        ``ApproxKvIndexer`` idea). Re-learning a hash refreshes its expiry. When the worker has an
        ``approx_capacity_blocks``, the oldest learned entries beyond it are dropped (the engine's LRU
        would have evicted them first).

        Returns:
            the hashes that were new to the worker's entry (for :meth:`unlearn`).
        """
        blocks = self._worker_blocks(worker_id)
        ttl = self._ttl[worker_id]
        bit = 1 << self._bit_of[worker_id]
        masks = self._masks
        new: list[Hashable] = []
        for h in hashes:
            if h in ttl:
                ttl.move_to_end(h)
            elif h not in blocks:
                blocks[h] = 1
                masks[h] = masks.get(h, 0) | bit
                new.append(h)
            ttl[h] = expires_at_s
        cap = self._ttl_cap[worker_id]
        if cap is not None:
            while len(ttl) > cap:
                h, _ = ttl.popitem(last=False)
                self._drop(worker_id, blocks, h)
        return new

    def unlearn(self, worker_id: str, hashes: Iterable[Hashable], expires_at_s: float) -> int:
        """Undo :meth:`learn` of ``hashes`` (what it returned): drop each approximate entry that still has
        expiry ``expires_at_s`` (not re-learned since, not stored precisely). Returns how many were dropped.
        An unknown worker is ignored."""
        blocks = self._blocks.get(worker_id)
        if blocks is None:
            return 0
        ttl = self._ttl[worker_id]
        dropped = 0
        for h in hashes:
            if ttl.get(h) == expires_at_s and blocks.get(h) == 1:
                del ttl[h]
                self._drop(worker_id, blocks, h)
                dropped += 1
        return dropped

    def expire(self, now_s: float) -> int:
        """Drop approximate entries whose expiry is ``<= now_s``; returns how many were dropped."""
        dropped = 0
        for worker_id, ttl in self._ttl.items():
            if not ttl:
                continue
            blocks = self._blocks[worker_id]
            while ttl:
                h, exp = next(iter(ttl.items()))
                if exp > now_s:
                    break
                del ttl[h]
                self._drop(worker_id, blocks, h)
                dropped += 1
        return dropped

    # ----------------------------------------------------------------- queries
    def match(self, hashes: Sequence[Hashable]) -> dict[str, int]:
        """Longest cached prefix of ``hashes`` on each worker.

        Args:
            hashes: chained block hashes of one prompt, in order (length ``k``).

        Returns:
            ``{worker_id: overlap_blocks}`` for workers whose overlap is ≥ 1 block; overlap is the
            largest ``j`` such that the worker holds ``hashes[0..j-1]`` (all of them).

        Cost: at most ``k`` dict look-ups and int ANDs plus one step per worker that drops out.
        """
        masks = self._masks
        out: dict[str, int] = {}
        if not hashes:
            return out
        active = masks.get(hashes[0], 0)
        if not active:
            return out
        depth = 1
        it = iter(hashes)
        next(it)
        for h in it:
            new = active & masks.get(h, 0)
            if new != active:
                self._record(active & ~new, depth, out)
                active = new
                if not active:
                    return out
            depth += 1
        self._record(active, depth, out)
        return out

    def _record(self, bits: int, depth: int, out: dict[str, int]) -> None:
        names = self._worker_of_bit
        while bits:
            low = bits & -bits
            out[names[low.bit_length() - 1]] = depth  # type: ignore[index]
            bits ^= low
