"""Drive NVIDIA Dynamo's real SLA planner (``ai-dynamo==1.0.2``: ``PrefillPlanner`` and
``DecodePlanner`` with ``dryrun=True``) offline, one adjustment interval per stdin line.

Runs inside its own virtualenv (``.venv-bench-planner``, set up as bench/planner_dynamo.py says),
started by bench/planner.py as a subprocess; it imports nothing from pdserve.

Protocol (JSON lines):

* first line, setup: ``{"interval_s", "ttft_ms", "itl_ms", "prefill_tp", "decode_tp", "gpu_budget",
  "load_predictor", "prefill": {"isl", "ttft_ms"}, "decode": {"max_kv_tokens", "x_kv_usage",
  "y_context_length", "z_itl_ms", "z_thpt_per_gpu"}}``: the profile in Dynamo's profiler format
  (``prefill_raw_data.json`` / ``decode_raw_data.json``, read by its ``PrefillInterpolator`` /
  ``DecodeInterpolator``); answers ``{"ready": true}``;
* then one line per adjustment interval, the metrics Dynamo's ``observe_traffic_stats`` reads from
  Prometheus: ``{"num_p", "num_d", "num_req", "isl", "osl", "ttft_ms", "itl_ms",
  "request_duration_s"}`` (means over the interval; ``ttft_ms`` etc. may be null with no traffic);
  answers ``{"num_p", "num_d", "p_correction", "d_correction"}`` (replicas null: keep the fleet).

The per-interval sequence is Dynamo's own ``DisaggPlanner._throughput_loop`` (throughput-only):
update the predictors from the observed metrics, ``plan_adjustment()`` on both planners
(correction factors, load prediction, replica formula), then ``_apply_global_gpu_budget``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    # no options: --help prints the protocol above, in any interpreter (Dynamo is imported after it)
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                            ).parse_args(argv)
    logging.disable(logging.CRITICAL)  # Dynamo logs every step at INFO; stdout carries the protocol
    try:
        from dynamo.planner.utils.decode_planner import DecodePlanner
        from dynamo.planner.utils.planner_config import PlannerConfig
        from dynamo.planner.utils.planner_core import PlannerSharedState, _apply_global_gpu_budget
        from dynamo.planner.utils.prefill_planner import PrefillPlanner
        from dynamo.planner.utils.prometheus import Metrics
    except ImportError as exc:
        raise SystemExit(f"{exc}: this driver runs in the venv with ai-dynamo==1.0.2 that bench/planner_dynamo.py "
                         "describes (bench/planner.py starts it)") from exc

    setup = json.loads(sys.stdin.readline())
    with tempfile.TemporaryDirectory(prefix="dynamo-profile-") as tmp:
        pre, dec = setup["prefill"], setup["decode"]
        tp_p = int(setup["prefill_tp"])
        (Path(tmp) / "prefill_raw_data.json").write_text(json.dumps({
            "prefill_isl": pre["isl"],
            "prefill_ttft": pre["ttft_ms"],
            "prefill_thpt_per_gpu": [i / (t / 1000.0) / tp_p for i, t in zip(pre["isl"], pre["ttft_ms"])],
        }))
        (Path(tmp) / "decode_raw_data.json").write_text(json.dumps({
            "x_kv_usage": dec["x_kv_usage"], "y_context_length": dec["y_context_length"],
            "z_itl": dec["z_itl_ms"], "z_thpt_per_gpu": dec["z_thpt_per_gpu"],
            "max_kv_tokens": int(dec["max_kv_tokens"]),
        }))
        config = PlannerConfig(
            mode="disagg", no_operation=True, throughput_adjustment_interval=int(setup["interval_s"]),
            max_gpu_budget=int(setup["gpu_budget"]), min_endpoint=1, prefill_engine_num_gpu=tp_p,
            decode_engine_num_gpu=int(setup["decode_tp"]), profile_results_dir=tmp, ttft=float(setup["ttft_ms"]),
            itl=float(setup["itl_ms"]), load_predictor=setup.get("load_predictor", "arima"),
            metric_reporting_prometheus_port=0,
        )
        shared = PlannerSharedState()
        prefill = PrefillPlanner(None, config, dryrun=True, shared_state=shared)
        decode = DecodePlanner(None, config, dryrun=True, shared_state=shared)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            m = json.loads(line)
            shared.num_p_workers, shared.num_d_workers = int(m["num_p"]), int(m["num_d"])
            nan = float("nan")  # what Dynamo's Prometheus queries return for an interval without traffic

            def val(key: str) -> float:
                return nan if m[key] is None else float(m[key])

            shared.last_metrics = Metrics(ttft=val("ttft_ms"), itl=val("itl_ms"), num_req=val("num_req"),
                                          isl=val("isl"), osl=val("osl"), request_duration=val("request_duration_s"))
            prefill.update_predictors_from_metrics(shared.last_metrics)
            decode.update_predictors_from_metrics(shared.last_metrics)
            num_p, num_d = prefill.plan_adjustment(), decode.plan_adjustment()
            if num_p is not None and num_d is not None:
                num_p, num_d = _apply_global_gpu_budget(num_p, num_d, config)
            print(json.dumps({"num_p": None if num_p is None else int(num_p),
                              "num_d": None if num_d is None else int(num_d),
                              "p_correction": float(prefill.p_correction_factor),
                              "d_correction": float(decode.d_correction_factor)}), flush=True)


if __name__ == "__main__":
    main()
