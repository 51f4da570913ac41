"""JSON read as RFC 8259 defines it: the reader for client-sent JSON that is forwarded to a worker (the edge's
slow path, batch input lines).

Python's json takes ``NaN``, ``Infinity`` and ``-Infinity``, which JSON has not, and reads a number literal too
large for a double (``1e400``) as infinity; neither can be forwarded to a worker (orjson writes a non-finite
float as ``null``, so the field would silently fall back to its default). :func:`loads` refuses both with a
message that says what to send instead.
"""

from __future__ import annotations

import json
import math
from typing import Any


class JsonNumberError(ValueError):
    """A value that JSON (RFC 8259) cannot carry as a number: a NaN/Infinity constant or a literal beyond the
    range of a double. The message names the value (its first 40 characters) and what to send instead; ``path``
    (set by :func:`loads`) is where the first such value stands (``temperature``, ``messages[0].x``; ``""`` at
    the top level), or None when unknown."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


def reject_constant(name: str) -> Any:
    """``json.loads``' ``parse_constant``: always raises :class:`JsonNumberError`."""
    raise JsonNumberError(f"{name} is not a number in JSON (RFC 8259): send a finite number")


def finite_float(text: str) -> float:
    """``json.loads``' ``parse_float``: the literal as a float. Raises :class:`JsonNumberError` when it lies beyond
    the range of a double (about 1.8e308)."""
    value = float(text)
    if not math.isfinite(value):
        raise JsonNumberError(f"{text[:40]} is beyond the range of a double (about 1.8e308): send a finite number")
    return value


def loads(text: str | bytes) -> Any:
    """``json.loads(text)`` with only finite numbers. Raises :class:`JsonNumberError` (a ValueError, its ``path``
    where the value stands) for a value JSON cannot carry, ``json.JSONDecodeError`` (a ValueError) for text that
    is not JSON, RecursionError for nesting beyond the interpreter's recursion limit."""
    try:
        return json.loads(text, parse_constant=reject_constant, parse_float=finite_float)
    except JsonNumberError as exc:
        exc.path = _bad_number_path(text)
        raise


_BAD = object()  # where a value JSON cannot carry stood, in a second reading of the text


def _bad_number_path(text: str | bytes) -> str | None:
    """Where the first value JSON cannot carry stands in ``text`` (read again with a marker in its place), in
    the edge's notation (``a.b[0]``); None when the text cannot be read that way."""
    def mark_float(literal: str) -> Any:
        value = float(literal)
        return value if math.isfinite(value) else _BAD

    try:
        doc = json.loads(text, parse_constant=lambda _: _BAD, parse_float=mark_float)
    except (ValueError, RecursionError):
        return None
    # depth first in document order, one iterator per open container and the keys that lead to it: memory
    # grows with the depth, not with the number of values, and the path is spelt only for the value found
    keys: list[str | int] = []
    stack = [iter([(None, doc)])]
    while stack:
        try:
            key, value = next(stack[-1])
        except StopIteration:
            stack.pop()
            if keys:
                keys.pop()
            continue
        if value is _BAD:
            found = [k for k in keys[1:] + [key] if k is not None] if keys else ([] if key is None else [key])
            return "".join(f"[{k}]" if isinstance(k, int) else (f".{k}" if i else str(k))
                           for i, k in enumerate(found))
        if isinstance(value, dict):
            stack.append(iter(value.items()))
            keys.append(key)
        elif isinstance(value, list):
            stack.append(iter(enumerate(value)))
            keys.append(key)
    return None
