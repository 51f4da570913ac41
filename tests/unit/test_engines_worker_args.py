"""vLLM worker command line and environment (runtime.engines.vllm_worker), per
docs/architecture.md#pd-disaggregation-with-nixl."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from runtime.config import EngineSpec
from runtime.engines.vllm_worker import (
    KV_EVENTS_TOPIC,
    WorkerProcess,
    build_vllm_args,
    build_worker_env,
    free_port,
    kv_transfer_config,
)


def _flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def _args(role="prefill", **kw):
    engine = kw.pop("engine", EngineSpec(block_size_tokens=32, max_model_len_tokens=1024, kv_backends=["UCX"]))
    return build_vllm_args(engine, model_dir=Path("/m"), served_model_name="tiny", role=role, host="127.0.0.1",
                           port=8123, python="/py", **kw)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_roles_use_nixl_connector_with_cpu_buffer(role):
    args = _args(role)
    assert args[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    cfg = json.loads(_flag(args, "--kv-transfer-config"))
    assert cfg["kv_connector"] == "NixlConnector"
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_buffer_device"] == "cpu"
    assert cfg["kv_connector_extra_config"]["backends"] == ["UCX"]


def test_kv_lease_is_vllms_unless_configured():
    cpu = json.loads(_flag(_args("prefill"), "--kv-transfer-config"))
    assert "kv_lease_duration" not in cpu["kv_connector_extra_config"]
    assert "kv_lease_duration" not in kv_transfer_config(EngineSpec(), cpu=False)["kv_connector_extra_config"]
    for cpu_flag in (True, False):
        cfg = kv_transfer_config(EngineSpec(kv_lease_s=45), cpu=cpu_flag, backends=["LIBFABRIC"])
        assert cfg["kv_connector_extra_config"] == {"backends": ["LIBFABRIC"], "kv_lease_duration": 45}
    with pytest.raises(ValueError, match="kv_lease_s"):
        EngineSpec(kv_lease_s=5)  # vLLM would heartbeat every 0 s
    with pytest.raises(ValueError, match="kv_backends"):
        EngineSpec(kv_backends=[])  # vLLM would use the empty list as is


def test_engine_settings_reach_the_command_line():
    engine = EngineSpec(dtype="bfloat16", block_size_tokens=64, max_model_len_tokens=4096, extra_args=["--seed", "7"])
    args = _args("decode", engine=engine)
    assert _flag(args, "--block-size") == "64"
    assert _flag(args, "--max-model-len") == "4096"
    assert _flag(args, "--dtype") == "bfloat16"
    assert _flag(args, "--served-model-name") == "tiny"
    assert _flag(args, "--port") == "8123"
    assert _flag(args, "--host") == "127.0.0.1"
    assert "--enforce-eager" in args
    assert args[-2:] == ["--seed", "7"]


def test_dtype_override_wins_over_engine_dtype():
    assert _flag(_args("prefill", dtype="float32"), "--dtype") == "float32"


def test_aggregated_role_has_no_kv_transfer():
    assert "--kv-transfer-config" not in _args("both")


def test_kv_events_enable_prefix_caching_and_zmq_publisher():
    args = _args("decode", kv_events_port=5599)
    assert "--enable-prefix-caching" in args
    events = json.loads(_flag(args, "--kv-events-config"))
    assert events == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5599",
                      "topic": KV_EVENTS_TOPIC}
    assert "--kv-events-config" not in _args("decode")


def test_unknown_role_is_rejected_naming_it():
    with pytest.raises(ValueError, match="'router'"):
        _args("router")


def test_worker_env_sets_nixl_side_channel_and_cpu_transport_without_touching_base():
    base = {"PATH": "/bin", "UCX_TLS": "rc"}
    env = build_worker_env(base, side_channel_port=5601, cpu=True, cpu_kv_cache_space_gib=2)
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["UCX_TLS"] == "tcp,self"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "1"
    assert env["PATH"] == "/bin"
    assert base == {"PATH": "/bin", "UCX_TLS": "rc"}


def test_gpu_env_leaves_ucx_transports_alone():
    env = build_worker_env({"UCX_TLS": "rc"}, side_channel_port=1, cpu=False)
    assert env["UCX_TLS"] == "rc"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env


def test_worker_process_picks_distinct_ports_and_exposes_urls(tmp_path):
    w = WorkerProcess(EngineSpec(), tmp_path, served_model_name="m", role="decode", log_path=tmp_path / "w.log",
                      enable_kv_events=True, kv_events_port=free_port())
    ports = {w.port, w.side_channel_port, w.kv_events_port}
    assert len(ports) == 3
    assert w.base_url == f"http://127.0.0.1:{w.port}"
    assert w.metrics_url == f"{w.base_url}/metrics"
    assert w.kv_events_endpoint == f"tcp://127.0.0.1:{w.kv_events_port}"
    assert w.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(w.side_channel_port)
    assert not w.alive()
    assert w.stop() is None  # never started: nothing to stop


def test_kv_events_ipc_endpoint_for_vllm():
    args = _args("decode", kv_events_ipc_path="/tmp/x/kv-events.sock")
    assert json.loads(_flag(args, "--kv-events-config"))["endpoint"] == "ipc:///tmp/x/kv-events.sock"
    with pytest.raises(ValueError, match="not both"):
        _args("decode", kv_events_port=5599, kv_events_ipc_path="/tmp/x/kv-events.sock")


def test_a_local_worker_publishes_kv_events_on_a_private_unix_socket_not_a_tcp_port(tmp_path):
    import stat

    w = WorkerProcess(EngineSpec(), tmp_path, served_model_name="m", role="decode", log_path=tmp_path / "w.log",
                      enable_kv_events=True)
    assert w.kv_events_port is None  # no TCP port: nothing listens on the network
    assert w.kv_events_endpoint.startswith("ipc://") and w.kv_events_endpoint.endswith("/kv-events.sock")
    sock_path = w.kv_events_endpoint.removeprefix("ipc://")
    folder = os.path.dirname(sock_path)
    assert json.loads(_flag(w.args, "--kv-events-config"))["endpoint"] == w.kv_events_endpoint
    assert not os.path.exists(folder)  # made by start, so a worker never started leaves nothing behind

    # start a harmless stand-in for vLLM through the real start/stop path
    w.args = [sys.executable, "-c", "import time; time.sleep(60)"]
    w.start()
    try:
        mode = os.stat(folder).st_mode
        assert stat.S_ISDIR(mode) and stat.S_IMODE(mode) == 0o700  # only this user can reach the socket
    finally:
        w.stop()
    assert not os.path.exists(folder)
    w.start()  # a restart makes the folder anew
    try:
        assert os.path.isdir(folder)
    finally:
        w.stop()
    assert not os.path.exists(folder)


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_gpu_worker_keeps_its_kv_buffer_on_the_gpu():
    cfg = json.loads(_flag(_args("prefill", cpu=False), "--kv-transfer-config"))
    assert cfg["kv_buffer_device"] == "cuda"


def test_length_priority_puts_prefill_workers_on_vllms_priority_scheduler():
    assert _flag(_args("prefill", prefill_priority="length"), "--scheduling-policy") == "priority"
    for role, prio in (("decode", "length"), ("both", "length"), ("prefill", "fcfs")):
        assert "--scheduling-policy" not in _args(role, prefill_priority=prio)
    for own in (["--scheduling-policy=fcfs"], ["--scheduling-policy", "priority"], ["--scheduling_policy=fcfs"]):
        with pytest.raises(ValueError, match="router.prefill_priority"):  # the runtime's priorities must match
            EngineSpec(extra_args=own)


def test_worker_args_parse_with_vllms_own_parser():
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for role in ("prefill", "decode", "both"):
        args = _args(role, prefill_priority="length", kv_events_port=5599)
        engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(args[3:]))
        assert engine_args.scheduling_policy == ("priority" if role == "prefill" else "fcfs")
        assert engine_args.block_size == 32 and engine_args.enable_prefix_caching
        assert (engine_args.kv_transfer_config is None) == (role == "both")


def test_a_failed_start_leaves_no_socket_folder_and_can_be_retried(tmp_path):
    w = WorkerProcess(EngineSpec(), tmp_path, served_model_name="m", role="decode", log_path=tmp_path / "w.log",
                      enable_kv_events=True, python=str(tmp_path / "no-such-python"))
    folder = os.path.dirname(w.kv_events_endpoint.removeprefix("ipc://"))
    for _ in range(2):  # the retry fails for the same reason, not on a folder the first try left behind
        with pytest.raises(FileNotFoundError, match="no-such-python"):
            w.start()
        assert not os.path.exists(folder) and w.pid is None


def test_a_long_temp_folder_falls_back_to_tmp_or_fails_naming_the_limit(tmp_path, monkeypatch):
    import tempfile

    from runtime.engines import vllm_worker

    long_dir = tmp_path / ("t" * 90)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(long_dir))
    folder = vllm_worker._kv_events_dir()
    assert folder.startswith("/tmp/pdserve-kv-")
    assert len(os.path.join(folder, vllm_worker.KV_EVENTS_SOCKET).encode()) <= vllm_worker.MAX_IPC_PATH_BYTES
    monkeypatch.setattr(vllm_worker, "MAX_IPC_PATH_BYTES", 20)  # nothing fits
    with pytest.raises(ValueError, match="at most 20 bytes.*TMPDIR"):
        WorkerProcess(EngineSpec(), tmp_path, served_model_name="m", role="decode", log_path=tmp_path / "w.log",
                      enable_kv_events=True)
