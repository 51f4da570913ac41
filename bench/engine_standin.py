"""A fast stand-in for a vLLM OpenAI worker, for measuring what sits in front of the engines.

    python bench/engine_standin.py --port 8101 [--token-interval-ms 5] [--engine-id prefill-0] [--stall-after N]

A real HTTP server on 127.0.0.1 (uvicorn running a bare ASGI app, so that the stand-in costs as little CPU as
possible and the front end under test dominates) with the parts of vLLM's OpenAI API a router touches:

* `POST /v1/completions` and `POST /v1/chat/completions`, streaming (SSE, honouring
  `stream_options.include_usage`, `continuous_usage_stats` and `return_token_ids`) or not. The generated text is deterministic: token i of a request is
  ``"t{i} "``, so any front end's output can be compared with the direct answer. Tokens are paced one every
  `--token-interval-ms` (the first after one interval too: a prefill of zero cost). A prompt (or last message)
  that ends with ``"t0 t1 ... t{k-1} "`` (a runtime's continuation of a migrated answer) is answered from token k
  on, as an engine continuing the same text would.
* `--stall-after N`: a stuck engine. Once it has streamed N tokens (all requests together) it produces nothing
  more, streamed or not, prefill included: calls in flight and new ones are accepted and never answered further,
  while `/health` and the other GET routes still answer (a vLLM engine loop hung with its API server alive).
* vLLM's P/D `kv_transfer_params` protocol (vLLM NixlConnector, examples/online_serving/disaggregated_serving/):
  a request with ``do_remote_decode: true`` answers at once, non-streaming, one token, with
  ``kv_transfer_params`` naming this engine (``remote_engine_id``), made-up block ids and a side channel; a
  request carrying ``do_remote_prefill: true`` counts as a decode that pulled KV (`/stats` counts both).
* vLLM's own rejections of a request's token budget, with vLLM 0.28's messages (400, OpenAI error object):
  prompt tokens + `max_tokens` (or `max_completion_tokens`) over `MAX_MODEL_LEN`, and `min_tokens` over
  `max_tokens`. A rejected request carrying ``do_remote_prefill: true`` is counted (`/stats`
  ``rejected_remote_decodes``): vLLM 0.28's decode worker then tells the prefill worker to free that handoff.
* `POST /tokenize`: the token ids of a prompt or of a chat continuation (`_render_ids`), for the runtime's check
  of a chat continuation.
* `GET /health`, `GET /v1/models`, `GET /metrics` (vLLM v1 gauge names with the requests in flight), and
  `GET /stats` (JSON: requests, prefills, remote decodes, rejected remote decodes) for the bench's checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from typing import Any

#: The context length the stand-in serves (`/v1/models` `max_model_len`), tokens.
MAX_MODEL_LEN = 32768
#: Token id of the output token "t{i} " is OUTPUT_ID_BASE + i (`return_token_ids`), apart from any prompt's ids
#: (0 to the prompt's length - 1), so a continuation prompted with token ids shows where it goes on from.
OUTPUT_ID_BASE = 1_000_000


class EngineStandin:
    """The ASGI app. `token_interval_s` paces streamed tokens; `engine_id` names the engine in P/D answers;
    `stall_after`: streamed tokens after which the engine is stuck (None: never)."""

    def __init__(self, token_interval_s: float, engine_id: str, model: str, stall_after: int | None = None) -> None:
        self.token_interval_s, self.engine_id, self.model = token_interval_s, engine_id, model
        self.requests = self.prefills = self.remote_decodes = self.rejected_remote_decodes = self.running = 0
        self.stall_after, self.streamed = stall_after, 0

    async def _step(self, receive, interval: bool = True) -> None:
        """One engine step: a token interval (none with `interval` False: a prefill costs nothing); once the
        engine is stuck (`stall_after`), until the client goes (then `_Gone`: the request ends, so that the
        server can stop)."""
        if self.stall_after is not None and self.streamed >= self.stall_after:
            while (await receive())["type"] != "http.disconnect":
                pass
            raise _Gone
        if interval:
            await asyncio.sleep(self.token_interval_s)

    async def __call__(self, scope: dict, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path, method = scope["path"], scope["method"]
        if method == "GET":
            if path == "/health":
                return await _send(send, 200, b"", "text/plain")
            if path == "/v1/models":
                return await _json(send, 200, {"object": "list", "data": [
                    {"id": self.model, "object": "model", "owned_by": "standin", "max_model_len": MAX_MODEL_LEN}]})
            if path == "/metrics":
                page = (f"vllm:num_requests_running{{model_name=\"{self.model}\"}} {self.running}\n"
                        f"vllm:num_requests_waiting{{model_name=\"{self.model}\"}} 0\n"
                        f"vllm:kv_cache_usage_perc{{model_name=\"{self.model}\"}} 0.0\n")
                return await _send(send, 200, page.encode(), "text/plain; version=0.0.4")
            if path == "/stats":
                return await _json(send, 200, {"requests": self.requests, "prefills": self.prefills,
                                               "remote_decodes": self.remote_decodes,
                                               "rejected_remote_decodes": self.rejected_remote_decodes})
            return await _json(send, 404, {"error": {"message": f"no route {path}", "code": 404}})
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            return await _json(send, 404, {"error": {"message": f"no route {method} {path}", "code": 404}})
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            body = json.loads(raw)
        except ValueError:
            return await _json(send, 400, {"error": {"message": "body is not JSON", "code": 400}})
        if path == "/tokenize":
            tokens = _render_ids(body)
            return await _json(send, 200, {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens})
        self.requests += 1
        self.running += 1
        try:
            await self._generate(send, receive, body, chat=path.endswith("chat/completions"))
        except _Gone:
            pass
        finally:
            self.running -= 1

    async def _generate(self, send, receive, body: dict, chat: bool) -> None:
        kv = body.get("kv_transfer_params") or {}
        rid = f"cmpl-{self.engine_id}-{self.requests}"
        prompt_tokens = _prompt_tokens(body)
        rejection = _rejection(body, prompt_tokens)
        if rejection is not None:
            if kv.get("do_remote_prefill"):
                self.rejected_remote_decodes += 1
            message, param = rejection
            return await _json(send, 400, {"error": {"message": message, "type": "BadRequestError", "param": param,
                                                     "code": 400}})
        if kv.get("do_remote_decode"):  # answered at once, as the module docstring says, unless stuck
            await self._step(receive, interval=False)
            self.prefills += 1
            answer = _answer(rid, self.model, chat, "t0 ", "length", prompt_tokens, 1)
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": list(range(max(1, prompt_tokens // 16))), "remote_host": "127.0.0.1",
                "remote_port": 5600, "tp_size": 1}
            return await _json(send, 200, answer)
        if kv.get("do_remote_prefill"):
            self.remote_decodes += 1
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        k = _continued_from(body)
        if not body.get("stream"):
            await self._step(receive)
            await asyncio.sleep(self.token_interval_s * (n - 1))
            return await _json(send, 200, _answer(rid, self.model, chat, "".join(f"t{k + i} " for i in range(n)),
                                                  "length", prompt_tokens, n))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        created = int(time.time())
        options = body.get("stream_options") or {}
        running = bool(options.get("include_usage") and options.get("continuous_usage_stats"))
        # vLLM's return_token_ids: the prompt's ids on the first chunk, each chunk's token ids; null when not
        # asked for, as vLLM writes the fields
        ids = bool(body.get("return_token_ids"))
        prompt_ids = list(range(prompt_tokens)) if ids else None
        for i in range(n):
            await self._step(receive)
            self.streamed += 1
            word = f"t{k + i} "
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if i == n - 1 else None}
            if chat:
                choice["delta"] = {"role": "assistant", "content": word} if i == 0 else {"content": word}
            else:
                choice["text"], choice["logprobs"] = word, None
                choice["prompt_token_ids"] = prompt_ids if i == 0 else None
            choice["token_ids"] = [OUTPUT_ID_BASE + k + i] if ids else None
            chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": self.model, "choices": [choice]}
            if chat and i == 0:
                chunk["prompt_token_ids"] = prompt_ids
            if running:  # vLLM's continuous usage stats: every chunk carries the usage so far
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": i + 1,
                                  "total_tokens": prompt_tokens + i + 1}
            # compact, as vLLM writes its chunks (pydantic's model_dump_json)
            data = json.dumps(chunk, separators=(",", ":")).encode()
            await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                        "more_body": True})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": self.model, "choices": [],
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                               "total_tokens": prompt_tokens + n}}
            data = json.dumps(usage, separators=(",", ":")).encode()
            await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                        "more_body": True})
        # the end of the body in a write of its own, after [DONE], as vLLM's server (Starlette's StreamingResponse)
        # ends a stream: a client that stops reading at [DONE] leaves the body unfinished
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _Gone(Exception):
    """The client of a request held by a stuck engine disconnected."""


def _prompt_tokens(body: dict) -> int:
    """Whitespace words of the prompt (or of every message): a stand-in's token count."""
    if "messages" in body:
        return sum(len(str(m.get("content") or "").split()) for m in body["messages"]) or 1
    prompt = body.get("prompt") or ""
    return (len(prompt) if isinstance(prompt, list) else len(str(prompt).split())) or 1


def _render_ids(body: dict) -> list[int]:
    """The token ids `POST /tokenize` gives `body`: the prompt's (0 to its length - 1, as its streams'
    `prompt_token_ids`); a chat body continuing a final assistant message ("t0 ... t{k-1} ") has the ids of the
    messages before it and then those tokens' output ids, as the stream that made them returned them."""
    messages = body.get("messages")
    if messages and body.get("continue_final_message") and isinstance(messages[-1], dict):
        words = str(messages[-1].get("content") or "").split()
        k = _continued_from({"messages": messages})
        head = list(range(_prompt_tokens({"messages": messages[:-1]})))
        return head + [OUTPUT_ID_BASE + i for i in range(k)] + [-1] * (len(words) - k)
    return list(range(_prompt_tokens(body)))


def _continued_from(body: dict) -> int:
    """k when the prompt (or the last message) ends with "t0 t1 ... t{k-1} ", or a prompt of token ids with
    their ids (`OUTPUT_ID_BASE` + i): the answer goes on from token k."""
    messages = body.get("messages")
    prompt = body.get("prompt")
    if messages:
        text = str(messages[-1].get("content") or "") if isinstance(messages[-1], dict) else ""
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        k = 0
        while k < len(prompt) and prompt[len(prompt) - 1 - k] >= OUTPUT_ID_BASE:
            k += 1
        return k if prompt[len(prompt) - k:] == [OUTPUT_ID_BASE + i for i in range(k)] else 0
    else:
        text = prompt if isinstance(prompt, str) else ""
    last = re.search(r"t(\d{1,6}) $", text)
    if last is None:
        return 0
    k = int(last[1]) + 1
    return k if text.endswith("".join(f"t{i} " for i in range(k))) else 0


def _rejection(body: dict, prompt_tokens: int) -> tuple[str, str | None] | None:
    """(message, param) of vLLM 0.28's 400 for a token budget it refuses (vllm/renderers/params.py,
    vllm/sampling_params.py), or None when the budget is valid."""
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(limit, int) and prompt_tokens + limit > MAX_MODEL_LEN:
        return (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {limit} "
                f"output tokens and your prompt contains at least {prompt_tokens} input tokens, for a total of at "
                f"least {prompt_tokens + limit} tokens. Please reduce the length of the input prompt or the number "
                f"of requested output tokens. (parameter=input_tokens, value={prompt_tokens})", "input_tokens")
    min_tokens = body.get("min_tokens")
    if isinstance(limit, int) and isinstance(min_tokens, int) and min_tokens > limit:
        return f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}.", None
    return None


def _answer(rid: str, model: str, chat: bool, text: str, finish: str, prompt_tokens: int, n: int) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"], choice["logprobs"] = text, None
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}}


async def _send(send, status: int, payload: bytes, content_type: str) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type.encode()),
                            (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


async def _json(send, status: int, obj: dict) -> None:
    await _send(send, status, json.dumps(obj).encode(), "application/json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, required=True, help="port on 127.0.0.1")
    ap.add_argument("--token-interval-ms", type=float, default=5.0, help="time between streamed tokens (ms)")
    ap.add_argument("--engine-id", default="standin", help="engine id in P/D kv_transfer_params answers")
    ap.add_argument("--model", default="standin", help="served model name")
    ap.add_argument("--stall-after", type=int, default=None, metavar="N",
                    help="a stuck engine: after N streamed tokens nothing more is generated; /health still answers")
    args = ap.parse_args()
    import uvicorn

    app = EngineStandin(args.token_interval_ms / 1000.0, args.engine_id, args.model, args.stall_after)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
