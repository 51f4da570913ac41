"""The vLLM general plugin that makes NIXL's UCX progress thread sleep between polls on CPU workers.

Each check that patches NIXL runs in a fresh interpreter: the patch is process-wide by design.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from importlib.metadata import entry_points

import pytest

from runtime.engines import vllm_plugin
from runtime.engines.vllm_plugin import PLUGIN_NAME, PROGRESS_DELAY_ENV, progress_delay_us, register
from runtime.engines.vllm_worker import build_worker_env

pytest.importorskip("nixl._api")

# Measures the idle process over two seconds, in fractions of one core: `idle_cpu`, the CPU it used, and
# `idle_demand`, the time its threads were running or waiting for a CPU. A busy-polling process on a loaded
# machine gets only its share of a core, but it is runnable all the time: its demand stays near 1.
_MEASURE = """
import glob, time

def _sched():
    ns = {}
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                run_ns, wait_ns = f.read().split()[:2]
        except OSError:  # a thread that ended meanwhile
            continue
        ns[path] = int(run_ns) + int(wait_ns)
    return ns

def idle(seconds):
    time.sleep(0.3)
    t0, w0, s0 = time.process_time(), time.monotonic(), _sched()
    time.sleep(seconds)
    wall, s1 = time.monotonic() - w0, _sched()
    return {"idle_cpu": (time.process_time() - t0) / wall,
            "idle_demand": sum(v - s0.get(k, 0) for k, v in s1.items()) / 1e9 / wall}
"""

# Creates an agent the way vLLM's NixlConnector does (num_threads=4, telemetry on) and measures the idle
# process (_MEASURE).
_IDLE_AGENT = _MEASURE + """
import json, os, sys
os.environ.setdefault("UCX_TLS", "tcp,self")
from runtime.engines.vllm_plugin import register
for _ in range(int(sys.argv[1])):
    register()
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
print(json.dumps({**idle(2.0), "rcache": os.environ.get("UCX_RCACHE_MAX_UNRELEASED")}))
"""

# The same through vLLM: its plugin loader, then its lazily imported NIXL wrapper and config.
_VLLM_AGENT = _MEASURE + """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
agent = NixlWrapper("probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
print(json.dumps(idle(2.0)))
"""


def _run(code: str, delay: str | None, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (PROGRESS_DELAY_ENV, "UCX_RCACHE_MAX_UNRELEASED")}
    env.setdefault("UCX_TLS", "tcp,self")
    if delay is not None:
        env[PROGRESS_DELAY_ENV] = delay
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                         timeout=180, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("value,delay", [("100", 100), (" 0 ", 0), ("1000000", 1_000_000), ("", None)])
def test_delay_variable_parses_whole_microseconds(value, delay):
    assert progress_delay_us({PROGRESS_DELAY_ENV: value}) == delay
    assert progress_delay_us({}) is None


@pytest.mark.parametrize("bad", ["1e3", "ten", "-1", "1000001", "0.5"])
def test_bad_delay_is_an_error_naming_the_variable(bad):
    with pytest.raises(ValueError, match=PROGRESS_DELAY_ENV):
        progress_delay_us({PROGRESS_DELAY_ENV: bad})


def test_plugin_is_registered_for_vllm():
    plugins = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "runtime.engines.vllm_plugin:register" in plugins


def test_progress_delay_leaves_an_idle_agent_idle():
    default = _run(_IDLE_AGENT, None, "1")
    quiet = _run(_IDLE_AGENT, "100", "1")
    # NIXL's own delay 0: a thread busy-polling, runnable all the time (using 1.0 of a core on a quiet host)
    assert default["idle_demand"] > 0.3
    assert quiet["idle_cpu"] < 0.2  # 0.02 measured
    assert quiet["rcache"] == "1024" and default["rcache"] is None  # vLLM's UCX leak workaround kept


def test_agents_made_through_vllms_plugin_loader_and_nixl_wrapper_get_the_delay():
    # vLLM itself calls load_general_plugins() before the connector's agent exists (v1/engine/core.py,
    # v1/worker/worker_base.py init_worker); the e2e idle-worker test covers that ordering on real workers.
    pytest.importorskip("vllm")
    assert _run(_VLLM_AGENT, "100")["idle_cpu"] < 0.2
    assert _run(_VLLM_AGENT, None)["idle_demand"] > 0.3


def _fake_nixl(monkeypatch) -> tuple[types.ModuleType, list]:
    """nixl._api replaced by a stand-in whose bindings record each agent's pthrDelay."""
    import nixl

    calls: list = []
    real = types.ModuleType("fake._bindings")
    real.nixlAgent = lambda name, cfg: calls.append((name, cfg.pthrDelay)) or "agent"
    real.NIXL_SUCCESS = 7
    api = types.ModuleType("fake._api")
    api.nixlBind = real
    monkeypatch.setattr(nixl, "_api", api)
    monkeypatch.setenv("UCX_RCACHE_MAX_UNRELEASED", "1024")  # restored afterwards
    return api, calls


def test_second_registration_updates_the_delay_without_stacking_wrappers(monkeypatch):
    api, calls = _fake_nixl(monkeypatch)
    real = api.nixlBind
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "100")
    register()
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "250")
    register()
    assert api.nixlBind._real is real and api.nixlBind.NIXL_SUCCESS == 7  # other names forwarded
    assert api.nixlBind.nixlAgent("a", types.SimpleNamespace(pthrDelay=0)) == "agent"
    assert calls == [("a", 250)]


def test_without_the_variable_nixl_is_not_even_imported(monkeypatch):
    monkeypatch.delenv(PROGRESS_DELAY_ENV, raising=False)
    tripwire = types.ModuleType("nixl")

    def touched(name):
        raise AssertionError(f"register() reached nixl.{name} without {PROGRESS_DELAY_ENV}")

    tripwire.__getattr__ = touched  # `from nixl import _api` would call it
    monkeypatch.setitem(sys.modules, "nixl", tripwire)
    register()


def test_invalid_variable_fails_registration(monkeypatch):
    _fake_nixl(monkeypatch)
    monkeypatch.setenv(PROGRESS_DELAY_ENV, "fast")
    with pytest.raises(ValueError, match=PROGRESS_DELAY_ENV):
        register()
    import nixl

    assert not isinstance(nixl._api.nixlBind, vllm_plugin._BindingsWithProgressDelay)  # nothing patched


def test_cpu_workers_get_the_delay_unless_the_environment_says_otherwise():
    assert build_worker_env({}, side_channel_port=1, cpu=True)[PROGRESS_DELAY_ENV] == "100"
    assert build_worker_env({PROGRESS_DELAY_ENV: "0"}, side_channel_port=1, cpu=True)[PROGRESS_DELAY_ENV] == "0"
    assert PROGRESS_DELAY_ENV not in build_worker_env({}, side_channel_port=1, cpu=False)
    assert "VLLM_PLUGINS" not in build_worker_env({}, side_channel_port=1, cpu=True)  # unset: vLLM loads all


@pytest.mark.parametrize("allowed,expected", [("", PLUGIN_NAME), ("lora_filesystem_resolver",
                                              f"lora_filesystem_resolver,{PLUGIN_NAME}"),
                                              (PLUGIN_NAME, PLUGIN_NAME)])
def test_a_vllm_plugins_allow_list_keeps_the_plugin_on_cpu_workers(allowed, expected):
    env = build_worker_env({"VLLM_PLUGINS": allowed}, side_channel_port=1, cpu=True)
    assert env["VLLM_PLUGINS"] == expected


def test_bad_delay_in_the_environment_fails_before_any_worker_starts():
    with pytest.raises(ValueError, match=PROGRESS_DELAY_ENV):
        build_worker_env({PROGRESS_DELAY_ENV: "100us"}, side_channel_port=1, cpu=True)


@pytest.mark.parametrize("installed", [True, False])
def test_starting_a_cpu_worker_without_the_installed_plugin_warns(tmp_path, monkeypatch, caplog, installed):
    import logging

    from runtime.config import EngineSpec
    from runtime.engines import vllm_worker

    assert vllm_plugin.plugin_installed()  # this checkout is installed (the entry-point test above)
    monkeypatch.setattr(vllm_worker, "plugin_installed", lambda: installed)
    w = vllm_worker.WorkerProcess(EngineSpec(), tmp_path, served_model_name="m", role="decode",
                                  log_path=tmp_path / "w.log")
    w.args = [sys.executable, "-c", "pass"]  # stand-in for the vLLM server: only the start-up check matters
    with caplog.at_level(logging.WARNING, logger=vllm_worker.__name__):
        w.start()
    w.stop()
    warned = [r for r in caplog.records if "plugin is not installed" in r.getMessage()]
    assert bool(warned) is (not installed)


def test_cpu_workers_get_the_engine_idle_poll_unless_the_environment_says_otherwise():
    from runtime.engines.vllm_plugin import IDLE_POLL_ENV

    assert build_worker_env({}, side_channel_port=1, cpu=True)[IDLE_POLL_ENV] == "10000"
    assert build_worker_env({IDLE_POLL_ENV: "2000"}, side_channel_port=1, cpu=True)[IDLE_POLL_ENV] == "2000"
    assert IDLE_POLL_ENV not in build_worker_env({}, side_channel_port=1, cpu=False)
    with pytest.raises(ValueError, match=IDLE_POLL_ENV):
        build_worker_env({IDLE_POLL_ENV: "soon"}, side_channel_port=1, cpu=True)


class _Engine:
    """An engine whose steps run the model or not, as told; records when each step began."""

    def __init__(self, executed: list[bool], has_requests: bool = True) -> None:
        self.executed, self.began = list(executed), []
        self.scheduler = types.SimpleNamespace(has_requests=lambda: has_requests)

    def _process_engine_step(self) -> bool:
        import time

        self.began.append(time.monotonic())
        return self.executed.pop(0)


def test_empty_steps_are_spaced_by_the_idle_poll_and_model_steps_are_not():
    step = vllm_plugin.idle_poll_step(_Engine._process_engine_step, 20_000)
    busy = _Engine([True] * 5)
    for _ in range(5):
        assert step(busy) is True
    assert busy.began[-1] - busy.began[0] < 0.05  # model steps follow each other at once
    idle = _Engine([False] * 5)
    for _ in range(5):
        assert step(idle) is False
    gaps = [b - a for a, b in zip(idle.began, idle.began[1:])]
    assert min(gaps) >= 0.019  # at most one empty step per 20 ms
    done = _Engine([False] * 3, has_requests=False)  # nothing left: the engine goes to wait for input at once
    for _ in range(3):
        step(done)
    assert done.began[-1] - done.began[0] < 0.019


def test_the_idle_poll_patches_vllms_engine_once(monkeypatch):
    core = types.ModuleType("vllm.v1.engine.core")
    core.EngineCoreProc = type("EngineCoreProc", (), {"_process_engine_step": _Engine._process_engine_step})
    monkeypatch.setitem(sys.modules, "vllm.v1.engine.core", core)
    monkeypatch.delenv(PROGRESS_DELAY_ENV, raising=False)
    monkeypatch.setenv(vllm_plugin.IDLE_POLL_ENV, "5000")
    register()
    register()  # a second registration replaces the wrapper, it does not stack another
    patched = core.EngineCoreProc._process_engine_step
    assert patched.pdserve_original is _Engine._process_engine_step
    engine = _Engine([False, False])
    patched(engine)
    patched(engine)
    assert engine.began[1] - engine.began[0] >= 0.0049


def test_shared_memory_readers_spin_at_most_the_cap_and_cpu_workers_do_not_spin():
    from runtime.engines.vllm_plugin import SHM_SPIN_ENV, capped_spin_wait

    assert build_worker_env({}, side_channel_port=1, cpu=True)[SHM_SPIN_ENV] == "0"
    assert SHM_SPIN_ENV not in build_worker_env({}, side_channel_port=1, cpu=False)

    class Cond:
        def __init__(self, busy_loop_s: float) -> None:
            self.busy_loop_s, self.calls = busy_loop_s, []

        def wait(self, timeout_ms=None):
            self.calls.append((self.busy_loop_s, timeout_ms))

    wait = capped_spin_wait(Cond.wait, 500)
    spinning, quiet = Cond(1.0), Cond(0.0001)
    wait(spinning, timeout_ms=7)
    wait(quiet)
    wait(quiet, timeout_ms=5000)  # vLLM's recheck: a missed notification would cost all of it
    # spin capped (never raised); every sleep bounded by the recheck, a shorter deadline kept
    assert spinning.calls == [(0.0005, 7)]
    assert quiet.calls == [(0.0001, vllm_plugin.SHM_RECHECK_MS)] * 2 and vllm_plugin.SHM_RECHECK_MS < 50


def test_the_spin_cap_patches_vllms_spin_condition_once(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.distributed.device_communicators import shm_broadcast

    original = shm_broadcast.SpinCondition.wait
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", original)
    monkeypatch.delenv(PROGRESS_DELAY_ENV, raising=False)
    monkeypatch.setenv(vllm_plugin.SHM_SPIN_ENV, "0")
    register()
    register()
    assert shm_broadcast.SpinCondition.wait.pdserve_original is getattr(original, "pdserve_original", original)
