"""`pdserve stage`: options → runtime.staging.stage.stage_model (FSx link optional) → one summary line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from runtime.faces.common import fail, usage, option_errors


def stage(
    source: Annotated[str, typer.Argument(
        help="s3://bucket/prefix/, hf://org/repo (or hf://org/repo@revision), or a local folder.",
        metavar="SOURCE")],
    dest: Annotated[Path, typer.Argument(
        help="Model folder to publish, e.g. /fsx/models/<name>.", metavar="DEST")],
    endpoint_url: Annotated[Optional[str], typer.Option(help="S3 endpoint (SeaweedFS/MinIO); default AWS.")] = None,
    include: Annotated[Optional[list[str]], typer.Option(
        metavar="GLOB",
        help="Glob of files to take (repeatable). Default: safetensors + config + tokenizer files (the HF layout); "
             "--include '*' takes everything.")] = None,
    exclude: Annotated[Optional[list[str]], typer.Option(
        metavar="GLOB", help="Glob of files to skip (repeatable).")] = None,
    concurrency: Annotated[Optional[int], typer.Option(
        help="Concurrent ranged GETs, 1 to 256 (default: 4 per CPU, within 16..64).")] = None,
    s3_transport: Annotated[str, typer.Option(
        help="How s3:// bytes are fetched: 'http' (SigV4-signed GETs over http.client, about half botocore's CPU "
             "per byte), 'botocore' (the client's get_object), or 'auto' (http unless a proxy or a non-SigV4 "
             "signer is configured).")] = "auto",
    prefer_safetensors: Annotated[bool, typer.Option(
        "--prefer-safetensors/--no-prefer-safetensors",
        help="Skip .bin/.pth/.pt weights in folders that hold safetensors (duplicate PyTorch checkpoints).")] = True,
    direct_io: Annotated[bool, typer.Option(
        "--direct-io/--no-direct-io",
        help="Write downloaded chunks with O_DIRECT where the filesystem supports it (falls back by itself; "
             "--no-direct-io keeps every write in the page cache).")] = True,
    recheck_sha256: Annotated[bool, typer.Option(
        "--recheck-sha256",
        help="Re-hash the published files against their recorded digests before trusting them as unchanged "
             "(catches a copy corrupted in place; one read of every published byte).")] = False,
    fsx_file_system_id: Annotated[Optional[str], typer.Option(
        help="FSx mode (needs --fsx-path and an s3:// SOURCE): link SOURCE into this FSx for Lustre file system "
             "(data repository association), import and preload it (lfs hsm_restore when lfs is on PATH), then "
             "stage the linked folder into DEST.")] = None,
    fsx_path: Annotated[Optional[str], typer.Option(
        help="File-system path of the association, e.g. /s3/<name> (not DEST's own path).")] = None,
    fsx_mount: Annotated[Optional[Path], typer.Option(
        help="Where the FSx file system is mounted (default: the mount point holding DEST).")] = None,
    fsx_timeout_s: Annotated[float, typer.Option(
        min=0.001, help="FSx mode: seconds for association + import + preload together.")] = 3600.0,
) -> None:
    """Stage a model into a folder (the FSx mount): concurrent, resumable, verified, published atomically.

    Credentials come from the usual AWS chain (env, profile, Pod Identity/IRSA); they are never printed.
    Prints one summary line (files, MB, rate) on stderr when done. With --fsx-file-system-id/--fsx-path the
    bytes come from S3 through FSx's own S3 link (see `python -m runtime.staging --help`).
    """
    from pydantic import ValidationError

    from runtime.staging.manifest import StagingError
    from runtime.staging.s3 import make_client
    from runtime.staging.stage import StageOptions, stage_model

    opts: dict = {"s3_transport": s3_transport, "direct_io": direct_io, "prefer_safetensors": prefer_safetensors,
                  "recheck_sha256": recheck_sha256}
    if concurrency is not None:
        opts["concurrency"] = concurrency
    if include:
        opts["include"] = include
    if exclude:
        opts["exclude"] = exclude
    try:
        StageOptions(**opts)  # bad options fail before any client is made
    except ValidationError as e:
        usage(option_errors(e, {"concurrency": "--concurrency", "include": "--include", "exclude": "--exclude",
                                 "s3_transport": "--s3-transport"}))
    from runtime.staging.sources import check_source

    fsx_mode = fsx_file_system_id is not None or fsx_path is not None
    if fsx_mode:  # the option combination first: it says which SOURCE this mode needs
        from runtime.staging import fsx

        problem = fsx.fsx_options_error(fsx_file_system_id, fsx_path, source)
        if problem:
            usage(problem)
    try:
        check_source(source)  # a malformed or missing SOURCE is a bad value, refused before any client is made
    except StagingError as e:
        usage(str(e))
    client = None
    if fsx_mode:
        try:
            fsx_client = fsx.make_fsx_client()
        except Exception as e:  # noqa: BLE001 - botocore: no region, bad config file, ...
            fail(f"cannot create the FSx client: {e or type(e).__name__}")
        try:
            from runtime.staging.keys import select_paths

            def select(rels: list[str]) -> list[str]:  # preload only what the stage will copy
                return select_paths(rels, opts.get("include"), opts.get("exclude", ()), prefer_safetensors)

            source = str(fsx.preload_source(fsx_client, file_system_id=fsx_file_system_id, file_system_path=fsx_path,
                                            s3_uri=source, dest=dest, mount_root=fsx_mount, timeout_s=fsx_timeout_s,
                                            select=select))
        except StagingError as e:
            fail(str(e))
        except OSError as e:  # the mount: missing, unreadable
            fail(f"FSx mount: {e.strerror or e} ({e.filename})")
    elif source.startswith("s3://"):
        try:
            client = make_client(endpoint_url, transfer_methods=False)
        except Exception as e:  # noqa: BLE001 - botocore: invalid endpoint or region, bad config file, ...
            fail(f"cannot create the S3 client: {e or type(e).__name__}")
    from runtime.staging.stage import BAD_VALUE_ERRORS

    try:
        stage_model(source, dest, s3_client=client, progress=True, **opts)  # prints the summary itself
    except BAD_VALUE_ERRORS as e:
        usage(str(e))
    except StagingError as e:
        fail(str(e))
    except OSError as e:  # the destination side: read-only or missing mount, permissions, no space
        fail(f"{dest}: {e.strerror or e} ({e.filename or dest}); the destination keeps its previous version")

