"""Stability rules applied to a pool's raw desired replica count, tick by tick.

* Scale up early: a higher target is taken at once (the predictor already looks a worker start
  ahead, see the state machine).
* Scale down late: a lower target is taken only as the *maximum* desired over the last
  ``scale_down_delay_s`` (sliding window; Kubernetes HPA's ``stabilizationWindowSeconds`` for
  scale-down), and not before the window has been observed in full.
* Cooldown: the scaling direction may flip at most once per ``cooldown_s``; a flip requested
  sooner holds the current count.
* :func:`fit_budget` trims two pools into a GPU budget without going below their minimums.
"""

from __future__ import annotations

import math
from collections import deque


class PoolStabilizer:
    """Sliding-window + cooldown filter for one pool. Times are seconds on the caller's clock."""

    def __init__(self, scale_down_delay_s: float, cooldown_s: float) -> None:
        if scale_down_delay_s < 0 or cooldown_s < 0:
            raise ValueError("scale_down_delay_s and cooldown_s must be >= 0")
        self._delay = scale_down_delay_s
        self._cooldown = cooldown_s
        self._window: deque[tuple[float, int]] = deque()
        self._first_s: float | None = None
        self._last_dir = 0
        self._last_flip_s = -math.inf

    def propose(self, now_s: float, current: int, desired: int) -> int:
        """Return the stabilised target for ``desired`` given the ``current`` target (no commit)."""
        if self._first_s is None:
            self._first_s = now_s
        if self._window and self._window[-1][0] == now_s:  # same instant again: one entry, the larger ask
            self._window[-1] = (now_s, max(self._window[-1][1], desired))
        else:
            self._window.append((now_s, desired))
        while self._window and self._window[0][0] < now_s - self._delay:
            self._window.popleft()
        if desired >= current:
            target = desired
        elif now_s - self._first_s < self._delay:
            target = current  # window not yet observed in full: never scale down
        else:
            target = min(current, max(d for _, d in self._window))
        if not self.may_move(now_s, current, target):
            return current
        return target

    def may_move(self, now_s: float, current: int, target: int) -> bool:
        """False when moving ``current`` → ``target`` would flip direction within the cooldown."""
        direction = (target > current) - (target < current)
        return not (
            direction != 0
            and self._last_dir != 0
            and direction != self._last_dir
            and now_s - self._last_flip_s < self._cooldown
        )

    def commit(self, now_s: float, current: int, target: int) -> None:
        """Record the move actually made (after budget trimming)."""
        direction = (target > current) - (target < current)
        if direction == 0:
            return
        if direction != self._last_dir:
            self._last_flip_s = now_s
        self._last_dir = direction


def fit_budget(
    prefill: int, decode: int, *, prefill_tp: int, decode_tp: int, min_prefill: int, min_decode: int, budget_gpus: int,
    refill: bool = False,
) -> tuple[int, int]:
    """Trim (prefill, decode) replicas until ``prefill*prefill_tp + decode*decode_tp <= budget_gpus``,
    taking one replica at a time from the pool using more GPUs above its minimum; with ``refill``, then
    give the GPUs a trim freed beyond the excess back, prefill first, up to the asked counts.
    Raises ValueError naming ``gpu_budget`` when even the minimums do not fit."""
    if min_prefill * prefill_tp + min_decode * decode_tp > budget_gpus:
        raise ValueError(
            f"gpu_budget {budget_gpus} < GPUs of the minimum replicas "
            f"({min_prefill}x{prefill_tp} + {min_decode}x{decode_tp})"
        )
    want_p, want_d = max(prefill, min_prefill), max(decode, min_decode)
    p, d = want_p, want_d
    while p * prefill_tp + d * decode_tp > budget_gpus:
        can_p, can_d = p > min_prefill, d > min_decode
        if can_p and (not can_d or p * prefill_tp >= d * decode_tp):
            p -= 1
        else:
            d -= 1
    if not refill:
        return p, d
    # a trim of the larger step (a decode worker at TP 4 against prefill at TP 2) can free more than the
    # excess: give what is left back to the pools, prefill first (its queue is what decode waits for)
    while p < want_p and (p + 1) * prefill_tp + d * decode_tp <= budget_gpus:
        p += 1
    while d < want_d and p * prefill_tp + (d + 1) * decode_tp <= budget_gpus:
        d += 1
    return p, d


class RecurrenceHold:
    """Hold a pool's window need through the gaps after which, within the last ``history_ticks``
    ticks, a need it had released came back while the pool was short, up to the level that came back.

    Each tick :meth:`update` takes the tick's need (workers the recent arrivals needed, e.g. the
    planner's window pool), the workers ready and whether the pool is short (its observed wait or ITL
    over budget). On a short tick it walks back over the current rise of the need, then further back
    through the levels the pool fell through: a level above the ready workers (up to the need now) last
    needed ``gap`` ticks ago was needed, released, and is needed again. It records ``(gap, level)`` for
    each. The held need is the tick's need, and for each record within the history the largest need of
    the last ``gap + 1`` ticks up to its ``level``.

    Why: a burst shorter than a worker start is over before a worker launched for it is ready, so the
    pool must stand at what bursts need through the gaps between them; how long those gaps last, and
    at what level, is a property of the traffic, measured here from the recurrences that found the pool
    short. A crowd that does not come back records only levels the pool had stood at before it; its own
    level is held no longer than the window.
    """

    def __init__(self, history_ticks: int) -> None:
        if history_ticks < 1:
            raise ValueError(f"history_ticks must be >= 1, got {history_ticks}")
        self._needs: deque[int] = deque(maxlen=history_ticks)
        self._records: deque[tuple[int, int, int]] = deque()  # (tick recorded, gap ticks, level workers)
        self._tick = 0

    @property
    def records(self) -> list[tuple[int, int]]:
        """``(gap ticks, level workers)`` of the recurrences recorded within the history, oldest first."""
        return [(g, lv) for _, g, lv in self._records]

    def update(self, need: int, ready: int, short: bool) -> int:
        """Record this tick's ``need`` (workers) and return the held need (workers, >= ``need``)."""
        self._tick += 1
        h = self._needs
        h.append(need)
        if short:
            i = len(h) - 1
            while i > 0 and h[i] > ready and h[i - 1] <= h[i]:  # back over the current rise
                i -= 1
            # each level the pool fell through on its way down, up to the need now: (gap since that level
            # was last needed, the level)
            top = ready
            for k in range(i - 1, -1, -1):
                if h[k] > top:
                    top = min(h[k], need)
                    self._records.append((self._tick, len(h) - 1 - k, top))
                    if top >= need:
                        break
        while self._records and self._records[0][0] <= self._tick - (h.maxlen or 0):
            self._records.popleft()
        held = need
        for _, gap, level in self._records:
            recent = max(h[k] for k in range(max(len(h) - 1 - gap, 0), len(h)))
            held = max(held, min(level, recent))
        return held
