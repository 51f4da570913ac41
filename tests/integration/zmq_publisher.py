"""Test helpers for KV-event tests: a real ZMQ PUB socket on 127.0.0.1 (the publisher side of vLLM's
KV events) and a poll-until helper for the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from runtime.engines.vllm_worker import free_port


def bound_publisher(port: int | None = None) -> tuple[Any, str, Callable[[], None]]:
    """A zmq.asyncio PUB socket bound on 127.0.0.1 (`port`, else a free one): (socket, its
    ``tcp://127.0.0.1:PORT`` endpoint, close — closes the socket and terminates its context)."""
    import zmq
    import zmq.asyncio

    endpoint = f"tcp://127.0.0.1:{port or free_port()}"
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)

    def close() -> None:
        pub.close(0)
        ctx.term()

    return pub, endpoint, close


async def wait_for(pred: Callable[[], bool], what: str = "the condition", timeout_s: float = 10.0) -> None:
    """Poll `pred` every 20 ms in the running loop; fail naming `what` after `timeout_s` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not pred():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
