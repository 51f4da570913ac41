"""Every request shape through the real runtime process and its real worker client (runtime.engines.h1), on 127.0.0.1.

A prefill and a decode engine stand-in (bench/engine_standin.py: vLLM's OpenAI routes and P/D
`kv_transfer_params` protocol; token i of an answer is "t{i} ", prompt_tokens = the prompt's words) behind
`python -m runtime.server`. Specification: chat and completions, streamed and not, answer the text the decode
worker gives directly; a completions request with several prompts and a request with n > 1 come back as one
answer with one choice per prompt / sample in vLLM's order, each prompt's tokens counted once (as vLLM does); a
streamed fan-out carries each choice's tokens under its own index and one summed usage chunk when asked; a
client's own `kv_transfer_params` never reach a worker; a decode leg that the decode worker rejects after a
remote prefill (a token budget over its context, `min_tokens` over `max_tokens`) gets the client the decode
worker's own 400, message and `param`, and the runtime sends nothing more (the rejected decode leg carried the
handoff, which is what lets vLLM free it; another read could find its blocks released); every request that went
through a remote prefill had its handoff passed on to its decode (the stand-ins' prefill count equals the remote
decodes served plus those rejected).
"""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from runtime.engines.vllm_worker import free_port
from runtime.paths import REPO_ROOT
from tests.integration.test_server_planner import _stop, _wait_http

pytestmark = pytest.mark.integration
pytest.importorskip("kserve")

N_TOKENS = 4
TEXT = "".join(f"t{i} " for i in range(N_TOKENS))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from runtime.server.launch import RuntimeProcess

    tmp = tmp_path_factory.mktemp("shapes")
    ports = [free_port(), free_port()]
    workers = [subprocess.Popen([sys.executable, str(REPO_ROOT / "bench/engine_standin.py"), "--port", str(p),
                                 "--model", "m", "--engine-id", role, "--token-interval-ms", "1"])
               for p, role in zip(ports, ("prefill", "decode"))]
    rt = RuntimeProcess("m", prefill_urls=[f"http://127.0.0.1:{ports[0]}"],
                        decode_urls=[f"http://127.0.0.1:{ports[1]}"], log_path=tmp / "runtime.log")
    try:
        for p in ports:
            _wait_http(f"http://127.0.0.1:{p}/health")
        rt.start()
        rt.wait_ready(180)
        yield rt.url, [f"http://127.0.0.1:{p}" for p in ports]
    finally:
        rt.stop()
        for w in workers:
            _stop(w)


def _events(r: httpx.Response) -> list[dict | str]:
    assert r.status_code == 200, r.text
    out: list[dict | str] = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    assert out[-1] == "[DONE]"
    return out[:-1]


def _texts(events: list) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        for c in e.get("choices") or ():
            piece = (c.get("delta") or {}).get("content") if "delta" in c else c.get("text")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["chat/completions", "completions"])
def test_single_shapes_answer_the_direct_text(served, path, stream):
    url, (_, decode) = served
    chat = path == "chat/completions"
    body = {"model": "m", "max_tokens": N_TOKENS, "stream": stream,
            **({"messages": [{"role": "user", "content": "one two three"}]} if chat else {"prompt": "one two three"})}
    with httpx.Client(timeout=30) as c:
        direct = c.post(f"{decode}/v1/{path}", json=body)
        got = c.post(f"{url}/openai/v1/{path}", json={**body, "kv_transfer_params": {"remote_host": "203.0.113.9"}})
    if stream:
        assert _texts(_events(got)) == _texts(_events(direct)) == {0: TEXT}
    else:
        assert got.status_code == 200, got.text
        answer, want = got.json(), direct.json()
        key = (lambda ch: ch["message"]["content"]) if chat else (lambda ch: ch["text"])
        assert [key(ch) for ch in answer["choices"]] == [key(ch) for ch in want["choices"]] == [TEXT]
        counts = {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        assert counts == want["usage"] == {"prompt_tokens": 3, "completion_tokens": N_TOKENS,
                                           "total_tokens": 3 + N_TOKENS}
        assert answer.get("kv_transfer_params") is None  # the handoff stays between the workers


def test_several_prompts_and_n_samples_come_back_in_vllm_order(served):
    url, _ = served
    body = {"model": "m", "prompt": ["a b", "c d e"], "n": 2, "temperature": 0.7, "max_tokens": N_TOKENS}
    with httpx.Client(timeout=30) as c:
        answer = c.post(f"{url}/openai/v1/completions", json=body).json()
        events = _events(c.post(f"{url}/openai/v1/completions",
                                json={**body, "stream": True, "stream_options": {"include_usage": True}}))
        chat = c.post(f"{url}/openai/v1/chat/completions",
                      json={"model": "m", "messages": [{"role": "user", "content": "hi there"}], "n": 3,
                            "temperature": 0.7, "max_tokens": N_TOKENS}).json()
    assert [(ch["index"], ch["text"]) for ch in answer["choices"]] == [(i, TEXT) for i in range(4)]
    # prompt i's choices are i*n .. i*n+n-1; each prompt's words count once whatever n (as vLLM counts them)
    counts = {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert counts == {"prompt_tokens": 2 + 3, "completion_tokens": 4 * N_TOKENS,
                      "total_tokens": 5 + 4 * N_TOKENS}
    assert _texts(events) == {i: TEXT for i in range(4)}
    usage = [e["usage"] for e in events if not e.get("choices")]
    assert usage == [counts]
    assert len({e["id"] for e in events}) == 1
    assert [(ch["index"], ch["message"]["content"]) for ch in chat["choices"]] == [(i, TEXT) for i in range(3)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, shape", [("chat/completions", "over-context"), ("completions", "min-over-max")])
def test_a_decode_rejection_after_a_handoff_is_the_clients_answer_and_nothing_more_is_sent(served, path, shape,
                                                                                          stream):
    import time

    url, (prefill, decode) = served
    prompt = "one two three"
    with httpx.Client(timeout=30) as c:
        context = c.get(f"{decode}/v1/models").json()["data"][0]["max_model_len"]
        budget = {"max_tokens": context} if shape == "over-context" else {"max_tokens": 2, "min_tokens": 3}
        body = {"model": "m", "stream": stream, **budget,
                **({"messages": [{"role": "user", "content": prompt}]} if path == "chat/completions"
                   else {"prompt": prompt})}
        direct = c.post(f"{decode}/v1/{path}", json=body)  # the aggregated answer: the decode worker alone
        assert direct.status_code == 400, direct.text
        p0, d0 = c.get(f"{prefill}/stats").json(), c.get(f"{decode}/stats").json()
        got = c.post(f"{url}/openai/v1/{path}", json=body)
        time.sleep(0.5)  # a request the runtime sent after answering would land by now
        p1, d1 = c.get(f"{prefill}/stats").json(), c.get(f"{decode}/stats").json()
    error, want = got.json()["error"], direct.json()["error"]
    assert (got.status_code, error["message"], error["param"]) == (400, want["message"], want["param"])
    assert p1["prefills"] - p0["prefills"] == 1  # the prefill worker accepted it (max_tokens 1, no min_tokens)
    # one decode leg, carrying the handoff, rejected; no second request reads the handoff
    assert {k: d1[k] - d0[k] for k in ("requests", "rejected_remote_decodes", "remote_decodes")} == {
        "requests": 1, "rejected_remote_decodes": 1, "remote_decodes": 0}


def test_every_remote_prefill_handed_its_kv_to_a_decode(served):
    _, (prefill, decode) = served
    with httpx.Client(timeout=10) as c:
        p, d = c.get(f"{prefill}/stats").json(), c.get(f"{decode}/stats").json()
    assert p["prefills"] > 0 and p["prefills"] == d["remote_decodes"] + d["rejected_remote_decodes"]
