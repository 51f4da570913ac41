"""Prefill and decode durations of simulated workers, from the roofline model in runtime/perf (pure).

``PerfTiming`` wraps a :class:`runtime.perf.model.PerfModel` (its contract: ``prefill_time_s(isl_tokens,
tp, batch=1)`` and ``decode_step_time_s(batch, context_tokens, tp)``, optionally ``prefill_busy_s``) for one
TP degree. A worker is occupied for the engine's prefill time; the fixed API-side latency of TTFT
(``prefill_time_s - prefill_busy_s``, a constant of the fit) is added to each request's TTFT only.
"""

from __future__ import annotations

from typing import Protocol


class PerfLike(Protocol):
    """The part of ``runtime.perf.model.PerfModel`` the simulator uses."""

    def prefill_time_s(self, isl_tokens: int, tp: int, batch: int = 1) -> float: ...

    def decode_step_time_s(self, batch: int, context_tokens: int, tp: int) -> float: ...


class PerfTiming:
    """Durations for one worker type (model × GPU × TP).

    Args:
        perf: a PerfModel (or anything with its two timing methods).
        tp: tensor-parallel degree of the simulated workers.
    """

    def __init__(self, perf: PerfLike, tp: int) -> None:
        self.perf = perf
        self.tp = tp
        self._prefill_memo: dict[int, float] = {}
        busy = getattr(perf, "prefill_busy_s", None)
        # engine occupancy (PerfModel.prefill_busy_s) when the model has it, else the whole prefill time
        self._busy = busy if busy is not None else perf.prefill_time_s
        #: the fixed part of TTFT that does not hold the worker (API-side latency), seconds
        self.fixed_latency_s = max(perf.prefill_time_s(1, tp) - self._busy(1, tp), 0.0) if busy is not None else 0.0

    def _p(self, tokens: int) -> float:
        t = self._prefill_memo.get(tokens)
        if t is None:
            t = self._busy(tokens, self.tp)
            self._prefill_memo[tokens] = t
        return t

    def prefill_s(self, isl_tokens: int, cached_tokens: int = 0) -> float:
        """How long the prefill of a prompt whose first ``cached_tokens`` are in the prefix cache occupies
        its worker, seconds (TTFT adds ``fixed_latency_s``).

        ``max(P(isl) - P(cached), P(isl - cached))`` with ``P`` the full-prefill time: the difference is
        the FLOPs of the uncached suffix *including* its attention over the cached prefix (causal
        attention FLOPs grow with ``isl²``), the second term keeps the weight-read floor of a short
        suffix. A full hit still recomputes one token (vLLM recomputes the last prompt token to get
        logits).
        """
        cached = min(max(0, cached_tokens), isl_tokens - 1)
        uncached = isl_tokens - cached
        full = self._p(isl_tokens)
        if cached == 0:
            return full
        return max(full - self._p(cached), self._p(uncached))

    def decode_s(self, output_tokens: int, context_tokens: int, batch: int) -> float:
        """Time to generate ``output_tokens`` tokens at a decode batch of ``batch`` sequences, seconds
        (one step per token; mean context = prompt + half the output)."""
        if output_tokens <= 0:
            return 0.0
        step = self.perf.decode_step_time_s(max(1, batch), max(1, context_tokens + output_tokens // 2), self.tp)
        return output_tokens * step
