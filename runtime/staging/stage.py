"""`stage_model`: copy a model from S3 / a local folder / the Hugging Face Hub into the FSx path.

Steps (all under an exclusive per-model lock, see `runtime.staging.publish`):
1. list the source, reject unsafe keys, select files (include/exclude globs, safetensors over .bin);
2. if the published folder's manifest already lists the same (path, size, ETag) set → nothing to do;
3. unchanged files are hard-linked from the published folder into the staging folder, changed or
   new ones are fetched (concurrent ranged reads, resumable, verified: `runtime.staging.transfer`);
4. the manifest is written as the marker, and the staging folder replaces the destination atomically.
A failure leaves the destination untouched (the previous version or nothing) and keeps completed
parts in the staging folder for the next run.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtime.staging.keys import (
    MAX_NAME_BYTES,
    WEIGHT_SUFFIXES,
    UnsafeKeyError,
    check_paths,
    select_paths,
    weight_files,
)
from runtime.staging.manifest import (
    MARKER_NAME,
    DestinationError,
    Manifest,
    ManifestEntry,
    SourceSelectionError,
    StagingError,
    fsync_path,
    digest_mismatch,
    read_marker,
    verify_staged,
    write_marker,
)
from runtime.staging.publish import StageLock, check_free_space, publish, recover, sibling
from runtime.staging.sources import SourceObject, open_source
from runtime.staging.transfer import TransferEngine, TransferStats

log = logging.getLogger(__name__)


#: The staging errors that are a bad value given by the user (DEST, or SOURCE or its files as selected), found before
#: anything is copied: exit 2 (usage) in `pdserve stage` and `python -m runtime.staging`; other StagingErrors are 1.
BAD_VALUE_ERRORS: tuple[type[StagingError], ...] = (DestinationError, SourceSelectionError)


class StageOptions(BaseModel):
    """Tuning knobs of `stage_model` (all optional keyword arguments)."""

    model_config = ConfigDict(extra="forbid")

    include: list[str] | None = Field(default=None, description="Globs to take; None = safetensors+config+tokenizer.")
    exclude: list[str] = Field(default_factory=list, description="Globs to skip (after include).")
    prefer_safetensors: bool = Field(
        default=True, description="Skip .bin/.pth/.pt (and *.bin.index.json) in folders that hold safetensors.")
    concurrency: int = Field(
        default_factory=lambda: min(64, max(16, 4 * (os.cpu_count() or 2))),
        ge=1,
        le=256,
        description="Parallel ranged reads (threads); default 4 per CPU within 16..64 (measured on 2 "
        "cores: 16 beat 8 and 32, see bench/staging.py).",
    )
    part_size_bytes: int = Field(
        default=32 << 20,
        ge=4096,
        description="Bytes per ranged read and resume unit, independent of the objects' upload parts "
        "(the hasher splits at those itself). 32 MiB: botocore spends ~2 ms CPU per request, so fewer, "
        "larger GETs save CPU (measured on 2 cores: 2.0-2.2 vs 2.2-2.3 CPU s/GB at 8 MiB, "
        "bench/staging.py); memory does not grow with it (bodies stream in read_chunk_bytes).",
    )
    read_chunk_bytes: int = Field(
        default=4 << 20, ge=4096,
        description="Bytes per body read and write (memory/thread). 4 MiB: with the 'http' transport each "
        "thread reads into one reused page-aligned buffer and writes it with O_DIRECT, and fewer, larger "
        "calls cost less (2 cores, bench/staging.py: 0.77-0.84 vs 0.79-0.96 client CPU s/GB at 1 MiB); "
        "the 'botocore' transport did better at 1 MiB (urllib3 allocates a new buffer per read).",
    )
    max_attempts: int = Field(default=8, ge=1, description="Attempts per part on streaming errors.")
    backoff_initial_s: float = Field(default=0.2, ge=0, description="First retry backoff, seconds.")
    backoff_max_s: float = Field(default=10.0, ge=0, description="Largest retry backoff, seconds.")
    hash_workers: int = Field(
        default=4, ge=1,
        description="Threads hashing multi-part files in order, one file each at a time (hashlib releases "
        "the GIL; fsync and rename run in a separate pool). 4 beat 2 on 2 cores (4 large shards in "
        "bench/staging.py: 303-478 → 348-504 MB/s), 8 MiB buffer each.",
    )
    s3_transport: Literal["auto", "http", "botocore"] = Field(
        default="auto",
        description="How s3:// objects' bytes are fetched (listing and HEADs always use boto3): 'http' = GETs "
        "signed by botocore's SigV4 signer over http.client (GET + CRC32 + write on 2 cores: 0.67 vs 1.4-1.6 CPU "
        "s/GB with botocore's get_object, see runtime.staging.s3.S3HttpGetter); 'botocore' = the client's "
        "get_object; 'auto' = "
        "'http' unless the client uses a proxy or a non-SigV4 signer.",
    )
    fsync: bool = Field(default=True, description="fsync files and folders before publishing.")
    direct_io: bool = Field(
        default=True,
        description="Write downloaded chunks with O_DIRECT where the source hands page-aligned buffers (s3 "
        "transport 'http') and the filesystem supports it: no page-cache copy, no writeback in this process "
        "(see runtime.staging.transfer.TransferEngine).",
    )
    lock_timeout_s: float = Field(default=600.0, ge=0, description="Wait for another stager, seconds.")
    free_space_margin_bytes: int = Field(default=256 << 20, ge=0, description="Free space kept, bytes.")
    recheck_sha256: bool = Field(
        default=False,
        description="Re-hash the published files against their recorded digest before trusting them "
        "(catches bit rot).",
    )
    record_sha256: bool = Field(
        default=False,
        description="Also record each file's whole-file SHA-256 in the manifest when the source's checksum "
        "(S3 CRC/SHA-256 checksum, ETag) already verified it: one more pass over the bytes (~0.6 CPU s/GB).",
    )


@dataclass
class StageResult:
    """Outcome of one `Stager.run`."""

    manifest: Manifest
    path: Path
    unchanged: bool
    files_linked: int
    wall_s: float
    transfer: TransferStats


def _warn_nested_model(objs: list[SourceObject], uri: str) -> None:
    """Warn when the selection has no top-level config.json but a folder below has one: the source is
    probably one level above the model (the published folder would not be servable as it is)."""
    rels = [o.rel for o in objs]
    if "config.json" in rels:
        return
    nested = sorted(r.rsplit("/", 1)[0] for r in rels if r.endswith("/config.json"))
    if nested:
        log.warning("%s: no config.json at the top, but %s/config.json; a model folder needs it at the top "
                    "(did you mean %s/%s?)", uri, nested[0], uri.rstrip("/"), nested[0])


def _select(objs: list[SourceObject], opts: StageOptions, uri: str) -> list[SourceObject]:
    chosen = set(select_paths([o.rel for o in objs], opts.include, opts.exclude, opts.prefer_safetensors))
    unsafe = [o for o in objs if o.unsafe is not None and o.rel in chosen]
    if unsafe:
        raise UnsafeKeyError(unsafe[0].unsafe)
    for o in objs:
        if o.unsafe is not None:
            log.warning("%s (not selected: left out)", o.unsafe)
    out = [o for o in objs if o.rel in chosen]
    if not out:
        found = ", ".join(sorted(o.rel for o in objs)[:10])
        rule = f"include {opts.include or 'default'}" + (f" minus exclude {opts.exclude}" if opts.exclude else "")
        raise SourceSelectionError(f"source {uri}: no file matches {rule} (found: {found})")
    check_paths([o.rel for o in out])
    if opts.include is None and not weight_files(o.rel for o in out):
        # the default selection is a servable model folder: without weights vLLM fails only when it starts,
        # on GPU nodes, after tune and promote have accepted the folder
        found = ", ".join(sorted(o.rel for o in objs)[:10])
        raise SourceSelectionError(f"source {uri}: no weight file ({', '.join('*' + s for s in WEIGHT_SUFFIXES)}) among "
                           f"its files (found: {found}); vLLM loads safetensors or PyTorch checkpoints; pass "
                           "--include to stage other files anyway")
    return out


def _allocated_bytes(staging: Path, skip: set[str]) -> int:
    """Bytes already on disk in the staging folder (st_blocks: partial files are sparse)."""
    return sum(
        p.stat().st_blocks * 512
        for p in staging.rglob("*")
        if p.is_file() and p.relative_to(staging).as_posix() not in skip
    )


class Stager:
    """One staging run; see the module docstring. `run()` returns a `StageResult`."""

    def __init__(
        self, source: str, dest_dir: Path, *, s3_client: Any = None, options: StageOptions | None = None,
        progress: bool = False,
    ) -> None:
        self.uri = source
        self.dest = Path(dest_dir).absolute()
        self.s3_client = s3_client
        self.opts = options or StageOptions()
        self.progress = progress

    def run(self) -> StageResult:
        t0 = time.monotonic()
        if not self.dest.name:
            raise DestinationError(f"destination {self.dest}: a model folder path is needed (e.g. /fsx/models/<name>), "
                               "not a filesystem root")
        longest = sibling(self.dest, "staging").name
        if len(longest.encode()) > MAX_NAME_BYTES:
            raise DestinationError(f"destination name '{self.dest.name}' is too long: the stager works in '{longest}' "
                               f"beside it, over NAME_MAX ({MAX_NAME_BYTES} bytes)")
        source = open_source(self.uri, self.s3_client, self.opts.s3_transport)
        root = getattr(source, "root", None)  # a local folder source
        if root is not None:
            src, dst = Path(root).resolve(), self.dest.resolve()
            if src == dst or src in dst.parents or dst in src.parents:
                raise DestinationError(f"destination {self.dest} overlaps the source folder {src}: the published copy "
                                   "(and its marker) would land in what is copied; stage into a folder outside it")
        for path in (self.dest, sibling(self.dest, "staging"), sibling(self.dest, "old")):
            if path.is_symlink():  # staging through a link would write into another folder, unlocked
                raise DestinationError(f"{path} is a symbolic link; pass the real destination path "
                                   f"({self.dest.resolve()})" if path == self.dest else
                                   f"{path} is a symbolic link, not pdserve's own folder; remove it")
        for parent in self.dest.parents:
            if parent.exists() and not parent.is_dir():
                raise DestinationError(f"destination {self.dest}: {parent} is a file, not a folder")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        with StageLock(self.dest, self.opts.lock_timeout_s):
            recover(self.dest)
            objs = _select(source.list_objects(), self.opts, self.uri)
            current = self._current()
            if current is None and self.dest.exists():
                if self.dest.is_dir() and not any(self.dest.iterdir()):
                    self.dest.rmdir()
                else:
                    raise DestinationError(
                        f"{self.dest} exists but is not a pdserve-staged folder (no valid marker); "
                        "refusing to replace it — move it away or choose another destination"
                    )
            if current and current.source == self.uri and self._same(current, objs) and self._intact():
                return StageResult(current, self.dest, True, 0, time.monotonic() - t0, TransferStats())
            if current is not None:
                self._refuse_foreign_files(current)
            _warn_nested_model(objs, self.uri)
            staging = sibling(self.dest, "staging")
            staging.mkdir(exist_ok=True)
            linked = self._link_unchanged(current, objs, staging)
            to_fetch = [o for o in objs if o.rel not in linked]
            need = max(0, sum(o.size_bytes for o in to_fetch) - _allocated_bytes(staging, set(linked)))
            check_free_space(self.dest.parent, need, self.opts.free_space_margin_bytes)
            stats, fetched = self._fetch(source, to_fetch, staging, sum(o.size_bytes for o in objs) - sum(
                e.size_bytes for e in linked.values()))
            by_rel = {**linked, **{e.path: e for e in fetched}}
            manifest = Manifest(source=self.uri, source_revision=source.revision, files=[by_rel[o.rel] for o in sorted(objs, key=lambda o: o.rel)])
            self._prune(staging, set(by_rel))
            write_marker(staging, manifest)
            publish(staging, self.dest)
        return StageResult(manifest, self.dest, False, len(linked), time.monotonic() - t0, stats)

    # ---- helpers ---------------------------------------------------------------------------------
    def _current(self) -> Manifest | None:
        if not self.dest.exists():
            return None
        try:
            return read_marker(self.dest)
        except StagingError:
            return None

    def _refuse_foreign_files(self, current: Manifest) -> None:
        """Publishing replaces the whole folder: refuse while it holds files the stager did not publish
        (someone's notes, a fine-tuned shard), links, empty or unreadable folders, which would otherwise
        vanish without a word.

        Raises:
            StagingError: naming up to 5 of them.
        """
        known = set(current.by_path()) | {MARKER_NAME}

        def rel(path: str) -> str:
            return os.path.relpath(path, self.dest).replace(os.sep, "/")

        found: list[str] = []  # os.walk follows no link; a folder it cannot read is named, not skipped
        for d, dirs, files in os.walk(self.dest, onerror=lambda e: found.append(rel(e.filename) + "/")):
            for name in dirs:  # a link to a folder, or an empty folder: no file below it would be named
                full = os.path.join(d, name)
                try:
                    empty = not os.path.islink(full) and not os.listdir(full)
                except OSError:
                    continue  # unreadable: onerror names it when the walk gets there
                if os.path.islink(full) or empty:
                    found.append(rel(full) + "/")
            found += [r for r in (rel(os.path.join(d, f)) for f in files) if r not in known]
        foreign = sorted(found)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise StagingError(f"{self.dest} holds {len(foreign)} file(s) or folder(s) the stager did not publish "
                               f"({shown}); a new version replaces the whole folder, so move them out first")

    def _intact(self) -> bool:
        if not self.opts.recheck_sha256:
            return True
        try:
            verify_staged(self.dest, check_digests=True)
            return True
        except StagingError:
            return False

    def _same(self, m: Manifest, objs: list[SourceObject]) -> bool:
        if self.opts.record_sha256 and any(f.sha256 is None for f in m.files):
            return False  # asked for SHA-256s the published manifest lacks
        have = {(f.path, f.size_bytes, f.etag) for f in m.files}
        if have != {(o.rel, o.size_bytes, o.etag) for o in objs}:
            return False
        return all((self.dest / f.path).is_file() and (self.dest / f.path).stat().st_size == f.size_bytes for f in m.files)

    def _link_unchanged(self, current: Manifest | None, objs: list[SourceObject], staging: Path) -> dict[str, ManifestEntry]:
        """Hard-link files whose (path, size, ETag) did not change from the published folder and whose published
        copy still has its recorded size (with `recheck_sha256`, its recorded digest too)."""
        linked: dict[str, ManifestEntry] = {}
        if current is None:
            return linked
        old = current.by_path()
        for o in objs:
            e = old.get(o.rel)
            src = self.dest / o.rel
            if not e or e.size_bytes != o.size_bytes or e.etag != o.etag or not src.is_file():
                continue
            if src.stat().st_size != e.size_bytes:
                continue  # the published copy was truncated or grew: fetch it again
            if self.opts.record_sha256 and e.sha256 is None:
                continue  # fetched again so its SHA-256 gets recorded
            if self.opts.recheck_sha256 and digest_mismatch(self.dest, e):
                continue  # bit rot in the published copy: fetch it again
            dst = staging / o.rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.unlink(missing_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
            linked[o.rel] = e
        return linked

    def _fetch(self, source: Any, objs: list[SourceObject], staging: Path, total_bytes: int) -> tuple[TransferStats, list[ManifestEntry]]:
        o = self.opts
        kwargs = dict(
            concurrency=o.concurrency, part_size_bytes=o.part_size_bytes, read_chunk_bytes=o.read_chunk_bytes,
            max_attempts=o.max_attempts, backoff_initial_s=o.backoff_initial_s, backoff_max_s=o.backoff_max_s,
            hash_workers=o.hash_workers, fsync=o.fsync, record_sha256=o.record_sha256,
            direct_io=o.direct_io,
        )
        if not self.progress:
            eng = TransferEngine(source, staging, **kwargs)
            return eng.stats, eng.fetch(objs)
        from rich.console import Console
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        with Progress(
            TextColumn("[bold]stage[/] {task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), transient=False,
            console=Console(stderr=True),  # stdout stays for results (`python -m runtime.staging`'s JSON line)
        ) as bar:
            task = bar.add_task(self.dest.name, total=total_bytes)
            eng = TransferEngine(source, staging, on_bytes=lambda n: bar.advance(task, n), **kwargs)
            entries = eng.fetch(objs)
        return eng.stats, entries

    def _prune(self, staging: Path, keep: set[str]) -> None:
        """Remove journals, partial files and files not in the manifest from the staging folder."""
        shutil.rmtree(staging / ".pdserve-journal", ignore_errors=True)
        for p in sorted(staging.rglob("*"), reverse=True):
            rel = p.relative_to(staging).as_posix()
            if p.is_file() and rel not in keep:
                p.unlink()
            elif p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        if self.opts.fsync:
            for d in {(staging / r).parent for r in keep}:
                fsync_path(d)


def stage_model(
    source: str, dest_dir: Path, *, s3_client: Any = None, progress: bool = True, **opts: Any
) -> Manifest:
    """Stage a model into `dest_dir` (e.g. ``.pdserve/fsx/models/<name>``) and return its manifest.

    Args:
        source: ``s3://bucket/prefix``, ``hf://org/name[@rev][/sub]``, ``file://…`` or a local folder.
        dest_dir: published model folder; created/replaced atomically, holds the marker file.
        s3_client: boto3 S3 client for s3:// sources (None → `make_client()` from the environment).
        progress: show a rich progress bar (bytes, rate, ETA) and a final summary on stderr.
        **opts: `StageOptions` fields (include, exclude, concurrency, part_size_bytes, …).

    Returns:
        The published `Manifest` (key, path, size, ETag, verified checksum and/or SHA-256 per file).

    Raises:
        StagingError: missing bucket, empty prefix, unsafe key, checksum mismatch, not enough free space,
            lock timeout, unknown option — the message names the key/field. The destination is never left
            half-written.
        SourceSelectionError: (a StagingError) no file matches the selection, or the default selection holds
            no weight file; nothing is copied.
    """
    try:
        options = StageOptions(**opts)
    except ValidationError as e:
        first = e.errors()[0]
        raise StagingError(f"stage option '{'.'.join(map(str, first['loc']))}': {first['msg']}") from e
    res = Stager(source, dest_dir, s3_client=s3_client, options=options, progress=progress).run()
    if progress:
        from rich.console import Console

        t = res.transfer
        mb = (t.bytes_downloaded) / 1e6
        Console(stderr=True).print(
            f"[green]staged[/] {res.path} — {len(res.manifest.files)} files, "
            f"{res.manifest.total_bytes / 1e6:.1f} MB; "
            + ("unchanged, nothing fetched" if res.unchanged else
               f"fetched {mb:.1f} MB in {res.wall_s:.1f} s ({mb / max(res.wall_s, 1e-9):.1f} MB/s), "
               f"resumed {t.bytes_resumed / 1e6:.1f} MB, linked {res.files_linked} unchanged files"),
            soft_wrap=True,  # one line in a log, the path whole; a terminal wraps it where it must
        )
    return res.manifest
