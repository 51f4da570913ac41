"""`python -m runtime.staging SOURCE DEST`: the stager as a lean one-shot process.

For containers that only stage (a Kubernetes Job or init container, an Argo step): the same
`Stager` as `pdserve stage` and the KFP `stage-weights` component, without the CLI's typer/rich
start-up (~0.25 s here). Prints ONE JSON line on stdout when done::

    {"path": "/fsx/models/m", "files": 5, "bytes": 1052000, "unchanged": false,
     "fetched_bytes": 1052000, "resumed_bytes": 0, "linked_files": 0, "refetched_files": 0,
     "wall_s": 0.21}

Exit status, as `pdserve stage` gives it for the same case, with the same `error:` line: 0 staged (or
already up to date), 1 staging failed (the message, naming the key or option, on stderr; the destination
keeps its previous version or stays absent), 2 bad arguments or a bad value found before anything is
copied (a SOURCE that is malformed, missing or empty, or holds no file of the selection or no weights; a
DEST that cannot be staged into), 3 staged but the JSON line could not be written (stdout closed or full),
130 interrupted (completed parts stay for the next run). Warnings (a file fetched again after a failed check,
waiting for another stager's lock) go to stderr.

Credentials come from the default AWS chain (env, profile, Pod Identity / IRSA); they are never
printed. ``--endpoint-url`` (or AWS_ENDPOINT_URL_S3) points at an S3-compatible server.

FSx mode (opt-in, s3:// sources): ``--fsx-file-system-id fs-… --fsx-path /s3/<name>`` links the S3
prefix at that file-system path (a data repository association, found or created), imports its
metadata, preloads the files with `lfs hsm_restore` when `lfs` is on PATH, then stages the linked
folder (``--fsx-mount``/<path>, on the same Lustre file system) into DEST as a local folder: the
bytes come from S3 once, through FSx, and DEST is still verified and published with its marker.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SUMMARY, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _int_at_least(least: int):  # noqa: ANN202 - an argparse type
    """argparse type: a whole number >= `least`, the message in the option's own unit."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {v}")
        return v

    return parse


_positive_int, _nonnegative_int = _int_at_least(1), _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return v


def _endpoint(text: str) -> str:
    from urllib.parse import urlsplit

    try:
        u = urlsplit(text)
        u.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({e})") from None
    if u.scheme not in ("http", "https") or not u.hostname:
        raise argparse.ArgumentTypeError(f"expected http(s)://host[:port], got {text!r}")
    return text


def _dest(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("empty destination; give the model folder, e.g. /fsx/models/<name>")
    return Path(text)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the docs test: every option has a help text)."""
    ap = argparse.ArgumentParser(
        prog="python -m runtime.staging",
        description="Stage a model from s3://bucket/prefix/, hf://org/repo or a local folder into DEST "
        "(the FSx for Lustre mount): concurrent ranged reads, every byte verified, published atomically "
        "with a marker file; re-running on an unchanged source fetches nothing.",
        epilog="Prints one JSON line (path, files, bytes, unchanged, fetched_bytes, resumed_bytes, "
        "linked_files, refetched_files, wall_s). Exit 0 ok, 1 staging failed, 2 bad arguments or a bad SOURCE "
        "or DEST (as `pdserve stage`), 3 staged but the JSON line could not be written, 130 interrupted.",
    )
    ap.add_argument("source", help="s3://bucket/prefix/, hf://org/repo[@rev], file://… or a local folder")
    ap.add_argument("dest", type=_dest, help="model folder to publish, e.g. /fsx/models/<name>")
    ap.add_argument("--endpoint-url", default=None, type=_endpoint,
                    help="S3 endpoint of an S3-compatible server (SeaweedFS, MinIO); default AWS "
                    "(or AWS_ENDPOINT_URL_S3)")
    ap.add_argument("--include", action="append", default=None, metavar="GLOB",
                    help="take only files matching GLOB (repeatable); default: safetensors + config + tokenizer")
    ap.add_argument("--exclude", action="append", default=None, metavar="GLOB", help="skip files matching GLOB (repeatable)")
    ap.add_argument("--no-prefer-safetensors", dest="prefer_safetensors", action="store_false",
                    help="keep .bin/.pth/.pt weights even in folders that hold safetensors (by default those "
                    "duplicate PyTorch checkpoints are skipped)")
    ap.add_argument("--concurrency", type=_positive_int, default=None,
                    help="parallel ranged reads, 1..256 (default: 4 per CPU within 16..64)")
    ap.add_argument("--part-size-mib", type=_positive_int, default=None,
                    help="bytes per ranged read and resume unit, MiB (default 32; keep it between runs: a "
                    "killed run resumes only with the same part size)")
    ap.add_argument("--connect-timeout-s", type=_positive_float, default=10.0,
                    help="S3 connect timeout per attempt, seconds (default 10)")
    ap.add_argument("--read-timeout-s", type=_positive_float, default=60.0,
                    help="S3 read timeout per attempt, seconds (default 60); with 8 attempts an endpoint "
                    "that accepts connections but never answers fails after about 8 x this")
    ap.add_argument("--free-space-margin-mib", type=_nonnegative_int, default=256,
                    help="free space to leave on the destination filesystem after staging, MiB (default 256)")
    ap.add_argument("--lock-timeout-s", type=float, default=600.0,
                    help="how long to wait for another stager of the same DEST, seconds (default 600)")
    ap.add_argument("--s3-transport", choices=("auto", "http", "botocore"), default="auto",
                    help="how s3:// bytes are fetched: 'http' (SigV4-signed GETs over http.client), "
                    "'botocore' (the client's get_object), 'auto' (http unless a proxy or non-SigV4 signer)")
    ap.add_argument("--no-direct-io", dest="direct_io", action="store_false",
                    help="write through the page cache instead of O_DIRECT")
    ap.add_argument("--no-fsync", dest="fsync", action="store_false",
                    help="skip fsync before publishing (faster; a crash right after may lose the files: "
                    "scratch copies and benchmarks only)")
    ap.add_argument("--record-sha256", action="store_true",
                    help="also record each file's whole-file SHA-256 in the manifest (one more pass)")
    ap.add_argument("--recheck-sha256", action="store_true",
                    help="re-hash the published files against their recorded digests before trusting them as "
                    "unchanged (catches a copy corrupted in place; one read of every published byte)")
    ap.add_argument("--fsx-file-system-id", default=None, metavar="FS_ID",
                    help="FSx mode (needs --fsx-path and an s3:// SOURCE): link SOURCE into this FSx for Lustre "
                    "file system, import and preload it, then stage the linked folder into DEST")
    ap.add_argument("--fsx-path", default=None, metavar="PATH",
                    help="file-system path of the data repository association, e.g. /s3/<name> (not DEST's own)")
    ap.add_argument("--fsx-mount", type=Path, default=None,
                    help="where the FSx file system is mounted (default: the mount point holding DEST)")
    ap.add_argument("--fsx-timeout-s", type=_positive_float, default=3600.0,
                    help="FSx mode: seconds for association + import + preload together (default 3600)")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="rich progress bar on stderr (default: when stderr is a terminal)")
    return ap


def _options(args: argparse.Namespace) -> dict:
    opts: dict = {"s3_transport": args.s3_transport, "direct_io": args.direct_io, "fsync": args.fsync,
                  "record_sha256": args.record_sha256, "recheck_sha256": args.recheck_sha256,
                  "prefer_safetensors": args.prefer_safetensors,
                  "lock_timeout_s": args.lock_timeout_s, "free_space_margin_bytes": args.free_space_margin_mib << 20}
    if args.include:
        opts["include"] = args.include
    if args.exclude:
        opts["exclude"] = args.exclude
    if args.concurrency is not None:
        opts["concurrency"] = args.concurrency
    if args.part_size_mib is not None:
        opts["part_size_bytes"] = args.part_size_mib << 20
    return opts


OPTION_NAMES = {"include": "--include", "exclude": "--exclude", "concurrency": "--concurrency",
                "part_size_bytes": "--part-size-mib", "s3_transport": "--s3-transport",
                "lock_timeout_s": "--lock-timeout-s", "free_space_margin_bytes": "--free-space-margin-mib"}


def _fsx_source(args: argparse.Namespace, fsx_client: object) -> str:
    """FSx mode: the linked, preloaded folder to stage from (see the module doc)."""
    from runtime.staging import fsx

    from runtime.staging.keys import select_paths

    opts = _options(args)
    folder = fsx.preload_source(fsx_client, file_system_id=args.fsx_file_system_id, file_system_path=args.fsx_path,
                                s3_uri=args.source, dest=args.dest, mount_root=args.fsx_mount,
                                timeout_s=args.fsx_timeout_s,
                                select=lambda rels: select_paths(rels, opts.get("include"), opts.get("exclude", ()),
                                                                 opts["prefer_safetensors"]))
    return str(folder)


def main(argv: list[str] | None = None, *, fsx_client: object = None) -> int:
    """Run one staging; returns the exit status (see the module doc). Never raises StagingError.

    `fsx_client` (tests): the boto3 ``fsx`` client for the FSx mode; None → made from the AWS chain."""
    ap = build_parser()
    args = ap.parse_args(argv)  # exits 2 with a usage message on bad arguments
    if args.fsx_file_system_id is not None or args.fsx_path is not None:
        from runtime.staging.fsx import fsx_options_error

        problem = fsx_options_error(args.fsx_file_system_id, args.fsx_path, args.source)
        if problem:
            ap.print_usage(sys.stderr)
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    from pydantic import ValidationError

    from runtime.staging.manifest import StagingError
    from runtime.staging.sources import check_source
    from runtime.staging.stage import BAD_VALUE_ERRORS, StageOptions, Stager

    try:
        options = StageOptions(**_options(args))
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = str(first["loc"][-1]) if first["loc"] else ""
        ap.print_usage(sys.stderr)
        print(f"error: {OPTION_NAMES.get(field, field)}: {first['msg']}, got {first.get('input')!r}", file=sys.stderr)
        return EXIT_USAGE
    try:
        check_source(args.source)  # a malformed or missing SOURCE is a bad value, as in `pdserve stage`
    except StagingError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    client = None
    source = args.source
    if args.fsx_file_system_id is not None:
        if fsx_client is None:
            from runtime.staging.fsx import make_fsx_client

            try:
                fsx_client = make_fsx_client()
            except Exception as e:  # noqa: BLE001 - botocore: no region, bad config file, ...
                print(f"error: cannot create the FSx client: {type(e).__name__}: {e}", file=sys.stderr)
                return EXIT_FAILED
        try:
            source = _fsx_source(args, fsx_client)
        except StagingError as e:
            print(f"error: {e}", file=sys.stderr)
            return EXIT_FAILED
        except OSError as e:  # the mount: missing, unreadable
            print(f"error: FSx mount: {e.strerror or e} ({e.filename})", file=sys.stderr)
            return EXIT_FAILED
    elif args.source.startswith("s3://"):
        from runtime.staging.s3 import make_client

        try:
            client = make_client(args.endpoint_url, transfer_methods=False, connect_timeout_s=args.connect_timeout_s,
                                 read_timeout_s=args.read_timeout_s)
        except Exception as e:  # noqa: BLE001 - botocore: invalid region, bad config file, ...
            print(f"error: cannot create the S3 client: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_FAILED
    try:
        res = Stager(source, args.dest, s3_client=client, options=options, progress=progress).run()
    except BAD_VALUE_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except StagingError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:  # the destination side: read-only or missing mount, permissions, no space
        print(f"error: {args.dest}: {e.strerror or e} ({e.filename or args.dest}); the destination keeps "
              "its previous version", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted: completed parts are kept; run again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    t = res.transfer
    line = json.dumps({
        "path": str(res.path), "files": len(res.manifest.files), "bytes": res.manifest.total_bytes,
        "unchanged": res.unchanged, "fetched_bytes": t.bytes_downloaded, "resumed_bytes": t.bytes_resumed,
        "linked_files": res.files_linked, "refetched_files": t.files_refetched, "wall_s": round(res.wall_s, 3),
    })
    try:
        print(line, flush=True)
    except OSError as e:  # stdout closed (EPIPE) or full: the model is published all the same
        print(f"warning: staged {res.path}, but the summary line could not be written: {e}", file=sys.stderr)
        return EXIT_NO_SUMMARY
    return EXIT_OK


if __name__ == "__main__":
    status = main()
    if status == EXIT_NO_SUMMARY:  # stdout is broken: keep the interpreter from failing to flush it at exit
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    # The process exits next. Interpreter shutdown runs a last cyclic-GC pass over every live
    # object, botocore's loaded service model included: ~0.05-0.09 s of a ~0.45 s start-to-exit for
    # a 3-file model on 2 cores (bench/staging.py fixed_cost_s). Frozen objects are skipped by it;
    # their memory goes back with the process. Only here, never in main(): a caller's process
    # keeps its normal GC.
    gc.freeze()
    sys.exit(status)
