"""pdserve's vLLM general plugin: turns NIXL's UCX progress thread off where the worker's environment asks.

vLLM loads every entry point of the `vllm.general_plugins` group in each process it starts (API server,
engine core, workers; `vllm.plugins.load_general_plugins`). pyproject.toml registers `register` below.

Why: vLLM's NixlConnector creates its agent with `nixl_agent_config(num_threads=..., capture_telemetry=True)`,
so NIXL's defaults apply, and NIXL 1.5.1's default is a UCX progress thread that polls with no delay
(`agent_config.pthrDelay = 0` in `nixl._api`): one core busy per worker process, idle or not. Measured on
this 2-core machine: an idle agent with the thread uses 100 % of a core, without it 0 %. With a prefill and a
decode worker that is both cores, and the engines, API servers and router starve: TTFT of 8 sequential chat
requests through `pdserve serve` (SmolLM2-135M, CPU) was 13-38 s with the thread (NIXL reads of 1 KV block
took 15-37 s, finishing when the prefill worker's 30-s KV lease expired and its engine stopped stepping) and
0.3-1.5 s without it (direct prefill + decode calls: 0.13-0.3 s). vLLM has no setting for the thread
(kv_connector_extra_config passes only `backends` and `num_threads`), hence this plugin.

Without the thread, UCX makes progress whenever the worker calls into NIXL: the decode worker polls its
reads (`check_xfer_state`) and the prefill worker its notifications (`get_new_notifs`) on every engine step,
and the engines keep stepping while a transfer is pending (remote-KV waits, delayed frees), so the one-sided
reads over `UCX_TLS=tcp,self` complete.

On GPU nodes the thread is NIXL's intended low-latency mode and cores are plentiful: the runtime sets the
variable only for CPU workers (`vllm_worker.build_worker_env`). The environment variable wins over that
default, both ways.
"""

from __future__ import annotations

import functools
import os

PROGRESS_THREAD_ENV = "PDSERVE_NIXL_PROGRESS_THREAD"
_OFF = ("0", "false", "off", "no")
_PATCHED_FLAG = "_pdserve_progress_thread_default"


def progress_thread_disabled(env: dict[str, str] | None = None) -> bool:
    """True when `PDSERVE_NIXL_PROGRESS_THREAD` (in `env`, default `os.environ`) is 0/false/off/no."""
    value = (os.environ if env is None else env).get(PROGRESS_THREAD_ENV, "")
    return value.strip().lower() in _OFF


def register() -> None:
    """vLLM plugin hook: when the environment disables it, NIXL agent configs default to no progress thread.

    Patches `nixl._api.nixl_agent_config.__init__` in this process so that `enable_prog_thread` defaults to
    False (a caller that passes it explicitly still decides). Idempotent; does nothing when the variable is
    unset or true, or when NIXL is not installed.
    """
    if not progress_thread_disabled():
        return
    try:
        from nixl import _api
    except ImportError:
        return
    cls = _api.nixl_agent_config
    if getattr(cls, _PATCHED_FLAG, False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):  # noqa: N807 - replaces the class's own __init__
        if not args:  # enable_prog_thread is the first positional parameter
            kwargs.setdefault("enable_prog_thread", False)
        original(self, *args, **kwargs)

    cls.__init__ = __init__
    setattr(cls, _PATCHED_FLAG, True)
