"""Runtime model streams in tests: reading the SSE events `PDModel.create_*_completion(stream=True)` yields into
the content text (`stream_content`), and a worker's body that breaks mid-stream (`DyingStream`)."""

import json
from collections.abc import AsyncIterable, Callable

import httpx


async def stream_content(events: AsyncIterable, on_piece: Callable[[str], None] | None = None) -> tuple[str, bool]:
    """Concatenate the content of a streamed chat answer.

    Args:
        events: the model's SSE events (``data: {...}`` lines, ``data: [DONE]`` last).
        on_piece: called with each non-empty content piece as it arrives.

    Returns:
        ``(text, saw [DONE])``.

    Raises:
        AssertionError: an event carries an ``error`` object.
    """
    text, done = "", False
    async for event in events:
        for line in str(event).splitlines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            for c in chunk.get("choices") or ():
                piece = (c.get("delta") or {}).get("content") or ""
                if piece:
                    text += piece
                    if on_piece is not None:
                        on_piece(piece)
    return text, done


class DyingStream(httpx.AsyncByteStream):
    """A worker's streamed body that sends ``chunks`` and then breaks as a dead worker's connection does
    (``httpx.ReadError``)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self):  # noqa: ANN204
        for c in self.chunks:
            yield c
        raise httpx.ReadError("connection reset by peer")
