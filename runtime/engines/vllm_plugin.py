"""pdserve's vLLM general plugin: gives NIXL's UCX progress thread a sleep between polls where the worker asks.

vLLM loads every entry point of the `vllm.general_plugins` group in each process it starts (API server,
engine core, workers; `vllm.plugins.load_general_plugins`). pyproject.toml registers `register` below.

Why: NIXL 1.5.1's Python agent starts a progress thread and hard-codes its delay between polls to zero
(`agent_config.pthrDelay = 0` in `nixl._api.nixl_agent.__init__`), so every agent keeps one core busy, idle or
not. Measured on this 2-core machine: an idle agent uses 100 % of a core at delay 0, 2 % at 100 us. With a
prefill and a decode worker that is both cores, and the engines, API servers and router starve: TTFT of 8
sequential chat requests through `pdserve serve` (SmolLM2-135M, CPU) was 13-38 s (NIXL reads of one KV block
took 15-37 s and ended when the prefill worker's 30-s KV lease expired and its engine stopped stepping), and
0.2-1.2 s with the thread pausing 100 us between polls. vLLM has no setting for it (kv_connector_extra_config
passes only `backends` and `num_threads`), hence this plugin.

The thread stays on (turning it off made UCX progress depend on both engines calling NIXL, and the first
transfer after start-up could then hang for minutes); it only sleeps `PDSERVE_NIXL_PROGRESS_DELAY_US`
microseconds between polls, which bounds the latency it adds per progress event to that much.

The same plugin quiets vLLM's engine loop where the worker asks. A vLLM engine that holds KV blocks for a
remote decode worker (a prefill worker after a remote prefill, until the decode worker's read or the KV lease
ends) or waits for a KV read loops over empty engine steps, each a message to its model-worker process with a
1-ms sleep between them (vllm/v1/engine/core.py `EngineCoreProc._process_engine_step`, 0.28), and the
model-worker process spins (`sched_yield`) on its shared-memory queue for 1 s after every message
(vllm/distributed/device_communicators/shm_broadcast.py `SpinCondition`, `busy_loop_s`). Measured here
(SmolLM2-135M, one prefill worker): 0.03 cores idle, 1.4 cores while it held one unread handoff, 0.96 of them
the model-worker's spin. On 2 cores shared with the decode worker that starved it: the decode worker's engine
spent 20-30 s in one forward pass, could neither admit nor read a new request, and read its KV blocks only
after the prefill worker's 30-s lease had released them (the prefill log: "Potentially invalid KV blocks"); a
longer lease made the stalls longer, as the spin lasted as long as the lease. `PDSERVE_SHM_SPIN_US` caps that
spin (CPU workers: 0, the worker sleeps until the next message is announced, tens of microseconds later) and
`PDSERVE_ENGINE_IDLE_POLL_US` spaces empty engine steps (CPU workers: 10 ms; a KV read's completion is then
seen at most 10 ms later, a CPU decode step takes tens of ms).

On GPU nodes a busy progress thread is NIXL's intended low-latency mode and cores are plentiful: the runtime
sets the variable only for CPU workers (`vllm_worker.build_worker_env`, `deploy.workers`). A value already
in the environment wins. vLLM loads only the plugins named in `VLLM_PLUGINS` when that is set; the runtime adds
`pdserve_nixl` to it for CPU workers. On ROCm vLLM imports `nixl_rocm._api`, which this plugin does not patch.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
import types

PROGRESS_DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"
CPU_PROGRESS_DELAY_US = 100
SHM_SPIN_ENV = "PDSERVE_SHM_SPIN_US"
#: How long a CPU worker's engine processes spin on their shared-memory queue after a message before they sleep
#: until the next one is announced, microseconds (vLLM: 1 s; see the module docstring).
CPU_SHM_SPIN_US = 0
#: Longest sleep of a reader whose spin is capped before it looks at its queue again, milliseconds. vLLM's
#: readers can miss a write's notification (a PUB socket with a send high-water mark of 1) and then sleep for
#: vLLM's 5-s recheck (`SHM_READER_RECHECK_INTERVAL_MS`); vLLM's own 1-s spin hides that. Measured here with the
#: spin capped at 0 and no recheck bound: 24 of 120 sequential chats waited 5 or 10 s for their first token,
#: P/D and aggregated alike (bench/pd_tail.py). 10 ms is one empty-step spacing of a CPU worker
#: (`CPU_ENGINE_IDLE_POLL_US`): a missed notification then costs at most that, for ~100 cheap polls per second.
SHM_RECHECK_MS = 10
IDLE_POLL_ENV = "PDSERVE_ENGINE_IDLE_POLL_US"
#: Least time between two empty engine steps of a CPU worker, microseconds (see the module docstring).
CPU_ENGINE_IDLE_POLL_US = 10_000
PLUGIN_NAME = "pdserve_nixl"  # the entry point's name in pyproject.toml (what VLLM_PLUGINS lists)
ENTRY_POINT = "runtime.engines.vllm_plugin:register"

# a child of vLLM's "vllm" logger, so the line lands in the worker's log with vLLM's own format
logger = logging.getLogger("vllm.pdserve_nixl")


def _microseconds(name: str, example: int, env: dict[str, str] | None) -> int | None:
    """Whole microseconds in [0, 1_000_000] from variable `name` (in `env`, default `os.environ`); None when
    unset or empty.

    Raises:
        ValueError: any other value.
    """
    raw = (os.environ if env is None else env).get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected whole microseconds, e.g. {example}") from None
    if not 0 <= value <= 1_000_000:
        raise ValueError(f"{name}={value}: expected 0..1000000 microseconds")
    return value


def progress_delay_us(env: dict[str, str] | None = None) -> int | None:
    """The progress-thread delay asked for by `PDSERVE_NIXL_PROGRESS_DELAY_US` (in `env`, default `os.environ`).

    Returns None when the variable is unset or empty (NIXL's own behaviour).

    Raises:
        ValueError: the value is not a whole number of microseconds in [0, 1_000_000].
    """
    return _microseconds(PROGRESS_DELAY_ENV, CPU_PROGRESS_DELAY_US, env)


def engine_idle_poll_us(env: dict[str, str] | None = None) -> int | None:
    """The least time between two empty engine steps asked for by `PDSERVE_ENGINE_IDLE_POLL_US` (in `env`,
    default `os.environ`); None when unset or empty (vLLM's own 1-ms sleep).

    Raises:
        ValueError: the value is not a whole number of microseconds in [0, 1_000_000].
    """
    return _microseconds(IDLE_POLL_ENV, CPU_ENGINE_IDLE_POLL_US, env)


def shm_spin_us(env: dict[str, str] | None = None) -> int | None:
    """The longest spin of a shared-memory queue reader asked for by `PDSERVE_SHM_SPIN_US` (in `env`, default
    `os.environ`); None when unset or empty (vLLM's 1 s).

    Raises:
        ValueError: the value is not a whole number of microseconds in [0, 1_000_000].
    """
    return _microseconds(SHM_SPIN_ENV, CPU_SHM_SPIN_US, env)


def capped_spin_wait(wait, spin_us: int):
    """`SpinCondition.wait` whose reader spins at most `spin_us` microseconds after its last message before it
    sleeps until the next one is announced (its `busy_loop_s`, vLLM's 1 s, capped), and sleeps at most
    `SHM_RECHECK_MS` before it looks at the queue again (the caller, vLLM's `acquire_read`, loops until a
    message is there or its own deadline passes)."""
    spin_s = spin_us / 1e6

    @functools.wraps(wait)
    def _wait(self, timeout_ms: int | None = None):
        if getattr(self, "busy_loop_s", 0) > spin_s:
            self.busy_loop_s = spin_s
        return wait(self, timeout_ms=SHM_RECHECK_MS if timeout_ms is None else min(timeout_ms, SHM_RECHECK_MS))

    _wait.pdserve_original = wait
    return _wait


def _rewrap(owner: object, name: str, wrap) -> bool:
    """Replace method `name` of class `owner` by `wrap(original)`, `original` being the method as vLLM defined
    it (a second call replaces the wrapper, it does not stack another). False when there is no such method."""
    current = getattr(owner, name, None)
    if current is None:
        return False
    setattr(owner, name, wrap(getattr(current, "pdserve_original", current)))
    return True


def _cap_shm_spin(spin_us: int) -> bool:
    """Patch vLLM's shared-memory queue readers in this process (every vLLM process imports the module before
    its queues exist). Idempotent; returns True when patched."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    return _rewrap(getattr(shm_broadcast, "SpinCondition", None), "wait", lambda w: capped_spin_wait(w, spin_us))


def idle_poll_step(step, poll_us: int):
    """`EngineCoreProc._process_engine_step` that, after a step that ran no model (the engine only polls for
    KV transfers: `step` returned False) while the scheduler still has requests, sleeps until `poll_us`
    microseconds have passed since the step began. Steps that ran the model are not delayed."""
    poll_s = poll_us / 1e6

    @functools.wraps(step)
    def _process_engine_step(self) -> bool:
        t0 = time.monotonic()
        executed = step(self)
        if not executed and self.scheduler.has_requests():
            left = poll_s - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)
        return executed

    _process_engine_step.pdserve_original = step
    return _process_engine_step


def _slow_idle_poll(poll_us: int) -> bool:
    """Patch vLLM's engine loop in this process (only where `vllm.v1.engine.core` is already imported: the
    engine-core process, which loads plugins in its constructor). Idempotent; returns True when patched."""
    core = sys.modules.get("vllm.v1.engine.core")
    return _rewrap(getattr(core, "EngineCoreProc", None), "_process_engine_step",
                   lambda step: idle_poll_step(step, poll_us))


def plugin_installed() -> bool:
    """True when this Python environment registers the plugin for vLLM, i.e. pdserve is installed
    (`pip install -e .`, the images); from a bare source checkout on PYTHONPATH vLLM never sees it."""
    from importlib.metadata import entry_points

    return any(ep.value == ENTRY_POINT for ep in entry_points(group="vllm.general_plugins"))


class _BindingsWithProgressDelay(types.ModuleType):
    """`nixl._bindings` as `nixl._api` sees it, except that agents get `pthrDelay = delay_us`."""

    def __init__(self, real: types.ModuleType, delay_us: int) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real, self.delay_us = real, delay_us

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 - the binding's own name
        config.pthrDelay = self.delay_us
        return self._real.nixlAgent(name, config)


def register() -> None:
    """vLLM plugin hook: NIXL agents created in this process use the configured progress-thread delay, and the
    engine loop of this process (if it runs one) the configured idle poll.

    Each does nothing when its variable (`PDSERVE_NIXL_PROGRESS_DELAY_US`, `PDSERVE_ENGINE_IDLE_POLL_US`,
    `PDSERVE_SHM_SPIN_US`) is unset
    (or NIXL / vLLM's engine core is not loaded); idempotent (a second call only updates the values). Sets `UCX_RCACHE_MAX_UNRELEASED=1024` first unless set, as vLLM's
    `nixl_utils` would have before its own first NIXL import (UCX registration-cache leak workaround).

    Raises:
        ValueError: a variable holds no valid value (see `progress_delay_us`, `engine_idle_poll_us`,
            `shm_spin_us`). vLLM's plugin loader does not
            catch it, so the vLLM process exits at start-up; `vllm_worker.build_worker_env` checks the value
            before any worker is spawned.
    """
    spin = shm_spin_us()
    if spin is not None and _cap_shm_spin(spin):
        logger.debug("shared-memory queue spin: at most %d us (%s)", spin, SHM_SPIN_ENV)
    poll = engine_idle_poll_us()
    if poll is not None and _slow_idle_poll(poll):
        logger.info("engine idle poll: at least %d us between empty steps (%s)", poll, IDLE_POLL_ENV)
    delay = progress_delay_us()
    if delay is None:
        return
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    try:
        from nixl import _api
    except ImportError:
        return
    if isinstance(_api.nixlBind, _BindingsWithProgressDelay):
        _api.nixlBind.delay_us = delay
    else:
        _api.nixlBind = _BindingsWithProgressDelay(_api.nixlBind, delay)
    logger.info("NIXL progress thread: %d us between polls (%s)", delay, PROGRESS_DELAY_ENV)
