"""The OpenAI Batch file format (runtime.batch.requests).

Specification: every malformed line is reported at once with its line number and nothing is accepted; a line's
url is only a path from the allow-list, so a batch file cannot choose the server (full URLs, other paths and
``..`` are refused); output lines follow OpenAI's batch output shape; resume keeps only 2xx lines, and of those
only the ones whose recorded request hash matches the input line (a line without a hash is kept by custom_id).
"""

from __future__ import annotations

import json

import pytest

from runtime.batch.requests import (
    ALLOWED_URLS,
    REQUEST_HASH_KEY,
    BatchInputError,
    kept_answers,
    not_output_lines,
    output_line,
    parse_input,
    request_sha256,
    succeeded_lines,
    usage_tokens,
)


def _line(cid="a", url="/v1/chat/completions", **body):
    body = body or {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_good_lines_parse_in_order_and_blank_lines_are_skipped():
    reqs = parse_input(["\ufeff" + _line("x"), "\n", _line("y", url="/v1/completions", model="m", prompt="p")])
    assert [(r.custom_id, r.url, r.line) for r in reqs] == [("x", "/v1/chat/completions", 1), ("y", "/v1/completions", 3)]
    assert reqs[1].body == {"model": "m", "prompt": "p"}


def test_the_default_model_fills_only_bodies_without_one():
    reqs = parse_input([_line("a", prompt="p", url="/v1/completions", max_tokens=3),
                        _line("b", url="/v1/completions", model="own", prompt="q")], default_model="served")
    assert [r.body["model"] for r in reqs] == ["served", "own"]


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000/v1/chat/completions", "//evil/v1/completions", "/v1/embeddings",
                                 "/v1/chat/completions/../../admin", "/v1/models", "v1/completions", None])
def test_a_line_cannot_choose_the_server_or_another_path(url):
    with pytest.raises(BatchInputError, match="line 1: url must be one of"):
        parse_input([_line(url=url)])


def test_all_problems_are_listed_with_line_numbers():
    lines = [_line("a"), "{not json", "[1, 2]", _line("a"), json.dumps({"custom_id": "c", "method": "GET",
             "url": "/v1/completions", "body": {"model": "m"}}), json.dumps({"custom_id": "d", "url": "/v1/completions",
             "body": {"prompt": "no model"}}), _line("e", model="m", messages=[], stream=True),
             json.dumps({"custom_id": "", "url": "/v1/completions", "body": "text"})]
    with pytest.raises(BatchInputError) as e:
        parse_input(lines)
    msg = str(e.value)
    for expected in ["line 2: not JSON", "line 3: expected a JSON object, got list", "line 4: custom_id 'a' repeats "
                     "line 1", "line 5: method must be POST", "line 6: body.model is missing", "line 7: body.stream",
                     "line 8: custom_id must be", "line 8: body must be a JSON object", "nothing sent"]:
        assert expected in msg, expected
    assert msg.startswith("8 problem(s)")


def test_a_long_list_of_problems_is_cut_and_counted():
    with pytest.raises(BatchInputError, match=r"and 5 more$"):
        parse_input(["{"] * 25)


def test_an_input_without_requests_is_refused():
    with pytest.raises(BatchInputError, match="no request"):
        parse_input(["", "  \n"])


def test_output_lines_follow_openais_batch_output_shape():
    ok = json.loads(output_line("a", status_code=200, body={"usage": {"prompt_tokens": 3}}, request_id="r1"))
    assert ok == {"id": "batch_req_r1", "custom_id": "a", "response": {"status_code": 200, "request_id": "r1",
                  "body": {"usage": {"prompt_tokens": 3}}}, "error": None}
    bad = json.loads(output_line("b", status_code=400, body={"error": {"message": "bad field"}}))
    assert bad["response"]["status_code"] == 400 and bad["error"] == {"code": "http_400", "message": "bad field"}
    lost = json.loads(output_line("c", status_code=None, error="ConnectError: refused"))
    assert lost["response"] is None and lost["error"] == {"code": "request_failed", "message": "ConnectError: refused"}


def test_resume_keeps_only_the_2xx_lines_and_skips_a_truncated_tail():
    lines = [output_line("a", status_code=200, body={}), output_line("b", status_code=503, body="busy"),
             output_line("c", status_code=None, error="timeout"), output_line("d", status_code=200, body={})[:-9]]
    assert list(succeeded_lines(lines)) == ["a"]


def test_the_request_hash_covers_the_url_and_the_body_as_sent():
    base = parse_input([_line("a", url="/v1/completions", model="m", prompt="p", max_tokens=3)])[0]
    assert len(request_sha256(base)) == 64 and request_sha256(base) == request_sha256(parse_input([_line(
        "other-id", url="/v1/completions", model="m", prompt="p", max_tokens=3)])[0])  # not the custom_id
    edits = [_line("a", url="/v1/completions", model="m", prompt="q", max_tokens=3),
             _line("a", url="/v1/completions", model="m", prompt="p", max_tokens=4),
             _line("a", url="/v1/completions", model="n", prompt="p", max_tokens=3),
             _line("a", url="/v1/chat/completions", model="m", prompt="p", max_tokens=3)]
    assert len({request_sha256(base)} | {request_sha256(parse_input([e])[0]) for e in edits}) == 5
    filled = parse_input([_line("a", url="/v1/completions", prompt="p", max_tokens=3)], default_model="m")[0]
    assert request_sha256(filled) == request_sha256(base)  # the model --model fills in is part of what is sent
    reordered = json.dumps({"custom_id": "a", "url": "/v1/completions",
                            "body": {"max_tokens": 3, "prompt": "p", "model": "m"}})
    assert request_sha256(parse_input([reordered])[0]) == request_sha256(base)  # the body's key order is no change


def test_output_lines_carry_the_hash_and_resume_keeps_only_current_answers():
    reqs = parse_input([_line(c, url="/v1/completions", model="m", prompt=c) for c in "abcde"])
    h = {r.custom_id: request_sha256(r) for r in reqs}
    line = output_line("a", status_code=200, body={}, request_hash=h["a"])
    assert json.loads(line)[REQUEST_HASH_KEY] == h["a"] and REQUEST_HASH_KEY not in json.loads(
        output_line("a", status_code=200, body={}))
    nan = json.loads(output_line("a", status_code=200, body={"x": float("nan")}, request_hash=h["a"]))
    assert nan[REQUEST_HASH_KEY] == h["a"] and nan["error"]["code"] == "invalid_response"
    lines = [line,
             output_line("b", status_code=200, body={}, request_hash=h["a"]),  # answers another request
             output_line("c", status_code=200, body={}),  # no hash: kept by custom_id
             json.dumps({**json.loads(output_line("d", status_code=200, body={})), REQUEST_HASH_KEY: 7}),
             output_line("e", status_code=200, body={}, request_hash=h["c"]),  # stale, then the current one
             output_line("e", status_code=200, body={}, request_hash=h["e"])]
    done = succeeded_lines(lines)
    assert done["c"].request_hash is None and done["d"].request_hash == "" and done["e"].request_hash == h["e"]
    kept, changed = kept_answers(done, reversed(reqs))
    assert list(kept) == ["e", "c", "a"] and changed == ["d", "b"]
    assert kept["a"] == line and kept["e"] == lines[-1] and kept["c"] == lines[2]
    assert kept_answers(done, reqs[:1]) == ({"a": line}, [])  # answers to no request: in neither


def test_lines_that_are_no_output_records_are_found_but_a_truncated_tail_is_not():
    good = [output_line("a", status_code=200, body={}) + "\n", "\n", output_line("b", status_code=None, error="x")]
    assert not_output_lines(good + [output_line("c", status_code=200, body={})[:-9]]) == []
    assert not_output_lines(["hi\n"] + good) == [1]  # not JSON, and not the last line
    assert not_output_lines(good + [_line("q") + "\n"]) == [4]  # an input line (no response / error)
    assert not_output_lines(good + ["[1]\n", "{}"]) == [4, 5]


def test_usage_tokens_read_the_openai_usage_block():
    assert usage_tokens({"usage": {"prompt_tokens": 5, "completion_tokens": 7}}) == (5, 7)
    assert usage_tokens({"usage": None}) == (0, 0) and usage_tokens("text") == (0, 0)


def test_the_allow_list_is_the_openai_batch_endpoints_pdserve_serves():
    assert set(ALLOWED_URLS) == {"/v1/chat/completions", "/v1/completions"}


def test_nan_and_infinity_are_refused_with_the_other_problems_and_null_model_takes_the_default():
    """Python's json reads NaN and Infinity, which JSON has not: such a line could never be sent (it crashed
    the whole run). An invalid line's custom_id is still taken, so its duplicate is listed at once."""
    lines = [json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"model": "m", "temperature": 1}})
             .replace("1}", "Infinity}"), _line("a"), _line("n", model="m", prompt="p", temperature=float("nan"))]
    with pytest.raises(BatchInputError) as e:
        parse_input(lines)
    msg = str(e.value)
    assert "line 1: not JSON (Infinity is not a number in JSON" in msg and "line 3: not JSON (NaN" in msg
    assert "line 2: custom_id 'a' repeats line 1" not in msg  # line 1 has no id to take: it is not JSON
    dup = [_line("b", prompt="p"), _line("b", model="m", prompt="q")]  # line 1 has no model: invalid
    with pytest.raises(BatchInputError, match="line 2: custom_id 'b' repeats line 1"):
        parse_input(dup)
    reqs = parse_input([_line("c", model=None, prompt="p", url="/v1/completions")], default_model="served")
    assert reqs[0].body["model"] == "served"


def test_a_number_beyond_a_double_is_refused_not_sent_as_infinity():
    """1e400 reads as infinity in Python's json; forwarded, it would become null (the field's default) or
    invalid JSON: the batch is refused, the line and the value named."""
    line = _line("big", model="m", prompt="p").replace('"prompt"', '"temperature": 1e400, "prompt"')
    with pytest.raises(BatchInputError, match=r"line 1: not JSON \(1e400 is beyond the range of a double"):
        parse_input([line])
    ok = _line("fine", model="m", prompt="p").replace('"prompt"', '"temperature": 1e300, "prompt"')
    assert parse_input([ok])[0].body["temperature"] == 1e300


def test_a_line_nested_beyond_the_recursion_limit_is_a_listed_problem_not_a_crash():
    deep = '{"custom_id": "d", "url": "/v1/completions", "body": {"model": "m", "prompt": ' + "[" * 100_000 + \
        "]" * 100_000 + "}}"
    with pytest.raises(BatchInputError, match="line 2: nested too deeply to read") as e:
        parse_input([_line("ok", model="m", prompt="p"), deep, _line("x", prompt="p")])
    assert "line 3: body.model is missing" in str(e.value)  # the other lines are still checked


def test_a_body_is_sent_as_read_and_held_compact():
    body = {"model": "m", "prompt": "héllo ✓", "temperature": 1e300, "seed": 2**70, "logit_bias": {"50256": -100}}
    req = parse_input([_line("u", url="/v1/completions", **body)])[0]
    assert json.loads(req.body_json) == body == req.body  # the bytes sent are the body read, values exact
    assert "héllo ✓".encode() in req.body_json  # UTF-8, not \u escapes
    # held serialised: a batch keeps every request of its input in memory (a million short ones in a 1 GiB pod)
    import tracemalloc

    lines = [_line(f"r{i}", messages=[{"role": "user", "content": f"say {i}"}], model="m", max_tokens=8)
             for i in range(5000)]
    tracemalloc.start()
    try:
        reqs = parse_input(lines)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held / len(reqs) < 600  # bytes per request; a parsed body of these fields holds over 1 KiB


def test_a_lone_surrogate_is_a_listed_problem():
    bad = _line("s", url="/v1/completions", model="m", prompt="x").replace('"x"', '"\\ud800"')
    with pytest.raises(BatchInputError, match="line 2: body holds a string with a lone UTF-16 surrogate"):
        parse_input([_line("ok", model="m", prompt="p"), bad])
