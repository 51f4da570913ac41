"""Specification: a stager killed with SIGKILL at a random moment (10 runs, real S3 server on
loopback) never leaves the destination visible without a valid marker, and the next run resumes
from the completed parts to a verified model. Two concurrent stagers of one model do not corrupt
each other."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from runtime.paths import REPO_ROOT
from runtime.staging.manifest import StagingError, sha256_file, verify_staged
from runtime.staging.publish import sibling
from runtime.staging.s3 import upload_folder
from runtime.staging.stage import Stager, StageOptions
from runtime.staging.transfer import JOURNAL_DIR

pytestmark = pytest.mark.integration
MiB = 1 << 20
OPTS = {"part_size_bytes": 256 * 1024, "concurrency": 2, "read_chunk_bytes": 64 * 1024}
# PART_DELAY_S: each part the child fetches takes this much longer, so its transfer lasts seconds (six ranged
# GETs, two at a time: the stager raises a range to the 5 MiB upload part) and a kill meant for mid-transfer
# lands there even when this test's process is paused for a second or more on a loaded machine (loopback
# alone moves the whole model in under a second).
PART_DELAY_S = 1.0
CHILD = """
import json, sys, time
from pathlib import Path
from runtime.staging import transfer
from runtime.staging.s3 import make_client
from runtime.staging.stage import stage_model
_fetch_part = transfer.TransferEngine._fetch_part
def _slow_fetch_part(self, fs, idx):
    out = _fetch_part(self, fs, idx)
    time.sleep(float(sys.argv[4]))
    return out
transfer.TransferEngine._fetch_part = _slow_fetch_part
client = make_client()  # imports boto3: keep start-up out of the kill window
print("START", flush=True)
stage_model(sys.argv[1], Path(sys.argv[2]), s3_client=client, progress=False, **json.loads(sys.argv[3]))
print("DONE", flush=True)
"""


@pytest.fixture(scope="module")
def source(s3_server, tmp_path_factory) -> tuple[str, dict[str, str]]:  # noqa: ANN001
    d = tmp_path_factory.mktemp("resume-model")
    sizes = {"model-00001-of-00003.safetensors": 14 * MiB, "model-00002-of-00003.safetensors": 9 * MiB,
             "model-00003-of-00003.safetensors": 3 * MiB + 123, "config.json": 300, "tokenizer.json": 4000}
    digests = {}
    for name, n in sizes.items():
        data = os.urandom(n)
        (d / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    client = s3_server.client()
    bucket = "resume-test"
    upload_folder(d, bucket, "m", client, multipart_chunk_bytes=5 * MiB)
    return f"s3://{bucket}/m", digests


class MarkerWatcher(threading.Thread):
    """Polls the destination every few ms; records any moment it exists without a valid marker."""

    def __init__(self, dest: Path) -> None:
        super().__init__(daemon=True)
        self.dest, self.violations, self.seen_published, self.stop = dest, [], 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            if self.dest.exists():
                try:
                    verify_staged(self.dest, check_digests=False)
                    self.seen_published += 1
                except StagingError as e:
                    if self.dest.exists():  # vanished between the two calls is fine
                        self.violations.append(str(e))
            time.sleep(0.003)


def _start_child(s3_server, uri: str, dest: Path) -> subprocess.Popen:  # noqa: ANN001
    import json

    env = {**os.environ, **s3_server.env, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, uri, str(dest), json.dumps(OPTS), str(PART_DELAY_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO_ROOT, text=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait_for_journaled_part(dest: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Poll the staging area until some per-file journal holds a part index (its first line is a header)."""
    journal_dir = sibling(dest, "staging") / JOURNAL_DIR
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for j in journal_dir.glob("*.parts") if journal_dir.exists() else []:
            try:
                if len(j.read_text().splitlines()) >= 2:
                    return
            except FileNotFoundError:
                continue
        time.sleep(0.001)
    raise AssertionError("no part was journaled before the child finished or timed out")


def test_kill9_at_random_points_always_resumes_to_a_verified_model(s3_server, source, tmp_path) -> None:  # noqa: ANN001
    uri, digests = source
    client = s3_server.client()
    # the random kills below span a child's whole run, publishing included: time one from its START
    proc = _start_child(s3_server, uri, tmp_path / "calibrate")
    try:
        assert proc.stdout.readline().strip() == "START"
        t0 = time.monotonic()
        assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
        transfer_s = time.monotonic() - t0
    finally:
        _stop(proc)
    rng = random.Random(20261130)
    resumed_runs = 0
    for run in range(10):
        dest = tmp_path / f"run{run}" / "m"
        dest.parent.mkdir()
        watcher = MarkerWatcher(dest)
        watcher.start()
        for _kill in range(1 + run % 2):  # odd runs are killed twice before resuming
            proc = _start_child(s3_server, uri, dest)
            try:
                assert proc.stdout.readline().strip() == "START"
                if run % 3 == 0:
                    # Deterministic mid-transfer kill: right after the first part is journaled. The random
                    # delays below are calibrated in-process and may all miss on a loaded machine.
                    _wait_for_journaled_part(dest, proc)
                else:
                    time.sleep(rng.uniform(0.0, 1.3 * transfer_s))
                proc.kill()  # SIGKILL: no cleanup handlers run
                proc.wait(timeout=10)
            finally:
                _stop(proc)
        res = Stager(uri, dest, s3_client=client, options=StageOptions(**OPTS)).run()
        watcher.stop.set()
        watcher.join()
        assert watcher.violations == [], f"run {run}: destination visible without valid marker"
        m = verify_staged(dest)
        assert {f.path: sha256_file(dest / f.path) for f in m.files} == digests, f"run {run}"
        assert not sibling(dest, "staging").exists() and not sibling(dest, "old").exists()
        if res.transfer.bytes_resumed or res.transfer.files_resumed_verified:
            resumed_runs += 1
            assert res.transfer.bytes_downloaded < m.total_bytes  # only the missing parts were fetched
    assert resumed_runs >= 3, "kills should land mid-transfer in several runs (check timing)"


def test_two_concurrent_stagers_publish_one_verified_model(s3_server, source, tmp_path) -> None:  # noqa: ANN001
    uri, digests = source
    dest = tmp_path / "m"
    procs = [_start_child(s3_server, uri, dest) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            _stop(p)
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    m = verify_staged(dest)
    assert {f.path: sha256_file(dest / f.path) for f in m.files} == digests
