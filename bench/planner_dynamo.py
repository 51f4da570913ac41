"""Client side of ``dynamo_planner`` in bench/planner.py: NVIDIA Dynamo's own SLA planner
(``ai-dynamo==1.0.2``) run by bench/dynamo_planner_driver.py in its own virtualenv, as a fleet
controller. Our profile goes over in Dynamo's profiler format; every ``DYNAMO_INTERVAL_S`` the
interval's mean metrics go over and Dynamo's replica counts come back (JSON lines on stdin/stdout).

Set up the venv once (kept out of git by ``.venv*/``)::

    python3.11 -m venv .venv-bench-planner
    .venv-bench-planner/bin/pip install ai-dynamo==1.0.2 pandas pmdarima filterpy prophet aiohttp \
        prometheus-api-client
"""

from __future__ import annotations

import json
import select
import subprocess
from pathlib import Path

import numpy as np

from runtime.planner.dynamo_baseline import ended_osl_mean
from runtime.planner.types import ScalingDecision, TickInput

DYNAMO_DRIVER = Path(__file__).resolve().parent / "dynamo_planner_driver.py"
DYNAMO_INTERVAL_S = 180.0  # Dynamo's default throughput_adjustment_interval (planner/defaults.py)


def dynamo_profile_payload(profile, prefill_tp: int, decode_tp: int) -> dict:
    """Our ServiceProfile in Dynamo's profiler format (``prefill_raw_data.json`` /
    ``decode_raw_data.json``): prefill TTFT (ms) by ISL; decode ITL (ms) and tokens/s per GPU over a
    (KV usage, context length) grid, batch = usage x KV capacity / context."""
    isl = [int(i) for i in profile.prefill.isl_grid_tokens if i >= 64]
    dec = profile.decode
    xs, ys, itl_ms, thpt = [], [], [], []
    for ctx in dec.context_grid_tokens:
        for usage in np.linspace(0.02, 1.0, 25):
            batch = min(usage * dec.kv_capacity_tokens / ctx, dec.max_num_seqs)
            if batch < 1:
                continue
            step = dec.step_s(batch, ctx)
            xs.append(float(usage))
            ys.append(int(ctx))
            itl_ms.append(step * 1000.0)
            thpt.append(batch / step / decode_tp)
    return {
        "prefill": {"isl": isl, "ttft_ms": [float(profile.prefill.prefill_time_s(i)) * 1000.0 for i in isl]},
        "decode": {"max_kv_tokens": int(dec.kv_capacity_tokens), "x_kv_usage": xs, "y_context_length": ys,
                   "z_itl_ms": itl_ms, "z_thpt_per_gpu": thpt},
        "prefill_tp": prefill_tp, "decode_tp": decode_tp,
    }


class DynamoPlannerProcess:
    """Controller that runs NVIDIA Dynamo's own SLA planner (bench/dynamo_planner_driver.py in the
    ``python`` of its venv) every ``DYNAMO_INTERVAL_S``: it sends the interval's mean metrics and
    applies the replicas Dynamo answers. Use as a context manager; the subprocess is stopped via its
    own handle (terminate, wait, kill). Raises RuntimeError naming the driver when it fails or gives
    no answer within ``timeout_s``."""

    def __init__(self, python: Path, profile, *, prefill_tp: int, decode_tp: int, ttft_s: float, itl_s: float,
                 gpu_budget: int, tick_s: float, load_predictor: str = "arima", timeout_s: float = 300.0) -> None:
        self.every = max(int(round(DYNAMO_INTERVAL_S / tick_s)), 1)
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen([str(python), str(DYNAMO_DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        setup = dynamo_profile_payload(profile, prefill_tp, decode_tp) | {
            "interval_s": DYNAMO_INTERVAL_S, "ttft_ms": ttft_s * 1000.0, "itl_ms": itl_s * 1000.0,
            "gpu_budget": gpu_budget, "load_predictor": load_predictor}
        self._ticks: list[TickInput] = []
        try:
            self._ask(setup)
        except BaseException:
            self.close()
            raise

    def _ask(self, msg: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
            # one request, one answer line: nothing is buffered between calls, so select sees it
            ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
            if not ready:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"{DYNAMO_DRIVER.name} gave no answer within {self.timeout_s} s")
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"{DYNAMO_DRIVER.name} stopped: {err.strip()[-2000:]}")
        return json.loads(line)

    def __call__(self, tick: TickInput) -> ScalingDecision | None:
        self._ticks.append(tick)
        if len(self._ticks) < self.every:
            return None
        ticks, self._ticks = self._ticks, []
        n = sum(t.num_requests for t in ticks)

        def mean(attr: str) -> float | None:
            pairs = [(getattr(t, attr), max(t.num_requests, 1)) for t in ticks if getattr(t, attr) is not None]
            return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else None

        ttft, itl, dur = mean("observed_ttft_mean_s"), mean("observed_itl_mean_s"), mean("mean_request_duration_s")
        osl = ended_osl_mean(ticks)
        last = ticks[-1]
        ans = self._ask({
            "num_p": last.prefill.num_ready + last.prefill.num_starting,
            "num_d": last.decode.num_ready + last.decode.num_starting,
            "num_req": float(n),
            "isl": sum(t.mean_isl_tokens * t.num_requests for t in ticks) / n if n else None,
            "osl": osl if n else None,
            "ttft_ms": None if ttft is None else ttft * 1000.0,
            "itl_ms": None if itl is None else itl * 1000.0,
            "request_duration_s": dur,
        })
        if ans["num_p"] is None or ans["num_d"] is None:
            return None
        return ScalingDecision(now_s=last.now_s, prefill_replicas=max(ans["num_p"], 1), decode_replicas=max(ans["num_d"], 1),
                               ttft_correction=ans["p_correction"], itl_correction=ans["d_correction"], reason="dynamo")

    def close(self) -> None:
        """End the driver: close its stdin (it exits), then terminate / kill if it does not."""
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:  # the driver already died: nothing to flush
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe:
                pipe.close()

    def __enter__(self) -> "DynamoPlannerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
