"""Load predictors: forecast the next tick's value of a series (request rate, ISL, OSL).

Every predictor keeps its own history and exposes ``observe(value)`` and
``predict(steps_ahead=1) -> float``. No clock, no I/O: one ``observe`` per planner tick.

Registry: :func:`make_predictor` maps a name from ``PlannerSpec.predictor`` to a class once.
Sources: Dynamo planner ``load_predictor`` (constant / ARIMA / Prophet) for the interface; the
burst-aware quantile predictor follows the "provision for a high quantile of the recent rate"
rule used by autoscalers such as Kubernetes HPA's stabilisation window (max over a window).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

import numpy as np


class LoadPredictor(Protocol):
    """Forecasts a non-negative series one observation per tick."""

    def observe(self, value: float) -> None: ...

    def predict(self, steps_ahead: int = 1) -> float: ...


def _check(value: float) -> float:
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"predictor observation must be finite and >= 0, got {value!r}")
    return v


class ConstantPredictor:
    """Predicts the last observed value (0.0 before any observation)."""

    def __init__(self, window: int = 1) -> None:
        self._last = 0.0

    def observe(self, value: float) -> None:
        self._last = _check(value)

    def predict(self, steps_ahead: int = 1) -> float:
        return self._last


class MovingAveragePredictor:
    """Mean of the last ``window`` observations (0.0 before any)."""

    def __init__(self, window: int = 10) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._hist: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> None:
        self._hist.append(_check(value))

    def predict(self, steps_ahead: int = 1) -> float:
        return float(np.mean(self._hist)) if self._hist else 0.0


TREND_POINTS = 6


class BurstQuantilePredictor:
    """Burst-aware: the ``quantile`` of the last ``window`` observations, never below the mean of
    the last two observations plus the upward least-squares trend of the last ``TREND_POINTS``
    observations times ``steps_ahead``.

    Provisioning for a high quantile of recent load absorbs the short bursts a mean smooths
    away; the trend term makes it follow a ramp instead of lagging a window behind it.
    """

    def __init__(self, window: int = 10, quantile: float = 0.9) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self._hist: deque[float] = deque(maxlen=window)
        self._q = quantile

    def observe(self, value: float) -> None:
        self._hist.append(_check(value))

    def predict(self, steps_ahead: int = 1) -> float:
        if not self._hist:
            return 0.0
        return max(float(np.quantile(np.asarray(self._hist), self._q)), self.trend_forecast(steps_ahead))

    def trend_forecast(self, steps_ahead: int = 1) -> float:
        """The level-and-trend part of :meth:`predict` alone: the mean of the last two observations
        plus the upward least-squares trend of the last ``TREND_POINTS`` times ``steps_ahead``
        (no quantile of the window: a burst is not held for the window's length)."""
        if not self._hist:
            return 0.0
        h = np.asarray(self._hist)
        trend = 0.0
        k = min(len(h), TREND_POINTS)
        if k >= 3:
            # least-squares slope over the last k points, per tick; only upward trends count
            trend = float(np.polyfit(np.arange(k), h[-k:], 1)[0])
        return float(np.mean(h[-2:])) + max(trend, 0.0) * steps_ahead


class ResidualQuantilePredictor:
    """Level plus an empirical quantile of past forecast errors at the same horizon.

    The level is the mean of the last ``LEVEL_POINTS`` observations; the forecast ``steps_ahead``
    ticks out is ``level + quantile_q(x[t + steps] - level_t)`` over the errors the same rule made
    in the last ``window`` ticks (0 while fewer than ``MIN_RESIDUALS`` exist, never below 0 extra
    when ``quantile >= 0.5``). Provisioning for a high quantile of the *change* over the worker
    lead time sizes headroom from how bursty the series has been, instead of a fixed factor
    (conformal-style prediction interval; Shafer & Vovk, "A tutorial on conformal prediction",
    JMLR 2008).
    """

    LEVEL_POINTS = 2
    MIN_RESIDUALS = 4

    def __init__(self, window: int = 40, quantile: float = 0.9) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 0 < quantile <= 1:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self._window = window
        self._q = quantile
        self._hist: deque[float] = deque(maxlen=window + 16)

    def observe(self, value: float) -> None:
        self._hist.append(_check(value))

    def predict(self, steps_ahead: int = 1) -> float:
        if not self._hist:
            return 0.0
        h = np.asarray(self._hist, dtype=float)
        k = self.LEVEL_POINTS
        level = float(np.mean(h[-k:]))
        s = max(int(steps_ahead), 1)
        n = len(h)
        if n < k + s + self.MIN_RESIDUALS - 1:
            return max(level, float(h[-1]))
        # level at each past t (mean of h[t-k+1..t]) vs the value s ticks later
        csum = np.concatenate([[0.0], np.cumsum(h)])
        t = np.arange(k - 1, n - s)
        levels = (csum[t + 1] - csum[t + 1 - k]) / k
        resid = h[t + s] - levels
        resid = resid[-self._window:]
        return max(level + float(np.quantile(resid, self._q)), 0.0)


class ArimaPredictor:
    """ARIMA(p, d, q) from statsmodels refitted on the last ``window`` observations.

    Falls back to the last value while fewer than ``min_points`` observations exist or when the
    fit fails (constant series, non-convergence). Negative forecasts are clipped to 0.
    Source: Dynamo's SLA planner default predictor is ARIMA (``load_predictor = "arima"``).
    Raises ImportError naming statsmodels when it is not installed.
    """

    def __init__(self, window: int = 40, order: tuple[int, int, int] = (1, 1, 1), min_points: int = 5) -> None:
        try:
            from statsmodels.tsa.arima.model import ARIMA  # noqa: F401
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("predictor 'arima' needs statsmodels (pip install statsmodels)") from e
        self._hist: deque[float] = deque(maxlen=max(window, min_points))
        self._order = order
        self._min_points = min_points
        self._fit: object = None  # the fit of the current history (reused until the next observation)

    def observe(self, value: float) -> None:
        self._hist.append(_check(value))
        self._fit = None

    def predict(self, steps_ahead: int = 1) -> float:
        """Forecast ``steps_ahead`` ticks out; one ARIMA fit per observation, shared by every horizon
        asked between two observations (a tick asks for 1 and for the lead time)."""
        if not self._hist:
            return 0.0
        h = np.asarray(self._hist, dtype=float)
        if len(h) < self._min_points or float(np.ptp(h)) == 0.0:
            return float(h[-1])
        import warnings

        from statsmodels.tsa.arima.model import ARIMA

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if self._fit is None:
                    self._fit = ARIMA(h, order=self._order).fit()
                fc = self._fit.forecast(steps=steps_ahead)
            value = float(fc[-1])
        except (ValueError, np.linalg.LinAlgError):
            return float(h[-1])
        if not math.isfinite(value):
            return float(h[-1])
        return max(value, 0.0)


PREDICTORS: dict[str, type] = {
    "constant": ConstantPredictor,
    "moving_average": MovingAveragePredictor,
    "burst_quantile": BurstQuantilePredictor,
    "arima": ArimaPredictor,
    "residual_quantile": ResidualQuantilePredictor,
}


def make_predictor(name: str, *, window: int = 10, quantile: float = 0.9) -> LoadPredictor:
    """Build a predictor by registry name; raises ValueError naming the unknown ``predictor``."""
    if name not in PREDICTORS:
        raise ValueError(f"unknown planner.predictor {name!r}; choose one of {sorted(PREDICTORS)}")
    if name == "burst_quantile":
        return BurstQuantilePredictor(window=window, quantile=quantile)
    if name == "residual_quantile":
        return ResidualQuantilePredictor(window=window, quantile=quantile)
    if name == "arima":
        return ArimaPredictor(window=max(window, 20))
    return PREDICTORS[name](window=window)
