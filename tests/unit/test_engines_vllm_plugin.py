"""The vLLM general plugin that turns NIXL's busy-polling UCX progress thread off on CPU workers.

Each check that patches NIXL runs in a fresh interpreter: the patch is process-wide by design.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from runtime.engines.vllm_plugin import PROGRESS_THREAD_ENV, progress_thread_disabled
from runtime.engines.vllm_worker import build_worker_env

pytest.importorskip("nixl._api")

# Creates an agent the way vLLM's NixlConnector does (num_threads=4, telemetry on, no enable_prog_thread) and
# reports its config and the CPU the idle process uses over one second (fraction of one core).
_IDLE_AGENT = """
import json, os, sys, time
os.environ.setdefault("UCX_TLS", "tcp,self")
from runtime.engines.vllm_plugin import register
for _ in range(int(sys.argv[1])):
    register()
from nixl._api import nixl_agent, nixl_agent_config
cfg = nixl_agent_config(num_threads=4, capture_telemetry=True)
explicit = nixl_agent_config(True).enable_pthread, nixl_agent_config(enable_prog_thread=True).enable_pthread
agent = nixl_agent("probe", cfg)
time.sleep(0.3)
t0, w0 = time.process_time(), time.monotonic()
time.sleep(1.0)
print(json.dumps({"enable_pthread": cfg.enable_pthread, "explicit": explicit,
                  "idle_cpu": (time.process_time() - t0) / (time.monotonic() - w0)}))
"""


def _run(code: str, env_value: str | None, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != PROGRESS_THREAD_ENV}
    if env_value is not None:
        env[PROGRESS_THREAD_ENV] = env_value
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("value,off", [("0", True), ("false", True), (" OFF ", True), ("no", True),
                                       ("1", False), ("true", False), ("", False)])
def test_progress_thread_switch_parses_the_variable(value, off):
    assert progress_thread_disabled({PROGRESS_THREAD_ENV: value}) is off
    assert progress_thread_disabled({}) is False


def test_plugin_is_registered_for_vllm():
    plugins = {ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert "runtime.engines.vllm_plugin:register" in plugins


def test_disabled_progress_thread_leaves_an_idle_agent_idle():
    on = _run(_IDLE_AGENT, None, "1")
    off = _run(_IDLE_AGENT, "0", "2")  # registered twice: the patch must not stack
    assert on["enable_pthread"] is True and on["idle_cpu"] > 0.5  # NIXL's default: one core busy-polling
    assert off["enable_pthread"] is False and off["idle_cpu"] < 0.2
    assert off["explicit"] == [True, True]  # a caller that asks for the thread still gets it


def test_vllm_loads_the_plugin_before_the_nixl_connector_reads_its_config():
    pytest.importorskip("vllm")
    code = """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.nixl_utils import nixl_agent_config
print(json.dumps({"enable_pthread": nixl_agent_config(num_threads=4, capture_telemetry=True).enable_pthread}))
"""
    assert _run(code, "0")["enable_pthread"] is False
    assert _run(code, None)["enable_pthread"] is True


def test_cpu_workers_turn_the_progress_thread_off_unless_the_environment_says_otherwise():
    assert build_worker_env({}, side_channel_port=1, cpu=True)[PROGRESS_THREAD_ENV] == "0"
    assert build_worker_env({PROGRESS_THREAD_ENV: "1"}, side_channel_port=1, cpu=True)[PROGRESS_THREAD_ENV] == "1"
    assert PROGRESS_THREAD_ENV not in build_worker_env({}, side_channel_port=1, cpu=False)
