"""Baseline: NVIDIA Dynamo's published SLA-planner replica formula, as a controller on our ticks.

Re-stated from ai-dynamo/dynamo ``components/src/dynamo/planner/utils/prefill_planner.py`` and
``decode_planner.py`` (``_compute_replica_requirements``, ``_update_correction_factor``) with the
defaults of ``planner/defaults.py`` (``adjustment_interval = 180`` s, ``load_predictor = "arima"``,
``min_endpoint = 1``):

* prefill: ``num_p = ceil(num_req * isl / interval * min(1, p_corr) / thpt_per_gpu(isl) / tp_p)``
  with ``thpt_per_gpu(isl) = isl / ttft(isl) / tp_p`` (profiled prefill at batch 1) and
  ``p_corr = observed TTFT / ttft(isl)``;
* decode: ``num_d = ceil(num_req * osl / interval / thpt_per_gpu(itl / d_corr, isl + osl/2) / tp_d)``
  with the best profiled per-GPU decode throughput under the corrected ITL and
  ``d_corr = observed ITL / itl(concurrency, context)``;
* both at least ``min_endpoint``, then the GPU budget; no lead time, no scale-down delay.

``load_headroom`` (default 0: Dynamo's formula as published) is not Dynamo's: it multiplies the
predicted request count by ``1 + load_headroom`` for both pools, the over-provisioning a Dynamo user
would add to reach an attainment target the formula misses (the formula sizes prefill at 100 %
utilisation of the predicted mean). ``bench/planner.py --dynamo-matched`` searches the smallest one
that meets the benchmark's attainment target.

It acts every ``adjustment_interval_s`` (a multiple of the tick) and returns None in between, and at the
end of an interval in which no request arrived or none ended (no mean ISL or OSL: Dynamo skips the adjustment).

``load_scaling=True`` adds Dynamo 1.x's load-based mode on top (``enable_load_scaling``,
``planner_core.py`` + ``PrefillPlanner/DecodePlanner.loadbased_plan_adjustment``): the throughput
result becomes a lower bound, and every tick each pool steps +1 when its per-worker load is above
the load the SLO allows, -1 when below ``(n-1)/n * sensitivity`` of it (default sensitivity 80 %).
Prefill load is active prefill tokens per worker against ``x_sla - ISL`` where the TTFT regression
``TTFT = a + b * (active_tokens + ISL)`` is solved for the TTFT target; decode load is active KV
tokens per worker against the KV at which the ITL regression meets the ITL target. Dynamo learns
both regressions online; here they are taken from the profile (a perfectly trained regression),
which favours the baseline.
"""

from __future__ import annotations

import math

from runtime.planner.predictors import make_predictor
from runtime.planner.profiles import ServiceProfile
from runtime.planner.stability import fit_budget
from runtime.planner.types import ScalingDecision, TickInput



def ended_osl_mean(ticks: list[TickInput]) -> float | None:
    """Mean output length, tokens, over an interval of ``ticks``: their ``mean_osl_tokens`` (those of the
    requests that ended in each; 0: none ended) over the ticks where some ended, weighted by each tick's
    requests (at least 1), as Dynamo's frontend metrics report output lengths; None where none ended. Pure."""
    ended = [(t.mean_osl_tokens, max(t.num_requests, 1)) for t in ticks if t.mean_osl_tokens > 0]
    return sum(v * w for v, w in ended) / sum(w for _, w in ended) if ended else None

class DynamoSlaBaseline:
    """Dynamo SLA planner arithmetic. Times in seconds; ``itl_target_s`` / ``ttft_target_s`` SLOs."""

    def __init__(
        self,
        profile: ServiceProfile,
        *,
        prefill_tp: int,
        decode_tp: int,
        ttft_target_s: float,
        itl_target_s: float,
        gpu_budget: int,
        adjustment_interval_s: float = 180.0,
        predictor: str = "arima",
        min_endpoint: int = 1,
        load_scaling: bool = False,
        load_down_sensitivity: float = 0.8,
        load_headroom: float = 0.0,
    ) -> None:
        if not (load_headroom >= 0.0 and math.isfinite(load_headroom)):
            raise ValueError(f"load_headroom must be a finite number >= 0, got {load_headroom}")
        self.prof = profile
        self.load_headroom = load_headroom
        self.tp_p, self.tp_d = prefill_tp, decode_tp
        self.ttft_s, self.itl_s = ttft_target_s, itl_target_s
        self.budget = gpu_budget
        self.interval_s = adjustment_interval_s
        self.min_endpoint = min_endpoint
        self._num_req = make_predictor(predictor)
        self._isl = make_predictor(predictor)
        self._osl = make_predictor(predictor)
        self._seen_nonzero: set[str] = set()  # predictors that have taken a non-zero value (`_feed`)
        self.p_corr = self.d_corr = 1.0
        self._acc: list[TickInput] = []
        self._window_start: float | None = None
        self.load_scaling = load_scaling
        self.down_sensitivity = load_down_sensitivity
        self._floor: tuple[int, int] | None = None
        self._current: tuple[int, int] | None = None

    def on_tick(self, tick: TickInput) -> ScalingDecision | None:
        """Throughput decision every ``adjustment_interval_s``; with ``load_scaling`` a load step
        on every tick above that floor. None when nothing changes."""
        thpt = self._throughput_tick(tick)
        if not self.load_scaling:
            return thpt
        if thpt is not None:
            self._floor = (thpt.prefill_replicas, thpt.decode_replicas)
        if self._current is None:
            self._current = (max(tick.prefill.num_ready + tick.prefill.num_starting, self.min_endpoint),
                             max(tick.decode.num_ready + tick.decode.num_starting, self.min_endpoint))
        p, d = self._load_step(tick)
        if self._floor is not None:
            p, d = max(p, self._floor[0]), max(d, self._floor[1])
        p, d = fit_budget(p, d, prefill_tp=self.tp_p, decode_tp=self.tp_d, min_prefill=self.min_endpoint,
                          min_decode=self.min_endpoint, budget_gpus=self.budget)
        self._current = (p, d)
        return ScalingDecision(tick.now_s, p, d, ttft_correction=self.p_corr, itl_correction=self.d_corr,
                               reason="dynamo_sla+load")

    def _load_step(self, tick: TickInput) -> tuple[int, int]:
        """Dynamo's load-based +-1 per pool (see the module doc); needs requests in the window."""
        assert self._current is not None
        p, d = self._current
        if tick.num_requests == 0:
            return p, d
        isl = max(tick.mean_isl_tokens, 1.0)
        s_per_token = float(self.prof.prefill.prefill_time_s(isl)) / isl
        target_tokens = self.ttft_s / s_per_token - isl  # x_sla - ISL
        active = tick.prefill.queue_per_worker * isl  # queued prompt tokens per ready worker
        n_p = max(tick.prefill.num_ready, 1)
        if target_tokens > 0 and active > target_tokens:
            p += 1
        elif p > 1 and active < target_tokens * (n_p - 1) / n_p * self.down_sensitivity:
            p -= 1
        ctx = isl + (tick.mean_osl_tokens or self._osl.predict()) / 2.0
        x_sla = self.prof.decode.max_batch(self.itl_s, ctx, ctx) * ctx  # KV tokens at the ITL target
        kv_tokens = tick.decode.kv_usage * self.prof.decode.kv_capacity_tokens
        n_d = max(tick.decode.num_ready, 1)
        if x_sla > 0 and kv_tokens > x_sla:
            d += 1
        elif d > 1 and kv_tokens < x_sla * (n_d - 1) / n_d * self.down_sensitivity:
            d -= 1
        return p, d

    def _throughput_tick(self, tick: TickInput) -> ScalingDecision | None:
        if self._window_start is None:
            self._window_start = tick.now_s - tick.interval_s
        self._acc.append(tick)
        if tick.now_s - self._window_start < self.interval_s - 1e-9:
            return None
        ticks, self._acc, self._window_start = self._acc, [], tick.now_s
        num_req = sum(t.num_requests for t in ticks)
        isl = sum(t.mean_isl_tokens * t.num_requests for t in ticks) / num_req if num_req else None
        osl = ended_osl_mean(ticks)
        # Dynamo feeds every interval's means to its predictors, a missing one (NaN) as 0 and zeros before the
        # first non-zero value skipped (`BasePredictor.add_data_point`, dynamo/planner/utils/load_predictor.py)
        for name, value in (("num_req", num_req), ("isl", isl), ("osl", osl)):
            self._feed(name, value or 0.0)
        if isl is None or osl is None:
            # and skips the adjustment when the interval's metrics hold a NaN (no request arrived: no mean ISL;
            # none ended: no mean OSL): `Metrics.is_valid` in dynamo/planner/utils/prometheus.py, checked first
            # in `plan_adjustment`. The fleet stays as it is.
            return None
        self._update_corrections(ticks, isl, osl)
        predicted_num = self._num_req.predict()
        next_num = predicted_num * (1.0 + self.load_headroom)
        next_isl, next_osl = self._isl.predict(), self._osl.predict()
        if next_isl <= 0 or next_osl <= 0:
            return ScalingDecision(tick.now_s, self.min_endpoint, self.min_endpoint, reason="dynamo_no_data")
        p_thpt_per_gpu = next_isl / float(self.prof.prefill.prefill_time_s(next_isl)) / self.tp_p
        pred_p = next_num * next_isl / self.interval_s * min(1.0, self.p_corr)
        num_p = max(math.ceil(pred_p / p_thpt_per_gpu / self.tp_p), self.min_endpoint)
        corrected_itl = self.itl_s / self.d_corr if self.d_corr > 0 else self.itl_s
        ctx = next_isl + next_osl / 2
        d_thpt_per_gpu = self.prof.decode.tokens_per_s(corrected_itl, ctx, ctx) / self.tp_d
        if d_thpt_per_gpu <= 0:
            num_d = self.min_endpoint
        else:
            num_d = max(math.ceil(next_num * next_osl / self.interval_s / d_thpt_per_gpu / self.tp_d), self.min_endpoint)
        num_p, num_d = fit_budget(
            num_p, num_d, prefill_tp=self.tp_p, decode_tp=self.tp_d, min_prefill=self.min_endpoint,
            min_decode=self.min_endpoint, budget_gpus=self.budget,
        )
        return ScalingDecision(
            tick.now_s, num_p, num_d, predicted_rate_per_s=predicted_num / self.interval_s,
            predicted_isl_tokens=next_isl, predicted_osl_tokens=next_osl,
            ttft_correction=self.p_corr, itl_correction=self.d_corr, reason="dynamo_sla",
        )

    def _feed(self, name: str, value: float) -> None:
        """Observe ``value`` on the ``name`` predictor as Dynamo's predictors take a data point: zeros before the
        first non-zero value are skipped."""
        if value == 0.0 and name not in self._seen_nonzero:
            return
        self._seen_nonzero.add(name)
        {"num_req": self._num_req, "isl": self._isl, "osl": self._osl}[name].observe(value)

    def _update_corrections(self, ticks: list[TickInput], isl: float, osl: float) -> None:
        last = ticks[-1]
        if last.observed_ttft_p90_s is not None:
            self.p_corr = last.observed_ttft_p90_s / float(self.prof.prefill.prefill_time_s(isl))
        if last.observed_itl_p90_s is not None and last.decode.running_per_worker > 0:
            exp = self.prof.decode.step_s(last.decode.running_per_worker, isl + osl / 2)
            self.d_corr = last.observed_itl_p90_s / exp
