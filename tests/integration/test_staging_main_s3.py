"""`python -m runtime.staging` against a real S3 server (SeaweedFS on 127.0.0.1): an s3:// source
with --endpoint-url and credentials from the environment, verified against the objects' checksums;
wrong credentials fail with exit 1 and never print the secret."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.staging.manifest import read_marker
from runtime.staging.s3 import upload_folder

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **env, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "runtime.staging", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)


def test_stages_s3_prefix_with_endpoint_url(s3_server, s3_client, s3_bucket, tmp_path: Path) -> None:  # noqa: ANN001
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"hidden_size": 64}')
    (src / "model.safetensors").write_bytes(os.urandom(6 << 20))  # multipart: composite checksum
    upload_folder(src, s3_bucket, "org/m", s3_client, multipart_chunk_bytes=5 << 20, checksum_algorithm="CRC32")
    creds = {k: v for k, v in s3_server.env.items() if k != "AWS_ENDPOINT_URL_S3"}
    dest = tmp_path / "fsx" / "m"
    r = _run(creds, f"s3://{s3_bucket}/org/m/", str(dest), "--endpoint-url", s3_server.endpoint_url,
             "--part-size-mib", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["files"] == 2 and out["fetched_bytes"] == out["bytes"] == (6 << 20) + len('{"hidden_size": 64}')
    m = read_marker(dest)
    assert {f.verified_by for f in m.files} == {"checksum-crc32"}
    assert (dest / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()

    secret = "wrong-secret-0123456789abcdef"
    bad = _run({**creds, "AWS_SECRET_ACCESS_KEY": secret}, f"s3://{s3_bucket}/org/m/", str(tmp_path / "m2"),
               "--endpoint-url", s3_server.endpoint_url)
    assert bad.returncode == 1 and bad.stderr.startswith("error: ")
    assert secret not in bad.stderr + bad.stdout
    assert not (tmp_path / "m2").exists()
