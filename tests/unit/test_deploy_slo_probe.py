"""The SLO probe measures TTFT and ITL of real streaming HTTP responses (loopback SSE server whose
first-token delay and inter-token gap are set by the test)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from runtime.config import SloSpec
from runtime.deploy.slo_probe import MalformedChunk, delta_content, probe


class StepClock:
    """The probe's clock, moved by the stand-in server: it sets the time a chunk is sent, writes the chunk and
    waits until the probe has read the clock for it. The probe's TTFT and ITL are then those the test sets,
    however long the machine pauses either thread (a real clock reads every pause of the probe as latency)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0
        self.cond = threading.Condition()

    def __call__(self) -> float:
        with self.cond:
            self.reads += 1
            self.cond.notify_all()
            return self.now

    def advance(self, s: float) -> int:
        """Move the time on by `s` seconds; the count of reads so far, for `wait_read`."""
        with self.cond:
            self.now += s
            return self.reads

    def wait_read(self, reads_before: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.reads > reads_before, timeout=30), "the probe did not read"


def sse_server(first_delay_s: float, gap_s: float, tokens: int, fail_every: int = 0,
               clock: StepClock | None = None):
    """A chat-completions SSE stand-in; with `clock`, its delays move `clock` instead of passing for real."""
    calls = {"n": 0, "bodies": []}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls["n"] += 1
            calls["bodies"].append((self.path, body))
            if fail_every and calls["n"] % fail_every == 0:
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(tokens):
                delay_s = gap_s if i else first_delay_s
                reads = clock.advance(delay_s) if clock else time.sleep(delay_s)
                chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                if clock:
                    clock.wait_read(reads)
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return srv, t, calls


@pytest.fixture
def server(request):
    srv, t, calls = sse_server(*request.param)
    yield f"http://127.0.0.1:{srv.server_address[1]}", calls
    srv.shutdown()
    srv.server_close()
    t.join(timeout=5)


def test_probe_measures_ttft_and_itl_from_the_stream():
    clock = StepClock()
    srv, t, calls = sse_server(0.15, 0.03, 6, clock=clock)
    try:
        res = probe(f"http://127.0.0.1:{srv.server_address[1]}", model="smollm2", prompts=["a", "b", "c"],
                    max_tokens=6, clock=clock)
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)
    assert res.num_requests == 3 and res.num_errors == 0
    assert res.ttft_p90_ms == pytest.approx(150)
    assert res.itl_p90_ms == pytest.approx(30)
    path, body = calls["bodies"][0]
    assert path == "/openai/v1/chat/completions"
    assert body["stream"] is True and body["model"] == "smollm2" and body["max_tokens"] == 6
    assert res.verdict(SloSpec(ttft_p90_ms=2000, itl_p90_ms=500))[0] is True
    assert res.verdict(SloSpec(ttft_p90_ms=100, itl_p90_ms=500))[0] is False


@pytest.mark.parametrize("server", [(0.0, 0.0, 3, 2)], indirect=True)
def test_failed_requests_are_counted_and_fail_the_verdict(server):
    url, _ = server
    res = probe(url, model="m", prompts=["a", "b", "c", "d"])
    assert res.num_requests == 4 and res.num_errors == 2
    ok, why = res.verdict(SloSpec())
    assert not ok and "2/4 probe requests failed" in why


def test_unreachable_url_counts_every_request_as_error():
    res = probe("http://127.0.0.1:9", model="m", prompts=["a", "b"], timeout_s=2)
    assert res.num_errors == 2 and res.verdict(SloSpec())[0] is False


def raw_sse_server(streams: list[list[str]]):
    """Answers the i-th request with the `data:` payloads of streams[i] (then `[DONE]`), as sent."""
    served = {"n": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            payloads = streams[served["n"]]
            served["n"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for p in payloads + ["[DONE]"]:
                self.wfile.write(f"data: {p}\n\n".encode())
            self.wfile.flush()
            self.close_connection = True

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return srv, t


GOOD = json.dumps({"choices": [{"index": 0, "delta": {"content": "t"}}]})
MALFORMED = ["[]", '{"choices":[null]}', '{"choices":[{"delta":"x"}]}', "null", '{"choices":[{"delta":{"content":5}}]}',
             '{"choices":{"0":{}}}']


def test_malformed_chunks_count_as_failed_requests_instead_of_raising():
    streams = [[GOOD, GOOD]] + [[GOOD, bad, GOOD] for bad in MALFORMED]
    srv, t = raw_sse_server(streams)
    try:
        res = probe(f"http://127.0.0.1:{srv.server_address[1]}", model="m", prompts=["p"] * len(streams))
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)
    assert res.num_requests == 1 + len(MALFORMED) and res.num_errors == len(MALFORMED)
    assert res.verdict(SloSpec())[0] is False


def test_chunks_without_content_are_valid_but_carry_no_token():
    assert delta_content({"choices": []}) == ""  # usage chunk
    assert delta_content({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert delta_content({"choices": [{"delta": {"content": None}, "finish_reason": "stop"}]}) == ""
    assert delta_content(json.loads(GOOD)) == "t"
    with pytest.raises(MalformedChunk, match=r"choices\[0\] is NoneType"):
        delta_content({"choices": [None]})


def test_single_chunk_responses_leave_itl_unmeasured_and_fail_the_verdict():
    clock = StepClock()
    srv, t, _ = sse_server(0.5, 0.0, 1, clock=clock)
    try:
        res = probe(f"http://127.0.0.1:{srv.server_address[1]}", model="m", prompts=["a", "b"], clock=clock)
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)
    assert res.num_errors == 0 and res.ttft_p90_ms == pytest.approx(500)
    assert res.itl_p90_ms is None
    ok, why = res.verdict(SloSpec(ttft_p90_ms=2000, itl_p90_ms=500))
    assert not ok and why.startswith("ITL was not measured: no probe request streamed two or more content chunks")


def test_itl_from_the_requests_that_streamed_several_chunks_is_enough():
    srv, t = raw_sse_server([[GOOD], [GOOD, GOOD, GOOD]])
    try:
        res = probe(f"http://127.0.0.1:{srv.server_address[1]}", model="m", prompts=["p", "q"])
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=5)
    assert res.num_errors == 0 and res.itl_p90_ms is not None and res.itl_p90_ms >= 0
    assert res.verdict(SloSpec(ttft_p90_ms=5000, itl_p90_ms=5000))[0] is True


def test_probe_url_in_cluster_is_the_routes_cluster_local_address():
    from runtime.deploy.rollout import probe_url

    isvc = {"metadata": {"name": "llama", "namespace": "pdserve"},
            "status": {"url": "http://llama-predictor.pdserve.pdserve.example.com",
                       "address": {"url": "http://llama-predictor.pdserve.svc.cluster.local"},
                       "components": {"predictor": {"traffic": [
                           {"revisionName": "llama-predictor-00001", "percent": 90},
                           {"tag": "latest", "latestRevision": True, "percent": 10,
                            "url": "http://latest-llama-predictor.pdserve.pdserve.example.com"}]}}}}
    assert probe_url(isvc) == "http://latest-llama-predictor.pdserve.pdserve.example.com"
    assert probe_url(isvc, cluster_local=True) == "http://latest-llama-predictor.pdserve.svc.cluster.local"
    del isvc["status"]["components"]
    assert probe_url(isvc) == "http://llama-predictor.pdserve.pdserve.example.com"
    assert probe_url(isvc, cluster_local=True) == "http://llama-predictor.pdserve.svc.cluster.local"
    # KServe's Serverless mode writes the v2 inference path into the cluster-local address (kserve/kserve#2874)
    isvc["status"]["address"]["url"] = "http://llama.pdserve.svc.cluster.local/v2/models/llama/infer"
    assert probe_url(isvc, cluster_local=True) == "http://llama.pdserve.svc.cluster.local"
