"""TCP ports for the servers this process starts: vLLM workers, NIXL side channels, KV-event sockets, the runtime,
SeaweedFS (adapter: sockets).

Why not `bind(port 0)`: the kernel takes such a port from its ephemeral range, the same range it hands to every
outgoing connection (health polls, ZMQ, UCX, MLflow clients). Between picking a port and the server binding it
(tens of seconds while vLLM imports), an outgoing connection can take it: CI on 2026-11-30 failed with
`[Errno 98] ... address ('127.0.0.1', 51333): address already in use` for a runtime started by the e2e session
fixture. Ports below the ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`) are never assigned by the
kernel, so only a server that asked for that exact port can take one; this module also never hands out the
same port twice in one process, unless its owner gave it back with `release_ports` after its server stopped
(the local planner actuator does, so a worker that crash-loops does not drain the pool).
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_RANGE = (32768, 60999)  # Linux default
LOWEST_PORT = 20000  # above the registered services most hosts run (e.g. 8080, 9090, 11211)
MIN_POOL = 1000  # fewer candidate ports below the ephemeral range than this: fall back to bind(0)
MAX_ATTEMPTS = 200

_given: set[tuple[str, int]] = set()
_lock = threading.Lock()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range `(low, high)`, inclusive; the Linux default when `path` is unreadable."""
    try:
        low, high = (int(x) for x in path.read_text().split()[:2])
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL_RANGE
    return low, high


def _bindable(host: str, port: int) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        return None
    return s


def free_ports(n: int, host: str = "127.0.0.1", *, rng: random.Random | None = None,
               ephemeral: tuple[int, int] | None = None) -> list[int]:
    """`n` distinct TCP ports that are free on `host` now, below the kernel's ephemeral range, and not handed
    out before by this process (or given back since with `release_ports`).

    Args:
        n: how many ports (≥ 1).
        host: address the servers will bind.
        rng: random source for the candidates (tests); default `random.SystemRandom()`.
        ephemeral: the ephemeral range to stay below; default `ephemeral_range()`.

    Returns:
        The ports, each checked by binding it (all held open together, then released).

    Raises:
        ValueError: `n` < 1.
        OSError: no `n` free ports found in `MAX_ATTEMPTS` tries, or binding port 0 failed (fallback when fewer
            than `MIN_POOL` ports lie between `LOWEST_PORT` and the ephemeral range).
    """
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one port")
    low, _ = ephemeral or ephemeral_range()
    top = low - 1
    held: list[socket.socket] = []
    rng = rng or random.SystemRandom()
    try:
        with _lock:
            if top - LOWEST_PORT + 1 < MIN_POOL:  # no room below the ephemeral range: let the kernel choose
                while len(held) < n:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    s.bind((host, 0))
                    held.append(s)
            else:
                for _ in range(MAX_ATTEMPTS):
                    if len(held) == n:
                        break
                    port = rng.randint(LOWEST_PORT, top)
                    if (host, port) in _given:
                        continue
                    s = _bindable(host, port)
                    if s is not None:
                        held.append(s)
                if len(held) < n:
                    raise OSError(f"found only {len(held)} of {n} free ports on {host} in "
                                  f"{LOWEST_PORT}..{top} after {MAX_ATTEMPTS} tries")
            ports = [s.getsockname()[1] for s in held]
            _given.update((host, p) for p in ports)
            return ports
    finally:
        for s in held:
            s.close()


def release_ports(ports: list[int] | tuple[int, ...], host: str = "127.0.0.1") -> None:
    """Give `ports` on `host` back: later `free_ports` calls may hand them out again.

    Call it only once the server that used them has stopped (its process exited). Ports this module never
    handed out are ignored, so callers may pass every port a stopped server held.
    """
    with _lock:
        for p in ports:
            _given.discard((host, p))


def free_port(host: str = "127.0.0.1") -> int:
    """One port as `free_ports(1, host)` gives it."""
    return free_ports(1, host)[0]
