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

On GPU nodes a busy progress thread is NIXL's intended low-latency mode and cores are plentiful: the runtime
sets the variable only for CPU workers (`vllm_worker.build_worker_env`, `deploy.workers`). A value already
in the environment wins. vLLM loads only the plugins named in `VLLM_PLUGINS` when that is set; the runtime adds
`pdserve_nixl` to it for CPU workers. On ROCm vLLM imports `nixl_rocm._api`, which this plugin does not patch.
"""

from __future__ import annotations

import logging
import os
import types

PROGRESS_DELAY_ENV = "PDSERVE_NIXL_PROGRESS_DELAY_US"
CPU_PROGRESS_DELAY_US = 100
PLUGIN_NAME = "pdserve_nixl"  # the entry point's name in pyproject.toml (what VLLM_PLUGINS lists)
ENTRY_POINT = "runtime.engines.vllm_plugin:register"

# a child of vLLM's "vllm" logger, so the line lands in the worker's log with vLLM's own format
logger = logging.getLogger("vllm.pdserve_nixl")


def progress_delay_us(env: dict[str, str] | None = None) -> int | None:
    """The progress-thread delay asked for by `PDSERVE_NIXL_PROGRESS_DELAY_US` (in `env`, default `os.environ`).

    Returns None when the variable is unset or empty (NIXL's own behaviour).

    Raises:
        ValueError: the value is not a whole number of microseconds in [0, 1_000_000].
    """
    raw = (os.environ if env is None else env).get(PROGRESS_DELAY_ENV, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{PROGRESS_DELAY_ENV}={raw!r}: expected whole microseconds, e.g. 100") from None
    if not 0 <= value <= 1_000_000:
        raise ValueError(f"{PROGRESS_DELAY_ENV}={value}: expected 0..1000000 microseconds")
    return value


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
    """vLLM plugin hook: NIXL agents created in this process use the configured progress-thread delay.

    Does nothing when `PDSERVE_NIXL_PROGRESS_DELAY_US` is unset or NIXL is not installed; idempotent (a second
    call only updates the delay). Sets `UCX_RCACHE_MAX_UNRELEASED=1024` first unless set, as vLLM's
    `nixl_utils` would have before its own first NIXL import (UCX registration-cache leak workaround).

    Raises:
        ValueError: the variable holds no valid delay (see `progress_delay_us`). vLLM's plugin loader does not
            catch it, so the vLLM process exits at start-up; `vllm_worker.build_worker_env` checks the value
            before any worker is spawned.
    """
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
