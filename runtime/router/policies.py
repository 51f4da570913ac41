"""Routing policies, chosen by name from ``RouterSpec.policy`` through :data:`POLICIES` (pure).

Every policy picks one worker id from a non-empty candidate list; it never invents an id, so routing
can only target the configured/discovered pool. Inputs per call:

* ``candidates``: the :class:`~runtime.router.load.WorkerLoad` of each eligible worker,
* ``overlaps``: ``{worker_id: cached prefix blocks}`` (missing = 0) — for ``kv_aware`` the maximum of
  the KV-event index and the router's own in-flight requests; for ``dynamo_cost`` the index only,
  as in Dynamo,
* ``num_blocks`` / ``num_tokens`` of the prompt and the block size.

Costs (lower is better; ties broken uniformly at random with the policy's seeded RNG):

* ``kv_aware`` — predicted prefill queue if sent there, in the router's work unit (seconds from the
  performance model when the router has one, else uncached tokens):
  ``prefill_work_w + cost(num_tokens, overlap_w * block) + decode_weight * decode_blocks_w * block * u
  + balance_weight * max(0, total_prefill_work_w - mean_total_prefill_work)`` with ``u`` = work of one
  uncached token of this prompt. The first two terms are the worker's FCFS prefill work ahead of and
  including this request (its TTFT). The decode term defaults to 0 when choosing where to prefill: one
  active decode sequence of a 70B model with a 16k-token context reads ~0.65 GB of KV per H100 per
  step (≈0.2 ms at 3.35 TB/s) beside a ~100 ms 2k-token prefill chunk, i.e. ~0.2 % per sequence; the
  router picks *decode* workers of a disaggregated pool with weight ≥ 1 instead (runtime/router/core.py).
  In an aggregated pool (workers prefill and decode) the router uses weight ≥ 0.05 on the decode blocks a
  worker holds *beyond the pool mean plus the mean of the other candidates* (``decode_excess``), so a cached prefix
  cannot pull every request onto one worker while the others idle.
  The balance term (default 0.02) evens out long-run busy time when hot prefixes pile onto one worker.
  Exact ties go to the worker with the least cumulative work, then at random. With
  ``temperature > 0`` a softmax over min-max-normalised costs samples the worker. With KV offload tiers
  (runtime/kv/tiers.py) the router passes ``overlaps`` that include the blocks a worker would load from
  its CPU/storage tiers and ``load_work`` = the modelled time to load them (same work unit), added to
  that worker's cost: a tier hit is charged its load, not counted as free nor as a full prefill.
* ``dynamo_cost`` — NVIDIA Dynamo's published KV-router cost (docs "KV Cache Routing",
  lib/llm/src/kv_router/scheduler.rs): ``overlap_weight * prefill_blocks + decode_blocks`` with
  ``prefill_blocks = prefill_tokens_w / block + (num_blocks - overlap_w)`` and
  ``decode_blocks = decode_blocks_w + num_blocks``; softmax with the same temperature rule.
* ``least_loaded`` — fewest in-flight tokens (prefill + decode), cache-blind.
* ``round_robin`` — cycles through the candidates in pool order, cache- and load-blind.
* ``random`` — uniform, seeded.
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from runtime.router.load import WorkerLoad


class UnknownPolicyError(ValueError):
    """``RouterSpec.policy`` names no registered policy; the message lists the known names."""


class Policy(Protocol):
    """What the router needs from a policy."""

    #: whether overlaps should include the router's own in-flight requests (not only KV events)
    uses_inflight_overlap: bool

    def choose(self, candidates: Sequence[WorkerLoad], overlaps: Mapping[str, int], num_blocks: int,
               num_tokens: int, block_size_tokens: int) -> str:
        """Return the id of one of ``candidates`` (non-empty)."""
        ...


def _argmin_or_softmax(ids: list[str], costs: list[float], temperature: float, rng: _random.Random) -> str:
    lo = min(costs)
    if temperature <= 0:
        best = [i for i, c in zip(ids, costs) if c == lo]
        return best[0] if len(best) == 1 else rng.choice(best)
    hi = max(costs)
    span = (hi - lo) or 1.0
    weights = [math.exp(-((c - lo) / span) / temperature) for c in costs]
    return rng.choices(ids, weights=weights, k=1)[0]


def uncached_tokens(num_tokens: int, cached_tokens: int) -> float:
    """Default prefill work: the uncached prompt tokens."""
    return float(max(0, num_tokens - cached_tokens))


PrefillCost = Callable[[int, int], float]


class KvAwarePolicy:
    """pdserve's cost: predicted FCFS prefill queue after adding this request (see module docstring).

    Args:
        prefill_cost: ``(num_tokens, cached_tokens) -> work`` of one prefill; default uncached tokens.
        decode_excess: count only decode blocks beyond the pool mean plus the other candidates' mean (aggregated pools: the
            decode term then stops one worker from taking far more than its share of decoding, and leaves
            choices among evenly loaded workers to the prefill cost).
    """

    uses_inflight_overlap = True
    #: accepts ``load_work`` (offload-tier hits charged their load time)
    credits_tiers = True

    def __init__(self, *, temperature: float = 0.0, decode_weight: float = 0.0, balance_weight: float = 0.0,
                 prefill_cost: PrefillCost | None = None, seed: int = 0, decode_excess: bool = False) -> None:
        self.temperature = temperature
        self.decode_weight = decode_weight
        self.decode_excess = decode_excess
        self.balance_weight = balance_weight
        self.prefill_cost = prefill_cost or uncached_tokens
        self.rng = _random.Random(seed)

    def choose(self, candidates: Sequence[WorkerLoad], overlaps: Mapping[str, int], num_blocks: int,
               num_tokens: int, block_size_tokens: int, load_work: Mapping[str, float] | None = None) -> str:
        """``load_work``: ``{worker_id: work}`` of loading the offload-tier part of its overlap (missing = 0)."""
        # hot path (runs per request over every candidate): one pass, argmin tracked inline; the
        # prefill cost is evaluated once per distinct overlap, not per worker
        bs = block_size_tokens
        cost = self.prefill_cost
        base = cost(num_tokens, 0)
        own: dict[int, float] = {0: base}
        for n in set(overlaps.values()):
            own[n] = cost(num_tokens, min(n * bs, num_tokens))
        dw = self.decode_weight * bs * base / max(1, num_tokens)
        bw = self.balance_weight
        mean_total = (sum(w.total_prefill_work for w in candidates) / len(candidates)) if bw else 0.0
        get = overlaps.get
        costs: list[float] = []
        # decode_excess: only a worker's decode load beyond the pool mean plus the mean of the *other*
        # candidates counts (a pile-up guard; twice the pool mean, which one of two workers can never exceed,
        # when the worker holds the mean)
        excess = self.decode_excess and dw and len(candidates) > 1
        total_d = sum(w.decode_blocks for w in candidates) if excess else 0
        n, others = len(candidates), len(candidates) - 1
        for w in candidates:
            d = w.decode_blocks
            floor = total_d / n + (total_d - d) / others if excess else 0.0
            c = w.prefill_work + own[get(w.worker_id, 0)] + (dw * (d - floor) if d > floor else 0.0)
            if load_work:
                c += load_work.get(w.worker_id, 0.0)
            t = w.total_prefill_work
            if bw and t > mean_total:
                c += bw * (t - mean_total)
            costs.append(c)
        if self.temperature > 0:
            return _argmin_or_softmax([w.worker_id for w in candidates], costs, self.temperature, self.rng)
        lo = min(costs)
        best = [w for w, c in zip(candidates, costs) if c == lo]
        if len(best) == 1:
            return best[0].worker_id
        # ties (typically: no cache anywhere, idle queues) go to the worker that has prefilled least
        # so far, evening out long-run busy time; remaining ties at random
        least = min(w.total_prefill_work for w in best)
        best = [w for w in best if w.total_prefill_work == least]
        return best[0].worker_id if len(best) == 1 else self.rng.choice(best).worker_id


class DynamoCostPolicy:
    """Dynamo's KV-router cost ``overlap_weight * prefill_blocks + decode_blocks`` (index overlap only)."""

    uses_inflight_overlap = False

    def __init__(self, *, overlap_weight: float = 1.0, temperature: float = 0.0, seed: int = 0) -> None:
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.rng = _random.Random(seed)

    def choose(self, candidates: Sequence[WorkerLoad], overlaps: Mapping[str, int], num_blocks: int,
               num_tokens: int, block_size_tokens: int) -> str:
        ids: list[str] = []
        costs: list[float] = []
        get = overlaps.get
        for w in candidates:
            prefill_blocks = w.prefill_tokens / block_size_tokens + (num_blocks - get(w.worker_id, 0))
            ids.append(w.worker_id)
            costs.append(self.overlap_weight * prefill_blocks + w.decode_blocks + num_blocks)
        return _argmin_or_softmax(ids, costs, self.temperature, self.rng)


class LeastLoadedPolicy:
    """Fewest in-flight tokens (prefill tokens + decode blocks × block size); cache-blind."""

    uses_inflight_overlap = False

    def __init__(self, *, seed: int = 0) -> None:
        self.rng = _random.Random(seed)

    def choose(self, candidates: Sequence[WorkerLoad], overlaps: Mapping[str, int], num_blocks: int,
               num_tokens: int, block_size_tokens: int) -> str:
        ids = [w.worker_id for w in candidates]
        costs = [float(w.prefill_tokens + w.decode_blocks * block_size_tokens) for w in candidates]
        return _argmin_or_softmax(ids, costs, 0.0, self.rng)


class RoundRobinPolicy:
    """Cycles through the candidates in pool order."""

    uses_inflight_overlap = False

    def __init__(self, *, seed: int = 0) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[WorkerLoad], overlaps: Mapping[str, int], num_blocks: int,
               num_tokens: int, block_size_tokens: int) -> str:
        w = candidates[self._next % len(candidates)]
        self._next += 1
        return w.worker_id


class RandomPolicy:
    """Uniformly random candidate (seeded)."""

    uses_inflight_overlap = False

    def __init__(self, *, seed: int = 0) -> None:
        self.rng = _random.Random(seed)

    def choose(self, candidates: Sequence[WorkerLoad], overlaps: Mapping[str, int], num_blocks: int,
               num_tokens: int, block_size_tokens: int) -> str:
        return self.rng.choice(candidates).worker_id


POLICIES: dict[str, type] = {
    "kv_aware": KvAwarePolicy,
    "dynamo_cost": DynamoCostPolicy,
    "least_loaded": LeastLoadedPolicy,
    "round_robin": RoundRobinPolicy,
    "random": RandomPolicy,
}


def make_policy(name: str, *, temperature: float = 0.0, overlap_weight: float = 1.0,
                decode_weight: float = 0.0, balance_weight: float = 0.0,
                prefill_cost: PrefillCost | None = None, seed: int = 0, decode_excess: bool = False) -> Policy:
    """Instantiate the policy registered as ``name``.

    Raises:
        UnknownPolicyError: when ``name`` is not in :data:`POLICIES` (the message lists them).
    """
    if name == "kv_aware":
        return KvAwarePolicy(temperature=temperature, decode_weight=decode_weight,
                             balance_weight=balance_weight, prefill_cost=prefill_cost, seed=seed,
                             decode_excess=decode_excess)
    if name == "dynamo_cost":
        return DynamoCostPolicy(overlap_weight=overlap_weight, temperature=temperature, seed=seed)
    cls = POLICIES.get(name)
    if cls is None:
        raise UnknownPolicyError(f"router.policy={name!r} is not one of {sorted(POLICIES)}")
    return cls(seed=seed)
