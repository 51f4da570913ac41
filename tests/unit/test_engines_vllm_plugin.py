"""The vLLM general plugin that makes NIXL's UCX progress thread sleep between polls on CPU workers.

Each check that patches NIXL runs in a fresh interpreter: the patch is process-wide by design.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from runtime.engines.vllm_plugin import PROGRESS_DELAY_ENV, progress_delay_us
from runtime.engines.vllm_worker import build_worker_env

pytest.importorskip("nixl._api")

# Creates an agent the way vLLM's NixlConnector does (num_threads=4, telemetry on) and reports the CPU the
# idle process then uses over one second (fraction of one core).
_IDLE_AGENT = """
import json, os, sys, time
os.environ.setdefault("UCX_TLS", "tcp,self")
from runtime.engines.vllm_plugin import register
for _ in range(int(sys.argv[1])):
    register()
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
time.sleep(0.3)
t0, w0 = time.process_time(), time.monotonic()
time.sleep(1.0)
print(json.dumps({"idle_cpu": (time.process_time() - t0) / (time.monotonic() - w0),
                  "rcache": os.environ.get("UCX_RCACHE_MAX_UNRELEASED")}))
"""

# The same through vLLM: its plugin loader, then its lazily imported NIXL wrapper and config.
_VLLM_AGENT = """
import json, time
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
agent = NixlWrapper("probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
time.sleep(0.3)
t0, w0 = time.process_time(), time.monotonic()
time.sleep(1.0)
print(json.dumps({"idle_cpu": (time.process_time() - t0) / (time.monotonic() - w0)}))
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
    quiet = _run(_IDLE_AGENT, "100", "2")  # registered twice: the wrapper must not stack
    assert default["idle_cpu"] > 0.5  # NIXL's own delay 0: one core busy-polling
    assert quiet["idle_cpu"] < 0.2
    assert quiet["rcache"] == "1024" and default["rcache"] is None  # vLLM's UCX leak workaround kept


def test_vllm_loads_the_plugin_before_its_nixl_connector_creates_agents():
    pytest.importorskip("vllm")
    assert _run(_VLLM_AGENT, "100")["idle_cpu"] < 0.2
    assert _run(_VLLM_AGENT, None)["idle_cpu"] > 0.5


def test_cpu_workers_get_the_delay_unless_the_environment_says_otherwise():
    assert build_worker_env({}, side_channel_port=1, cpu=True)[PROGRESS_DELAY_ENV] == "100"
    assert build_worker_env({PROGRESS_DELAY_ENV: "0"}, side_channel_port=1, cpu=True)[PROGRESS_DELAY_ENV] == "0"
    assert PROGRESS_DELAY_ENV not in build_worker_env({}, side_channel_port=1, cpu=False)
