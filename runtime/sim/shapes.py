"""Seeded synthetic traffic shapes for the fleet simulator (pure: a seed in, a :class:`Trace` out).

A shape is ``<arrivals>_<mix>``: an arrival process crossed with a prompt/output length mix, so every
process meets every mix (``gamma_rag``, ``flash_chat``, ``diurnal_shift``, ...). Each is generated at
``rate_scale`` times its base rate: a larger scale is more of the same traffic (a bigger fleet), not a
clumped copy of it.

Arrival processes, mean rate ``lam = BASE_RATE_PER_S * rate_scale`` over ``duration_s``:

* ``poisson``: homogeneous Poisson at ``lam`` (index of dispersion 1).
* ``gamma``: renewal process with Gamma inter-arrival times of mean ``1 / lam`` and shape
  ``GAMMA_SHAPE`` = 0.25, i.e. squared coefficient of variation 4: clumps and gaps at every time scale
  (the index of dispersion of counts tends to the SCV, Cox & Lewis 1966, §4.5).
* ``mmpp``: two-state Markov-modulated Poisson process, rate ``MMPP_LOW x`` and ``MMPP_HIGH x`` a base
  with mean sojourns ``MMPP_SOJOURN_S`` (low, high); the base is set so the time average is ``lam``.
  Bursts that last minutes, longer than a planner tick and shorter than a worker's life.
* ``diurnal``: inhomogeneous Poisson with ``lam(t) = lam * (DIURNAL_MIN + 2 (1 - DIURNAL_MIN)
  sin^2(pi t / duration))``: a day compressed into ``duration_s``, from ``DIURNAL_MIN`` of the mean to
  ``2 - DIURNAL_MIN`` of it and back (mean ``lam``).
* ``flash``: Poisson at ``lam`` plus a flash crowd starting at ``FLASH_AT`` of the span: the rate
  rises linearly to ``FLASH_PEAK x lam`` within ``FLASH_RISE_S``, holds for ``FLASH_HOLD_S`` and decays
  exponentially with time constant ``FLASH_DECAY_S``.

Inhomogeneous processes are drawn by thinning (Lewis & Shedler 1979, "Simulation of nonhomogeneous
Poisson processes by thinning", Naval Research Logistics Quarterly 26(3)).

Length mixes (log-normal, given as median and sigma of the log; clipped to ``[1, MAX_TOKENS]``):

* ``chat``: short prompts, long outputs: ISL median 600 (sigma 1.0), OSL median 350 (sigma 0.8).
* ``rag`` (code completion / retrieval-augmented): long prompts, very short outputs: ISL median 8,000
  (sigma 0.7), OSL median 16 (sigma 0.8).
* ``agentic``: long shared prefixes: each request belongs to one of ``AGENT_SESSIONS`` sessions whose
  prefix (system prompt, tools, history) has median 10,000 tokens (sigma 0.5); its prompt is that prefix
  plus a turn of median 500 (sigma 0.8), its output median 200 (sigma 0.8). The fleet simulator charges
  every prompt in full (it does not credit prefix-cache hits), so this mix stands for the worst case of
  long, correlated prompts.
* ``shift``: ``chat`` that turns into ``rag`` within the hour: a request is ``rag`` with probability
  rising linearly from 0 to 1 between ``SHIFT_FROM`` and ``SHIFT_TO`` of the span.

The constants are round numbers of the published ranges (chat and code traces of Azure LLM inference
2023/2024, Mooncake's long-prompt trace), not fitted to any trace; change them by passing a different
``seed`` or through the function arguments, never per benchmark.
"""

from __future__ import annotations

import math

import numpy as np

from runtime.sim.fleet import Trace
from runtime.sim.trace import TraceRequest

BASE_RATE_PER_S = 2.0  # requests/s at rate scale 1 (the Azure 2023 traces run at 2-6 req/s per hour)
DURATION_S = 3600.0
MAX_TOKENS = 128_000
GAMMA_SHAPE = 0.25
MMPP_LOW, MMPP_HIGH = 0.5, 2.5
MMPP_SOJOURN_S = (180.0, 60.0)
DIURNAL_MIN = 0.25
FLASH_AT, FLASH_PEAK, FLASH_RISE_S, FLASH_HOLD_S, FLASH_DECAY_S = 0.4, 5.0, 10.0, 120.0, 60.0
AGENT_SESSIONS = 64
SHIFT_FROM, SHIFT_TO = 0.4, 0.6

ARRIVALS = ("poisson", "gamma", "mmpp", "diurnal", "flash")
MIXES = ("chat", "rag", "agentic", "shift")
#: The development set's synthetic shapes: every arrival process once, every mix at least once.
DEFAULT_SHAPES = ("poisson_chat", "gamma_rag", "mmpp_agentic", "diurnal_chat", "flash_rag", "poisson_shift")


def shape_names() -> list[str]:
    """Every ``<arrivals>_<mix>`` name :func:`generate` accepts."""
    return [f"{a}_{m}" for a in ARRIVALS for m in MIXES]


def generate(name: str, rate_scale: float = 1.0, seed: int = 0, duration_s: float = DURATION_S) -> Trace:
    """The trace of shape ``name`` (``<arrivals>_<mix>``, see the module doc) at ``rate_scale`` times
    the base rate, ``duration_s`` seconds long, drawn from ``numpy.random.default_rng(seed)``.

    Arrival times are seconds from 0 (sorted), lengths integer tokens in ``[1, MAX_TOKENS]``. The same
    arguments give the same trace.

    Raises:
        ValueError: unknown arrival process or mix (the message lists the choices), ``rate_scale`` or
            ``duration_s`` not finite and > 0, or a shape that draws no request.
    """
    arrivals, _, mix = name.partition("_")
    if arrivals not in ARRIVALS or mix not in MIXES:
        raise ValueError(f"unknown shape {name!r}: expected <arrivals>_<mix>, arrivals in {ARRIVALS}, mix in {MIXES}")
    for what, v in (("rate_scale", rate_scale), ("duration_s", duration_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"shape {name!r}: {what} must be finite and > 0, got {v!r}")
    rng = np.random.default_rng(seed)
    lam = BASE_RATE_PER_S * float(rate_scale)
    t = _ARRIVAL_FNS[arrivals](rng, lam, float(duration_s))
    if not len(t):
        raise ValueError(f"shape {name!r} at rate scale {rate_scale} drew no request in {duration_s} s")
    isl, osl, _ = _lengths(rng, mix, t, float(duration_s))
    return Trace(t - t[0], isl, osl)


def generate_requests(name: str, rate_scale: float = 1.0, seed: int = 0, duration_s: float = DURATION_S,
                      block_tokens: int = 512) -> list[TraceRequest]:
    """The trace :func:`generate` draws for the same arguments, as requests with prompt block ids for the
    router replay (runtime/sim/replay.py): one id per ``block_tokens`` tokens of prompt (Mooncake's
    ``hash_ids``). An ``agentic`` request's full blocks of its session's prefix carry the session's ids, shared
    by every request of that session; every other block has an id of its own (the simulated caches then hit
    only shared prefixes). Request ids are ``r<index>``.

    Raises:
        ValueError: as :func:`generate`, or ``block_tokens`` < 1.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    arrivals, _, mix = name.partition("_")
    trace = generate(name, rate_scale, seed, duration_s)
    # the same draws again, for the sessions (generate() keeps only the lengths)
    rng = np.random.default_rng(seed)
    t = _ARRIVAL_FNS[arrivals](rng, BASE_RATE_PER_S * float(rate_scale), float(duration_s))
    _, _, sessions = _lengths(rng, mix, t, float(duration_s))
    max_blocks = -(-MAX_TOKENS // block_tokens)
    next_id = AGENT_SESSIONS * max_blocks  # ids below it are the sessions' prefix blocks
    out = []
    for i, (a, n_in, n_out) in enumerate(zip(trace.arrival_s.tolist(), trace.isl_tokens.tolist(),
                                             trace.osl_tokens.tolist())):
        n_blocks = -(-n_in // block_tokens)
        shared = 0
        ids: list[int] = []
        if sessions is not None:
            session, prefix = sessions[0][i], sessions[1][i]
            shared = min(int(prefix) // block_tokens, n_blocks)
            ids = [int(session) * max_blocks + j for j in range(shared)]
        ids += range(next_id, next_id + n_blocks - shared)
        next_id += n_blocks - shared
        out.append(TraceRequest(f"r{i}", float(a), int(n_in), int(n_out), tuple(ids)))
    return out


# ----------------------------------------------------------------------------- arrivals
def _poisson(rng: np.random.Generator, lam: float, dur: float) -> np.ndarray:
    n = rng.poisson(lam * dur)
    return np.sort(rng.uniform(0.0, dur, n))


def _gamma(rng: np.random.Generator, lam: float, dur: float) -> np.ndarray:
    # enough gaps to pass dur with overwhelming probability, then more if not
    n = int(lam * dur * 1.2) + 100
    t = np.cumsum(rng.gamma(GAMMA_SHAPE, 1.0 / (GAMMA_SHAPE * lam), n))
    while t[-1] < dur:
        t = np.concatenate([t, t[-1] + np.cumsum(rng.gamma(GAMMA_SHAPE, 1.0 / (GAMMA_SHAPE * lam), n))])
    return t[t < dur]


def _mmpp(rng: np.random.Generator, lam: float, dur: float) -> np.ndarray:
    lo_s, hi_s = MMPP_SOJOURN_S
    base = lam * (lo_s + hi_s) / (MMPP_LOW * lo_s + MMPP_HIGH * hi_s)  # time average = lam
    out, t, high = [], 0.0, False
    while t < dur:
        stay = rng.exponential(hi_s if high else lo_s)
        end = min(t + stay, dur)
        r = base * (MMPP_HIGH if high else MMPP_LOW)
        n = rng.poisson(r * (end - t))
        out.append(rng.uniform(t, end, n))
        t, high = end, not high
    return np.sort(np.concatenate(out))


def _thinned(rng: np.random.Generator, rate_fn, lam_max: float, dur: float) -> np.ndarray:
    cand = _poisson(rng, lam_max, dur)
    return cand[rng.uniform(0.0, lam_max, len(cand)) < rate_fn(cand)]


def _diurnal(rng: np.random.Generator, lam: float, dur: float) -> np.ndarray:
    def rate(t: np.ndarray) -> np.ndarray:
        return lam * (DIURNAL_MIN + 2.0 * (1.0 - DIURNAL_MIN) * np.sin(np.pi * t / dur) ** 2)

    return _thinned(rng, rate, lam * (2.0 - DIURNAL_MIN), dur)


def _flash(rng: np.random.Generator, lam: float, dur: float) -> np.ndarray:
    t0 = FLASH_AT * dur

    def rate(t: np.ndarray) -> np.ndarray:
        x = t - t0
        extra = np.where(x < 0, 0.0, np.where(x < FLASH_RISE_S, x / FLASH_RISE_S, np.where(
            x < FLASH_RISE_S + FLASH_HOLD_S, 1.0, np.exp(-(x - FLASH_RISE_S - FLASH_HOLD_S) / FLASH_DECAY_S))))
        return lam * (1.0 + (FLASH_PEAK - 1.0) * extra)

    return _thinned(rng, rate, lam * FLASH_PEAK, dur)


_ARRIVAL_FNS = {"poisson": _poisson, "gamma": _gamma, "mmpp": _mmpp, "diurnal": _diurnal, "flash": _flash}


# ----------------------------------------------------------------------------- lengths
def _lognormal(rng: np.random.Generator, median: float, sigma: float, n: int) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), 1, MAX_TOKENS).astype(np.int64)


def _chat(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return _lognormal(rng, 600, 1.0, n), _lognormal(rng, 350, 0.8, n)


def _rag(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    return _lognormal(rng, 8000, 0.7, n), _lognormal(rng, 16, 0.8, n)


def _agentic(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    prefix = _lognormal(rng, 10_000, 0.5, AGENT_SESSIONS)
    session = rng.integers(0, AGENT_SESSIONS, n)
    isl = np.minimum(prefix[session] + _lognormal(rng, 500, 0.8, n), MAX_TOKENS)
    return isl, _lognormal(rng, 200, 0.8, n), (session, prefix[session])


def _lengths(rng: np.random.Generator, mix: str, t: np.ndarray,
             dur: float) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """ISL, OSL and, for ``agentic``, each request's (session, session prefix tokens); else None."""
    n = len(t)
    if mix == "chat":
        return (*_chat(rng, n), None)
    if mix == "rag":
        return (*_rag(rng, n), None)
    if mix == "agentic":
        return _agentic(rng, n)
    # shift: chat turning into rag between SHIFT_FROM and SHIFT_TO of the span
    p_rag = np.clip((t / dur - SHIFT_FROM) / (SHIFT_TO - SHIFT_FROM), 0.0, 1.0)
    is_rag = rng.uniform(size=n) < p_rag
    ci, co = _chat(rng, n)
    ri, ro = _rag(rng, n)
    return np.where(is_rag, ri, ci), np.where(is_rag, ro, co), None


__all__ = ["ARRIVALS", "BASE_RATE_PER_S", "DEFAULT_SHAPES", "MIXES", "generate", "generate_requests", "shape_names"]
