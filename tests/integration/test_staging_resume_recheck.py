"""Specification: a resumed run does not take journaled parts on trust. A node crash can leave a part's
journal line on disk while the part's data pages never reached it; the next run re-reads every journaled
part from the staging file and compares it with the digests in the journal, fetches again the parts that
differ, and publishes only verified bytes (real SeaweedFS on 127.0.0.1, composite and full-object checks)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from runtime.staging.manifest import StagingError, sha256_file, verify_staged
from runtime.staging.publish import sibling
from runtime.staging.s3 import upload_folder
from runtime.staging.sources import S3Source
from runtime.staging.stage import Stager, StageOptions
from runtime.staging.transfer import JOURNAL_DIR

pytestmark = pytest.mark.integration
MiB = 1 << 20


class FailingLastPart(S3Source):
    """S3 source whose ranged read of the object's last MiB fails (not retryable): the run stops after
    journaling the other parts."""

    def read_range(self, obj, start, end, chunk_bytes):  # noqa: ANN001, ANN201
        if end == obj.size_bytes and start > 0:
            raise StagingError(f"object '{obj.key}': injected failure")
        return super().read_range(obj, start, end, chunk_bytes)


@pytest.mark.parametrize("algorithm", ["SHA256", "CRC64NVME"])
def test_a_journaled_part_whose_bytes_were_lost_is_fetched_again(s3_client, s3_bucket, tmp_path: Path,
                                                                  monkeypatch, algorithm: str) -> None:  # noqa: ANN001
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(16 * MiB + 333)  # 4 upload parts of 5 MiB
    (src / "model.safetensors").write_bytes(data)
    upload_folder(src, s3_bucket, "m", s3_client, multipart_chunk_bytes=5 * MiB, checksum_algorithm=algorithm)
    uri, dest = f"s3://{s3_bucket}/m", tmp_path / "fsx" / "m"
    opts = StageOptions(part_size_bytes=MiB, concurrency=1, include=["*"])  # parts in order: the last fails

    import runtime.staging.stage as stage_mod

    monkeypatch.setattr(stage_mod, "open_source", lambda uri, client, transport="auto": FailingLastPart(uri, client, transport))
    with pytest.raises(StagingError, match="injected failure"):
        Stager(uri, dest, s3_client=s3_client, options=opts).run()
    monkeypatch.undo()
    staging = sibling(dest, "staging")
    journal = next((staging / JOURNAL_DIR).glob("*.parts"))
    journaled = [int(line.split()[0]) for line in journal.read_text().splitlines()[1:] if line]
    assert journaled, "the first run should have journaled some parts"
    part_file = staging / "model.safetensors.pdserve-part"
    part_size = json.loads(journal.read_text().splitlines()[0])["part"]  # ranges hold whole upload parts
    lost = journaled[0]
    with open(part_file, "r+b") as f:  # the "crash": that part's pages never reached the disk
        f.seek(lost * part_size + 100)
        f.write(b"\0" * 4096)

    res = Stager(uri, dest, s3_client=s3_client, options=opts).run()
    assert sha256_file(dest / "model.safetensors") == hashlib.sha256(data).hexdigest()
    assert verify_staged(dest) == res.manifest
    assert res.transfer.parts_downloaded >= 2  # the lost part again, and the part that failed
    assert res.transfer.parts_resumed == len(journaled) - 1  # the intact journaled parts were kept
