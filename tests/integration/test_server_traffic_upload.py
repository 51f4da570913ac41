"""The runtime ships its traffic log to S3 (runtime.server.traffic.TrafficShipper), against a real S3 server
(SeaweedFS on 127.0.0.1) and a real runtime process.

Specification: each shipment is one object of whole lines under ``<prefix><source>/``, named by byte offsets
so that name order is file order; nothing is shipped twice (also not after a restart on the same log); a line
still being written waits for the next shipment; while S3 refuses, nothing is lost and the offset stays put;
the objects under the prefix, downloaded as a folder, are the trace ``pdserve tune --trace`` reads; the runtime
ships every ``--traffic-upload-interval-s`` and once more when it is stopped.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.s3uri import check_upload_uri
from runtime.server.traffic import TrafficLog, TrafficShipper, traffic_source_name
from runtime.tracking.traces import read_arrival_rate, read_isl_osl

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _objects(client, bucket: str, prefix: str = "") -> dict[str, bytes]:  # noqa: ANN001
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            out[o["Key"]] = client.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def _download(client, bucket: str, prefix: str, dest: Path) -> Path:  # noqa: ANN001
    """What Argo's S3 driver does with a key that names a prefix: every object under it, as files."""
    for key, body in _objects(client, bucket, prefix).items():
        f = dest / key[len(prefix):]
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(body)
    return dest


def test_shipments_are_whole_lines_in_file_order_and_never_repeat(tmp_path, s3_client, s3_bucket):
    clock = iter(1_764_000_000.0 + i for i in range(100))
    log = TrafficLog(tmp_path / "traffic.jsonl", wall_clock=lambda: next(clock))
    ship = TrafficShipper(log.path, f"s3://{s3_bucket}/traffic/llama8/", client=s3_client, source="pod-a")
    for n in (100, 200, 300):
        log.record(n, n // 10)
    first = ship.ship()
    assert first == log.path.stat().st_size and ship.objects == 1
    assert ship.ship() == 0 and ship.objects == 1  # nothing new: no empty object
    log.record(400, 40)
    with log.path.open("a") as f:  # another writer mid-line: not shipped until its newline is there
        f.write('{"timestamp":1764000099000,"input_length":5')
    second = ship.ship()
    objs = _objects(s3_client, s3_bucket)
    keys = sorted(objs)
    seg = f"{ship.segment:018d}"
    assert keys == [f"traffic/llama8/pod-a/{seg}-{0:015d}-{first:015d}.jsonl",
                    f"traffic/llama8/pod-a/{seg}-{first:015d}-{first + second:015d}.jsonl"]
    assert all(body.endswith(b"\n") for body in objs.values())
    with log.path.open("a") as f:
        f.write(',"output_length":1,"hash_ids":[]}\n')
    ship.ship()
    shipped = b"".join(body for _, body in sorted(_objects(s3_client, s3_bucket).items()))
    assert shipped == log.path.read_bytes()  # every byte once, in order
    log.close()
    folder = _download(s3_client, s3_bucket, "traffic/llama8/", tmp_path / "artifact")
    assert read_isl_osl(folder) == [(100, 10), (200, 20), (300, 30), (400, 40), (5, 1)]


def test_a_restarted_runtime_ships_only_what_is_new_and_replicas_make_one_trace(tmp_path, s3_client, s3_bucket):
    t0 = 1_764_000_000.0
    uri = f"s3://{s3_bucket}/t/"
    for pod, start in (("pod-a", 0.0), ("pod-b", 0.5)):
        clock = iter(t0 + start + i for i in range(10))
        log = TrafficLog(tmp_path / pod / "traffic.jsonl", wall_clock=lambda c=clock: next(c))
        log.record(1000, 100)
        log.record(1000, 100)
        TrafficShipper(log.path, uri, client=s3_client, source=pod).ship()
        log.close()
    again = TrafficLog(tmp_path / "pod-a" / "traffic.jsonl", wall_clock=lambda: t0 + 4)  # pod-a restarts
    again.record(3000, 300)
    restarted = TrafficShipper(again.path, uri, client=s3_client, source="pod-a")
    assert restarted.shipped > 0  # from pod-a/traffic.jsonl.shipped
    restarted.ship()
    assert restarted.objects == 1
    assert len(_objects(s3_client, s3_bucket, "t/pod-a/")) == 2 and len(_objects(s3_client, s3_bucket, "t/pod-b/")) == 1
    folder = _download(s3_client, s3_bucket, "t/", tmp_path / "artifact")
    assert sorted(read_isl_osl(folder)) == [(1000, 100)] * 4 + [(3000, 300)]
    assert read_arrival_rate(folder) == 4 / 4.0  # 5 arrivals of both pods between t0 and t0 + 4 s


def test_while_s3_refuses_nothing_is_lost_and_it_is_said_once(tmp_path, s3_server, s3_client, s3_bucket, caplog):
    from runtime.staging.s3 import make_client

    log = TrafficLog(tmp_path / "traffic.jsonl")
    log.record(10, 1)
    refused = make_client(s3_server.endpoint_url, aws_access_key_id=s3_server.access_key_id,
                          aws_secret_access_key="not-the-secret", max_attempts=1)  # e.g. an IAM role without s3:PutObject
    uri = f"s3://{s3_bucket}/x/"
    ship = TrafficShipper(log.path, uri, client=refused, source="p")
    with caplog.at_level(logging.WARNING, logger="runtime.server.traffic"):
        assert ship.ship() == 0 and ship.ship() == 0
    warnings = [r.getMessage() for r in caplog.records if "traffic upload" in r.getMessage()]
    assert len(warnings) == 1 and f"s3://{s3_bucket}/x/p/" in warnings[0] and "not-the-secret" not in warnings[0]
    assert ship.shipped == 0 and _objects(s3_client, s3_bucket) == {}
    log.record(20, 2)
    fixed = TrafficShipper(log.path, uri, client=s3_client, source="p")  # the runtime restarted with its rights
    assert fixed.ship() == log.path.stat().st_size
    assert b"".join(_objects(s3_client, s3_bucket).values()) == log.path.read_bytes()
    log.close()


@pytest.mark.parametrize("uri, why", [
    ("https://bucket/x/", "must be an s3://"),
    ("s3://Bad_Bucket/x/", "not a valid S3 bucket name"),
    ("s3://bucket/x", "must end in '/'"),
    ("s3://bucket/a//b/", "empty, '.' or '..'"),
    ("s3://bucket/../b/", "empty, '.' or '..'"),
    ("s3://bucket/./", "empty, '.' or '..'"),
    ("s3://bucket/$(AWS_SECRET_ACCESS_KEY)/", "must not contain '\\$'"),
])
def test_bad_upload_uris_are_refused_by_name(uri, why):
    with pytest.raises(ValueError, match=why):
        check_upload_uri(uri)


def test_the_source_name_is_the_pod_name_made_safe(monkeypatch):
    monkeypatch.setenv("HOSTNAME", "llama8-predictor-00001-deployment-7d9f/x")
    assert traffic_source_name() == "llama8-predictor-00001-deployment-7d9f-x"
    assert traffic_source_name("a b") == "a-b"
    with pytest.raises(ValueError, match="no usable characters"):
        traffic_source_name("..")


def test_the_shipper_thread_ships_on_its_interval_and_once_more_at_close(tmp_path, s3_client, s3_bucket):
    log = TrafficLog(tmp_path / "traffic.jsonl")
    ship = TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p")
    log.record(1, 1)
    ship.start(0.05)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ship.objects == 0:
        time.sleep(0.05)
    assert ship.objects >= 1 and len(_objects(s3_client, s3_bucket)) >= 1  # without close: the interval did it
    with pytest.raises(ValueError, match="interval must be in"):
        TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="q").start(0)
    log.record(2, 2)
    log.close()
    ship.close()
    assert not ship._thread.is_alive()
    assert b"".join(b for _, b in sorted(_objects(s3_client, s3_bucket).items())) == log.path.read_bytes()


def test_the_runtime_process_ships_what_is_left_when_it_is_stopped(tmp_path, s3_server, s3_client, s3_bucket):
    """`python -m runtime.server --traffic-log … --traffic-upload …` with an interval longer than the test: the
    one shipment is the one at SIGTERM (what a pod's eviction triggers). Credentials and endpoint come from the
    environment (as IAM / $AWS_ENDPOINT_URL_S3 give them in a pod). The lines are appended from here: the
    shipper ships the file, whoever wrote it (the P/D flow's writes are tested in tests/unit/test_server_traffic)."""
    import httpx

    from runtime.engines.vllm_worker import free_port
    from runtime.procs import stop_process

    log = tmp_path / "traffic.jsonl"
    line = lambda n: json.dumps({"timestamp": 1_764_000_000_000 + n, "input_length": n, "output_length": 1,  # noqa: E731
                                 "hash_ids": []}) + "\n"
    log.write_text(line(1) + line(2))
    port = free_port()
    env = {**os.environ, **s3_server.env, "PYTHONPATH": str(REPO), "PDSERVE_HOME": str(tmp_path / "home")}
    args = [sys.executable, "-m", "runtime.server", "--model-name", "m", "--decode-url", "http://127.0.0.1:9",
            "--http-port", str(port), "--traffic-log", str(log),
            "--traffic-upload", f"s3://{s3_bucket}/traffic/", "--traffic-upload-interval-s", "3600",
            "--traffic-source", "pod-a"]
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline, live = time.monotonic() + 90, False
        while time.monotonic() < deadline and not live and proc.poll() is None:
            try:
                live = httpx.get(f"http://127.0.0.1:{port}/v2/health/live", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.3)
        assert live, proc.stderr.read().decode()[-2000:] if proc.poll() is not None else "not live in 90 s"
        assert _objects(s3_client, s3_bucket) == {}  # the interval has not come yet
        with log.open("a") as f:
            f.write(line(3))
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        stop_process(proc, 10)
    objs = _objects(s3_client, s3_bucket, "traffic/pod-a/")
    assert len(objs) == 1 and b"".join(objs.values()) == log.read_bytes()


def test_the_runtime_refuses_an_upload_without_a_log_or_with_a_bad_uri(tmp_path):
    base = [sys.executable, "-m", "runtime.server", "--model-name", "m", "--decode-url", "http://127.0.0.1:9"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PDSERVE_HOME": str(tmp_path)}
    res = subprocess.run(base + ["--traffic-upload", "s3://bucket/t/"], env=env, cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0 and "--traffic-upload needs --traffic-log" in res.stderr
    res = subprocess.run(base + ["--traffic-log", str(tmp_path / "t.jsonl"), "--traffic-upload", "s3://bucket/t"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "must end in '/'" in res.stderr


def test_a_shipped_log_past_the_compaction_size_is_emptied_and_continues_as_a_new_segment(tmp_path, s3_client,
                                                                                         s3_bucket):
    """A long-running pod's log must not outgrow its emptyDir: once all of it is shipped and it is past
    compact_bytes, it is emptied; the next lines go to a new segment whose objects sort after the old ones, so
    the objects in name order are still every recorded line once, in order."""
    clock = iter(1_764_000_000.0 + i for i in range(100))
    log = TrafficLog(tmp_path / "traffic.jsonl", wall_clock=lambda: next(clock))
    ship = TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p", traffic_log=log,
                          compact_bytes=150, wall_clock=lambda: next(clock))
    recorded = []
    for n in range(1, 8):
        log.record(n, 1)
        recorded.append((n, 1))
        ship.ship()
    assert log.path.stat().st_size < 150 * 2  # emptied along the way (7 lines of ~70 bytes were written)
    segments = {k.split("/")[-1].split("-")[0] for k in _objects(s3_client, s3_bucket)}
    assert len(segments) >= 2
    log.close()
    folder = _download(s3_client, s3_bucket, "t/", tmp_path / "artifact")
    assert read_isl_osl(folder) == recorded
    again = TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p")
    assert (again.segment, again.shipped) == (ship.segment, ship.shipped)  # a restart resumes the segment
    assert again.ship() == 0


def test_lines_written_while_the_shipper_looks_are_never_cut_off(tmp_path, s3_client, s3_bucket):
    """truncate_if_size empties the log only when nothing was written since the shipment."""
    log = TrafficLog(tmp_path / "traffic.jsonl")
    log.record(1, 1)
    size = log.path.stat().st_size
    log.record(2, 2)
    assert log.truncate_if_size(size) is False and log.path.stat().st_size == 2 * size
    assert log.truncate_if_size(2 * size) is True and log.path.stat().st_size == 0
    log.record(3, 3)
    assert read_isl_osl(log.path) == [(3, 3)]
    log.close()


class _LostAnswer:
    """An S3 client whose first PUT is stored but whose answer never arrives (a read timeout after the write)."""

    def __init__(self, client) -> None:  # noqa: ANN001
        self.client, self.lost = client, 0

    def put_object(self, **kw):  # noqa: ANN003, ANN201
        out = self.client.put_object(**kw)
        if self.lost == 0:
            self.lost += 1
            raise TimeoutError("read timeout after the PUT was stored")
        return out


def _trace(s3_client, bucket: str, prefix: str, dest: Path) -> list[tuple[int, int]]:  # noqa: ANN001
    return read_isl_osl(_download(s3_client, bucket, prefix, dest))


def test_a_put_whose_answer_was_lost_is_retried_with_the_same_range_not_a_larger_one(tmp_path, s3_client, s3_bucket):
    log = TrafficLog(tmp_path / "traffic.jsonl")
    ship = TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=_LostAnswer(s3_client), source="p")
    log.record(1, 1)
    log.record(2, 2)
    assert ship.ship() == 0  # stored, but the shipper cannot know
    log.record(3, 3)  # the log grows before the retry
    ship.ship()
    assert _trace(s3_client, s3_bucket, "t/", tmp_path / "a") == [(1, 1), (2, 2), (3, 3)]  # no line twice
    assert len(_objects(s3_client, s3_bucket)) == 2
    log.close()


def test_a_runtime_killed_between_put_and_state_resends_that_range_after_restart(tmp_path, s3_client, s3_bucket):
    log = TrafficLog(tmp_path / "traffic.jsonl")
    log.record(1, 1)
    TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=_LostAnswer(s3_client), source="p").ship()  # "killed"
    log.record(2, 2)  # the restarted runtime appends before its first shipment
    TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p").ship()
    assert _trace(s3_client, s3_bucket, "t/", tmp_path / "a") == [(1, 1), (2, 2)]
    log.close()


def test_a_stale_offset_never_ships_half_a_line_after_the_log_was_emptied_or_replaced(tmp_path, s3_client,
                                                                                      s3_bucket, caplog):
    log = TrafficLog(tmp_path / "traffic.jsonl")
    for n in (1, 2, 3):
        log.record(n, n)
    TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p").ship()
    log.truncate_if_size(log.path.stat().st_size)  # emptied, and the runtime died before saving the new segment
    for n in (4, 5, 6, 7):  # longer than what was shipped before
        log.record(n * 1000, n * 100)
    with caplog.at_level(logging.WARNING, logger="runtime.server.traffic"):
        TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p").ship()
    assert any("not the file shipped so far" in r.getMessage() for r in caplog.records)
    assert _trace(s3_client, s3_bucket, "t/", tmp_path / "a") == [(1, 1), (2, 2), (3, 3), (4000, 400), (5000, 500),
                                                                  (6000, 600), (7000, 700)]
    log.close()


def test_a_line_longer_than_a_shipment_is_skipped_not_a_stall(tmp_path, s3_client, s3_bucket, monkeypatch, caplog):
    import runtime.server.traffic as traffic

    monkeypatch.setattr(traffic, "MAX_SHIPMENT_BYTES", 256)
    log = TrafficLog(tmp_path / "traffic.jsonl")
    log.record(1, 1)
    with log.path.open("a") as f:  # not something the runtime writes: a foreign writer's 1000-byte "line"
        f.write("x" * 1000 + "\n")
    log.record(2, 2)
    ship = TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p")
    with caplog.at_level(logging.WARNING, logger="runtime.server.traffic"):
        ship.ship()
    assert ship.shipped == log.path.stat().st_size
    assert any("is not a trace line; skipped" in r.getMessage() for r in caplog.records)
    assert _trace(s3_client, s3_bucket, "t/", tmp_path / "a") == [(1, 1), (2, 2)]
    log.close()


def test_a_removed_log_is_reopened_and_what_follows_is_shipped(tmp_path, s3_client, s3_bucket, caplog):
    log = TrafficLog(tmp_path / "traffic.jsonl")
    ship = TrafficShipper(log.path, f"s3://{s3_bucket}/t/", client=s3_client, source="p", traffic_log=log)
    log.record(1, 1)
    ship.ship()
    log.path.unlink()  # e.g. an operator cleaning the folder
    with caplog.at_level(logging.WARNING, logger="runtime.server.traffic"):
        ship.ship()
    assert any("removed or replaced; reopened" in r.getMessage() for r in caplog.records)
    log.record(2, 2)
    ship.ship()
    assert _trace(s3_client, s3_bucket, "t/", tmp_path / "a") == [(1, 1), (2, 2)]
    log.close()


def test_segments_differ_even_when_the_clock_stands_still_or_steps_back(tmp_path):
    times = iter([100.0, 100.0, 99.0, 99.0])
    ship = TrafficShipper(tmp_path / "t.jsonl", "s3://bucket/t/", client=object(), source="p",
                          wall_clock=lambda: next(times))
    seen = [ship.segment]
    for _ in range(3):
        ship._start_segment()
        seen.append(ship.segment)
    assert seen == sorted(set(seen))  # strictly increasing: no object of an older segment is overwritten
