"""KV cache tiers on a real GPU: one short, prepared run for a lent GPU machine (docs/architecture.md#kv-cache-tiers).

    python bench/gpu_kv_tiers.py plan [--out bench/gpu_kv_tiers_plan.json]          # here (needs pdserve)
    python3 bench/gpu_kv_tiers.py measure --out $OUT/kv_tiers.json [--budget-s 420]  # on the GPU machine

``plan`` writes what pdserve renders for a worker with a CPU tier (the ``--kv-transfer-config`` of a P/D worker,
NIXL + OffloadingConnector, and of an aggregated one, OffloadingConnector alone) and a tiny Llama-shaped model
config, so the GPU side needs no pdserve import. ``measure`` needs PyTorch (and vLLM with CUDA for part 3):

1. ``link``: host → GPU and GPU → host copy bandwidth from pinned memory for block-sized to large transfers
   (median of the repeats, CUDA events): the CPU tier's load rate, which replaces the PCIe link rate of
   ``runtime.kv.tiers.TIER_BANDWIDTH_BYTES_PER_S["CPU"]``.
2. ``disk``: write then read a file under ``--disk-dir`` in block-sized pieces, with ``O_DIRECT`` where the
   filesystem allows it (else through the page cache, reported): the filesystem tier's rate (``"STORAGE"``).
3. ``vllm``: when vLLM imports and CUDA is there, start one vLLM server (dummy weights of the tiny config, no
   tokenizer, a GPU cache of ``--gpu-blocks`` blocks) per rendered config: request prompt A, evict it from the
   GPU with other prompts, request A again; report whether A's greedy tokens repeat, vLLM's
   ``vllm:external_prefix_cache_hits`` (tokens the connector supplied) and ``vllm:kv_offload_load_bytes`` /
   ``_time`` (the measured load rate), and the KV events it published by kind and ``medium`` (``"CPU"``
   stores carrying token ids are what pdserve's router indexes). A config that does not start is reported
   with its log tail.

It prints ONE JSON line and writes it to ``--out``; it stops starting new parts at ``--budget-s``.
``--device cpu --quick`` runs parts 1-2 on the CPU with small sizes: the tests use it to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLAN = ROOT / "bench" / "gpu_kv_tiers_plan.json"
# a small Llama-shaped model: vLLM runs it with dummy weights, so no download is needed on the GPU machine
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
              "intermediate_size": 1408, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
BLOCK_TOKENS = 16
CPU_TIER_GIB = 1.0


def plan(out: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from runtime.config import EngineSpec, KvOffloadSpec
    from runtime.engines.vllm_worker import kv_transfer_config

    engine = EngineSpec(block_size_tokens=BLOCK_TOKENS, kv_offload=KvOffloadSpec(cpu_gib=CPU_TIER_GIB))
    configs = {"pd_worker": kv_transfer_config(engine, cpu=False),
               "aggregated": kv_transfer_config(engine, cpu=False, nixl=False)}
    out.write_text(json.dumps({"block_size": BLOCK_TOKENS, "model_config": TINY_LLAMA, "kv_transfer_configs": configs},
                              indent=1) + "\n")
    print(json.dumps({"plan": str(out), "configs": sorted(configs)}))
    return 0


# ---------------------------------------------------------------------------------------------------- link
def measure_link(device: str, sizes: list[int], reps: int) -> list[dict]:
    """Median seconds and bytes/s of host→device and device→host copies of ``sizes`` bytes."""
    import torch

    rows = []
    cuda = device == "cuda"
    for n in sizes:
        host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            times = []
            for _ in range(reps + 1):
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    dst.copy_(src, non_blocking=True)
                    b.record()
                    torch.cuda.synchronize()
                    times.append(a.elapsed_time(b) / 1e3)
                else:
                    t0 = time.perf_counter()
                    dst.copy_(src)
                    times.append(time.perf_counter() - t0)
            t = statistics.median(times[1:])  # the first is a warm-up
            rows.append({"dir": name, "bytes": n, "time_s": t, "bytes_per_s": n / t if t > 0 else None})
    return rows


# ---------------------------------------------------------------------------------------------------- disk
def measure_disk(folder: Path, block_bytes: int, total_bytes: int) -> dict:
    """Write ``total_bytes`` in ``block_bytes`` pieces, fsync, then read them back (O_DIRECT when possible)."""
    import mmap

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kv-tier-probe-{os.getpid()}.bin"
    buf = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(min(block_bytes, 1 << 20)) * (block_bytes // min(block_bytes, 1 << 20)))
    n = max(1, total_bytes // block_bytes)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        write_s = time.perf_counter() - t0
        os.close(fd)
        direct = True
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            direct = hasattr(os, "O_DIRECT")
        except OSError:  # tmpfs and some overlay filesystems refuse O_DIRECT
            fd, direct = os.open(path, os.O_RDONLY), False
        t0 = time.perf_counter()
        got = 0
        try:
            while True:
                k = os.readv(fd, [buf])
                if k <= 0:
                    break
                got += k
        except OSError:  # O_DIRECT accepted at open but refused at read
            os.close(fd)
            fd, direct = os.open(path, os.O_RDONLY), False
            t0, got = time.perf_counter(), 0
            while (k := os.readv(fd, [buf])) > 0:
                got += k
        read_s = time.perf_counter() - t0
        os.close(fd)
    finally:
        path.unlink(missing_ok=True)
        buf.close()
    size = n * block_bytes
    return {"dir": str(folder), "bytes": size, "block_bytes": block_bytes, "o_direct": direct,
            "write_bytes_per_s": size / write_s, "read_bytes_per_s": got / read_s if read_s > 0 else None}


# ---------------------------------------------------------------------------------------------------- vllm
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _metric(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (any labels) in a Prometheus exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class EventCounter:
    """Counts vLLM KV events by ``kind/medium/tokens|no_tokens`` from a ZMQ publisher (zmq and msgspec come
    with vLLM); without them it reports why."""

    def __init__(self, endpoint: str) -> None:
        try:
            import zmq

            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.SUB)
            self.sock.setsockopt(zmq.SUBSCRIBE, b"")
            self.sock.connect(endpoint)
            time.sleep(1.0)  # ZMQ slow joiner
            self.error = None
        except Exception as exc:  # noqa: BLE001 - reported, the rest of the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def drain(self, wait_s: float) -> dict:
        if self.error:
            return {"error": self.error}
        import msgspec

        counts: dict[str, int] = {}
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.sock.poll(100):
                continue
            frames = self.sock.recv_multipart()
            batch = msgspec.msgpack.decode(frames[-1])
            for ev in batch[1]:
                if isinstance(ev, dict):
                    kind, medium, tokens = ev.get("type"), ev.get("medium"), ev.get("token_ids")
                else:
                    kind = ev[0]
                    medium = ev[6] if kind == "BlockStored" and len(ev) > 6 else ev[2] if len(ev) > 2 else None
                    tokens = ev[3] if kind == "BlockStored" else None
                key = f"{kind}/{medium}" + ("" if kind != "BlockStored" else "/tokens" if tokens else "/no_tokens")
                counts[key] = counts.get(key, 0) + 1
        self.sock.close(0)
        self.ctx.term()
        return counts


def run_vllm(name: str, kv_transfer_config: dict, model_dir: Path, gpu_blocks: int, log_dir: Path,
             timeout_s: float) -> dict:
    """Start one server with ``kv_transfer_config``; prompt A, evicting prompts, A again."""
    port = _free_port()
    log_path = log_dir / f"vllm-{name}.log"
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
            "--skip-tokenizer-init", "--block-size", str(BLOCK_TOKENS),
            "--max-model-len", str(gpu_blocks * BLOCK_TOKENS),  # the whole (small) GPU cache: one prompt fits
            "--num-gpu-blocks-override", str(gpu_blocks), "--gpu-memory-utilization", "0.3", "--enforce-eager",
            "--enable-prefix-caching", "--kv-transfer-config", json.dumps(kv_transfer_config),
            "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"ipc://{log_dir}/kv-{name}.sock", "topic": "kv"})]
    env = dict(os.environ, VLLM_NIXL_SIDE_CHANNEL_PORT=str(_free_port()), VLLM_NO_USAGE_STATS="1")
    out: dict = {"config": name}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            out["started"] = False
            out["log_tail"] = log_path.read_text(errors="replace")[-3000:]
            return out
        out["started"] = True
        events = EventCounter(f"ipc://{log_dir}/kv-{name}.sock")
        prompt_tokens = gpu_blocks * BLOCK_TOKENS // 2  # A fills half the GPU cache; two others evict it

        def complete(seed: int) -> list:
            prompt = [(seed * 7919 + i * 104729) % 31000 + 100 for i in range(prompt_tokens)]
            r = _post(f"{base}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 8,
                                                 "temperature": 0})
            return r["choices"][0].get("token_ids") or r["choices"][0]["text"]

        def metrics() -> str:
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
                return r.read().decode()

        first = complete(1)
        complete(2)
        complete(3)
        before = metrics()
        again = complete(1)
        after = metrics()
        hits = "vllm:external_prefix_cache_hits_total"
        out.update({
            "prompt_tokens": prompt_tokens,
            "repeat_equal": first == again,
            "external_hit_tokens": _metric(after, hits) - _metric(before, hits),
            "offload_load_bytes": _metric(after, "vllm:kv_offload_load_bytes_total"),
            "offload_load_time_s": _metric(after, "vllm:kv_offload_load_time_total"),
            "offload_store_bytes": _metric(after, "vllm:kv_offload_store_bytes_total"),
        })
        out["kv_events"] = events.drain(3.0)
        if out["offload_load_time_s"] > 0:
            out["offload_load_bytes_per_s"] = out["offload_load_bytes"] / out["offload_load_time_s"]
        return out
    except Exception as exc:  # noqa: BLE001 - one config's failure is a result, the next config still runs
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["log_tail"] = log_path.read_text(errors="replace")[-3000:]
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def measure(a: argparse.Namespace) -> int:
    t0 = time.monotonic()
    import torch

    device = a.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("measure: CUDA is not available (use --device cpu --quick to check the script)")
    res: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                 "torch": torch.__version__, "skipped": {}}
    mib = 1 << 20
    sizes = [2 * mib, 16 * mib] if a.quick else [2 * mib, 16 * mib, 256 * mib, 1024 * mib]
    res["link"] = measure_link(device, sizes, 3 if a.quick else 10)
    if time.monotonic() - t0 < a.budget_s:
        res["disk"] = measure_disk(Path(a.disk_dir), 2 * mib, (8 if a.quick else 2048) * mib)
    else:
        res["skipped"]["disk"] = "budget"
    plan_data = json.loads(Path(a.plan).read_text())
    try:
        import vllm  # noqa: F401
        has_vllm = device == "cuda"
        why = "device is not cuda"
    except ImportError as exc:
        has_vllm, why = False, f"vllm does not import: {exc}"
    if has_vllm:
        res["vllm"] = []
        with tempfile.TemporaryDirectory() as d:
            model = Path(d) / "tiny"
            model.mkdir()
            (model / "config.json").write_text(json.dumps(plan_data["model_config"]))
            for name, cfg in plan_data["kv_transfer_configs"].items():
                left = a.budget_s - (time.monotonic() - t0)
                if left < 60:
                    res["skipped"][f"vllm:{name}"] = "budget"
                    continue
                res["vllm"].append(run_vllm(name, cfg, model, a.gpu_blocks, Path(a.out).parent, min(300, left)))
    else:
        res["skipped"]["vllm"] = why
    res["wall_s"] = round(time.monotonic() - t0, 1)
    line = json.dumps(res)
    print(line)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(line + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--out", default=str(DEFAULT_PLAN))
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--plan", default=str(DEFAULT_PLAN))
    m.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    m.add_argument("--quick", action="store_true")
    m.add_argument("--disk-dir", default=tempfile.gettempdir(), help="folder on the disk the tier would use")
    m.add_argument("--gpu-blocks", type=int, default=256, help="vLLM GPU KV blocks (small: prompts evict)")
    m.add_argument("--budget-s", type=float, default=420.0)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return plan(Path(a.out))
    max_blocks = TINY_LLAMA["max_position_embeddings"] // BLOCK_TOKENS
    if not 8 <= a.gpu_blocks <= max_blocks or a.budget_s <= 0:
        ap.error(f"--gpu-blocks must be in [8, {max_blocks}] (the tiny model's context) and --budget-s > 0")
    return measure(a)


if __name__ == "__main__":
    sys.exit(main())
