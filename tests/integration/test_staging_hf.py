"""Specification of the `hf://` source: listing through huggingface_hub's API client, ranged
downloads from the resolve URL, LFS files verified against the Hub's sha256 and small files
against their git blob id; the branch or tag is resolved to its commit once and every file is listed and
downloaded at that commit, which the marker records. The Hub is not reachable from CI, so a minimal Hub (the
three HTTP routes huggingface_hub and the stager use, with Range support) runs on 127.0.0.1 via HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from runtime.staging.manifest import StagingError, verify_staged
from runtime.staging.stage import stage_model

pytestmark = pytest.mark.integration

FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 64}',
    "model.safetensors": os.urandom(700_000),
    "tokenizer.json": b'{"version": "1.0"}',
    "pytorch_model.bin": os.urandom(2000),
    "README.md": b"# tiny",
}
LFS = {"model.safetensors", "pytorch_model.bin"}
COMMIT = "3f1c0ffee0ddba11c0de5eed0fab1e5deadbeef0"
REFS = {"main": COMMIT, "v1": COMMIT}  # the Hub serves files at the commit only, never at a moving ref


def _blob(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class Hub(BaseHTTPRequestHandler):
    corrupt = False

    def log_message(self, *a: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:  # noqa: N802
        if m := re.match(r"^/api/models/org/tiny/revision/([^/?]+)", self.path):
            sha = REFS.get(m.group(1))
            if sha is None:
                return self._send(404, b'{"error": "Revision Not Found"}', "application/json")
            self._send(200, json.dumps({"id": "org/tiny", "modelId": "org/tiny", "sha": sha}).encode(),
                       "application/json")
        elif m := re.match(rf"^/api/models/org/tiny/tree/{COMMIT}", self.path):
            body = json.dumps([
                {"type": "file", "oid": _blob(d), "size": len(d), "path": p,
                 **({"lfs": {"oid": hashlib.sha256(d).hexdigest(), "size": len(d), "pointerSize": 134}} if p in LFS else {})}
                for p, d in FILES.items()
            ]).encode()
            self._send(200, body, "application/json")
        elif m := re.match(rf"^/org/tiny/resolve/{COMMIT}/(.+)$", self.path):
            data = FILES.get(m.group(1))
            if data is None:
                return self._send(404, b"not found", "text/plain")
            if Hub.corrupt and m.group(1) == "model.safetensors":
                data = data[:1000] + bytes([data[1000] ^ 1]) + data[1001:]
            rng = self.headers.get("Range")
            if rng:
                a, b = (int(x) for x in rng.split("=")[1].split("-"))
                self._send(206, data[a : b + 1], "application/octet-stream", {"Content-Range": f"bytes {a}-{b}/{len(data)}"})
            else:
                self._send(200, data, "application/octet-stream")
        else:
            self._send(404, b"{}", "application/json")

    def _send(self, code: int, body: bytes, ctype: str, headers: dict | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    try:
        yield Hub
    finally:
        Hub.corrupt = False
        srv.shutdown()
        srv.server_close()


def test_hf_source_stages_and_verifies_against_hub_hashes(hub, tmp_path: Path) -> None:  # noqa: ANN001
    m = stage_model("hf://org/tiny", tmp_path / "m", progress=False, part_size_bytes=128 * 1024)
    by = m.by_path()
    assert sorted(by) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert by["model.safetensors"].verified_by == "source-sha256"
    assert by["config.json"].verified_by == "git-blob-sha1"
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    verify_staged(tmp_path / "m")
    assert m.source_revision == COMMIT  # what was staged, whatever main points at later


def test_a_tag_is_staged_at_its_commit_and_an_unknown_one_is_refused(hub, tmp_path: Path) -> None:  # noqa: ANN001
    assert stage_model("hf://org/tiny@v1", tmp_path / "m", progress=False).source_revision == COMMIT
    with pytest.raises(StagingError, match="cannot list the Hub repo"):
        stage_model("hf://org/tiny@v2", tmp_path / "n", progress=False)
    assert not (tmp_path / "n").exists()


def test_hf_bytes_not_matching_the_lfs_sha256_are_rejected(hub, tmp_path: Path) -> None:  # noqa: ANN001
    hub.corrupt = True
    with pytest.raises(StagingError, match="'model.safetensors': SHA-256 mismatch"):
        stage_model("hf://org/tiny", tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_malformed_hf_uri(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match="expected hf://org/name"):
        stage_model("hf://justonename", tmp_path / "m", progress=False)
    assert not tmp_path.joinpath("m").exists()
