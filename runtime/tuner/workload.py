"""Request-length samples for the tuner: ISL/OSL pairs from a trace or a distribution (pure).

The tuner sizes prefill with the M/G/1 moments of the prefill times of these prompts and decode with their
context lengths; a ``WorkloadSpec`` (means only) is the one-point sample. Loading a trace file is an adapter
(``runtime.tracking.traces``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.config import WorkloadSpec

DEFAULT_MAX_POINTS = 256


@dataclass(frozen=True)
class LengthSample:
    """Parallel tuples of input and output lengths (tokens), each >= 1, same length >= 1."""

    isl_tokens: tuple[int, ...]
    osl_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.isl_tokens or len(self.isl_tokens) != len(self.osl_tokens):
            raise ValueError("need the same number (>= 1) of ISL and OSL values")
        if min(self.isl_tokens) < 1 or min(self.osl_tokens) < 1:
            raise ValueError("ISL and OSL values must be >= 1 token")

    @classmethod
    def from_pairs(cls, pairs, max_points: int = DEFAULT_MAX_POINTS) -> "LengthSample":
        """From an iterable of (isl, osl); keeps at most ``max_points`` by an even stride over the sorted-by-
        position input (deterministic). Pairs with a length < 1 are dropped.

        Raises:
            ValueError: no valid pair.
        """
        pts = [(int(i), int(o)) for i, o in pairs if int(i) >= 1 and int(o) >= 1]
        if not pts:
            raise ValueError("no (isl >= 1, osl >= 1) pair in the workload sample")
        if len(pts) > max_points:
            step = len(pts) / max_points
            pts = [pts[int(k * step)] for k in range(max_points)]
        return cls(tuple(p[0] for p in pts), tuple(p[1] for p in pts))

    @classmethod
    def from_spec(cls, w: WorkloadSpec) -> "LengthSample":
        return cls((w.isl_tokens,), (w.osl_tokens,))

    @property
    def mean_isl(self) -> float:
        return sum(self.isl_tokens) / len(self.isl_tokens)

    @property
    def mean_osl(self) -> float:
        return sum(self.osl_tokens) / len(self.osl_tokens)

    def context_quantile(self, q: float) -> int:
        """q-quantile (nearest rank) of ``isl + osl``, tokens."""
        return quantile([i + o for i, o in zip(self.isl_tokens, self.osl_tokens)], q)


def quantile(values, q: float):
    """Nearest-rank q-quantile of a non-empty sequence."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]
