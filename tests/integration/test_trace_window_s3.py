"""A windowed trace prefix on a real S3 server (SeaweedFS on 127.0.0.1): objects that cannot hold a request of
the window, by their LastModified, are not downloaded; what is read gives the same workload as reading all.

Specification:
* with a window, objects last modified before ``newest arrival - window - margin`` are not fetched (counted by
  the GetObject calls the client makes), and the workload equals the one read from every object;
* the margin (an hour by default) keeps every object shipped within it;
* an object holding arrivals later than its own LastModified (not written before its upload) turns skipping
  off: every object is read;
* keys under the prefix that are not read as trace are listed (the warning gives count and names);
* `pdserve tune --trace-uri s3://…/ --trace-window-h` reads the prefix itself, skipping as above.
"""

from __future__ import annotations

import json
import time

import pytest

import runtime.tracking.traces as traces
from runtime.tracking.traces import fetch_trace_workload, skipped_note

pytestmark = pytest.mark.integration


def _lines(times_ms, isl: int, osl: int) -> bytes:
    return "".join(json.dumps({"timestamp": t, "input_length": isl, "output_length": osl}) + "\n"
                   for t in times_ms).encode()


def _get_object_keys(client) -> list[str]:  # noqa: ANN001
    keys: list[str] = []
    client.meta.events.register("before-parameter-build.s3.GetObject", lambda params, **kw: keys.append(params["Key"]))
    return keys


@pytest.fixture
def shipped(s3_client, s3_bucket):
    """Two shipments of one pod: an OLD object (arrivals 30-20 s before its upload), then, 5 s later, a NEW one
    (arrivals up to 1 s before its upload). LastModified has whole seconds on SeaweedFS."""
    now_ms = int(time.time() * 1000)
    s3_client.put_object(Bucket=s3_bucket, Key="traffic/pod-a/0001-0-1.jsonl",
                         Body=_lines(range(now_ms - 30_000, now_ms - 20_000, 1000), 100, 10))
    time.sleep(5.0)
    now_ms = int(time.time() * 1000)
    s3_client.put_object(Bucket=s3_bucket, Key="traffic/pod-a/0002-1-2.jsonl",
                         Body=_lines(range(now_ms - 5_000, now_ms - 1_000, 500), 1000, 20))
    return f"s3://{s3_bucket}/traffic/"


def test_objects_older_than_the_window_are_not_downloaded(s3_client, shipped, monkeypatch):
    everything = fetch_trace_workload(shipped, s3_client=s3_client)
    monkeypatch.setattr(traces, "LAST_MODIFIED_MARGIN_S", 0.0)  # seconds matter here, not the hour of production
    fetched = _get_object_keys(s3_client)
    last = fetch_trace_workload(shipped, s3_client=s3_client, window_s=2.0)
    assert fetched == ["traffic/pod-a/0002-1-2.jsonl"] and last.objects_not_read == 1
    assert (last.isl_tokens, last.osl_tokens, last.requests) == (1000, 20, 5)  # arrivals in the last 2 s: 5
    fetched.clear()
    monkeypatch.setattr(traces, "LAST_MODIFIED_MARGIN_S", 1e6)  # nothing skipped: the same workload
    read_all = fetch_trace_workload(shipped, s3_client=s3_client, window_s=2.0)
    assert read_all._replace(objects_not_read=1, requests_outside_window=3) == last
    assert (read_all.requests_outside_window, last.requests_outside_window) == (10 + 3, 3)  # of what was read
    assert sorted(fetched) == ["traffic/pod-a/0001-0-1.jsonl", "traffic/pod-a/0002-1-2.jsonl"]
    assert everything.requests == 10 + 8 and everything.objects_not_read == 0


def test_the_default_margin_keeps_objects_shipped_within_the_hour(s3_client, shipped):
    fetched = _get_object_keys(s3_client)
    last = fetch_trace_workload(shipped, s3_client=s3_client, window_s=2.0)
    assert len(fetched) == 2 and last.objects_not_read == 0 and last.requests == 5


def test_arrivals_after_an_objects_last_modified_turn_skipping_off(s3_client, s3_bucket, shipped, monkeypatch):
    future_ms = int(time.time() * 1000) + 86_400_000  # a day ahead: not a line written before its upload
    time.sleep(1.1)
    s3_client.put_object(Bucket=s3_bucket, Key="traffic/pod-b/0001-0-1.jsonl",
                         Body=_lines([future_ms, future_ms + 1000], 7, 7))
    monkeypatch.setattr(traces, "LAST_MODIFIED_MARGIN_S", 0.0)
    fetched = _get_object_keys(s3_client)
    w = fetch_trace_workload(shipped, s3_client=s3_client, window_s=2.0)
    assert len(fetched) == 3 and w.objects_not_read == 0  # every object read, none left out on a wrong bound
    assert (w.requests, w.isl_tokens) == (2, 7)


def test_keys_that_are_not_read_are_reported(s3_client, s3_bucket):
    body = _lines(range(1_764_000_000_000, 1_764_000_010_000, 1000), 5, 5)
    for key in ["t/pod-a/1.jsonl", "t/pod-a/1.jsonl/2.jsonl", "t/README.txt", "t/pod-a/.state.jsonl",
                "t/pod-a/1.jsonl.gz"]:
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)
    s3_client.put_object(Bucket=s3_bucket, Key="t/empty/", Body=b"")  # a console's folder marker: not news
    w = fetch_trace_workload(f"s3://{s3_bucket}/t/", s3_client=s3_client)
    assert w.requests == 10
    assert w.skipped == ("README.txt (not .jsonl, .json or .csv)", "pod-a/.state.jsonl (hidden name)",
                         "pod-a/1.jsonl.gz (not .jsonl, .json or .csv)",
                         "pod-a/1.jsonl/2.jsonl (under the object pod-a/1.jsonl)")
    msg = skipped_note(w.skipped, f"s3://{s3_bucket}/t/")
    assert f"4 file(s) under s3://{s3_bucket}/t/ not read as trace: README.txt" in msg and "2.jsonl" in msg


def test_pdserve_tune_reads_a_windowed_prefix_straight_from_s3(s3_server, shipped, tmp_path, monkeypatch):
    """`pdserve tune --trace-uri s3://…/ --trace-window-h H` without --trace: read from S3 with the
    environment's credentials and endpoint (what a retune pod has), the window's requests only."""
    from typer.testing import CliRunner

    from runtime.cli import app
    from runtime.config import DeploymentSpec
    from runtime.modelfiles.catalog import CATALOG_DIR

    for k in [k for k in __import__("os").environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(traces, "LAST_MODIFIED_MARGIN_S", 0.0)
    out = tmp_path / "spec.json"
    res = CliRunner().invoke(app, ["tune", str(CATALOG_DIR / "meta-llama--Meta-Llama-3.1-8B_config.json"),
                                   "--trace-uri", shipped, "--trace-window-h", str(2 / 3600), "--out", str(out)])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"workload: {shipped}: 5 requests" in text and "1 older object(s) not downloaded" in text
    spec = DeploymentSpec.model_validate_json(out.read_text())
    assert (spec.workload.isl_tokens, spec.workload.osl_tokens) == (1000, 20)
    assert spec.workload.request_rate_per_s == pytest.approx(2.0)  # 5 arrivals 500 ms apart
