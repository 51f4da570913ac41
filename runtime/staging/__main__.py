"""`python -m runtime.staging SOURCE DEST`: the stager as a lean one-shot process.

For containers that only stage (a Kubernetes Job or init container, an Argo step): the same
`Stager` as `pdserve stage` and the KFP `stage-weights` component, without the CLI's typer/rich
start-up (~0.25 s here). Prints ONE JSON line on stdout when done::

    {"path": "/fsx/models/m", "files": 5, "bytes": 1052000, "unchanged": false,
     "fetched_bytes": 1052000, "resumed_bytes": 0, "linked_files": 0, "wall_s": 0.21}

Exit status: 0 staged (or already up to date), 1 staging failed (the message, naming the key or
option, on stderr; the destination keeps its previous version or stays absent), 2 bad arguments,
130 interrupted (completed parts stay for the next run).

Credentials come from the default AWS chain (env, profile, Pod Identity / IRSA); they are never
printed. ``--endpoint-url`` (or AWS_ENDPOINT_URL_S3) points at an S3-compatible server.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (also used by the docs test: every option has a help text)."""
    ap = argparse.ArgumentParser(
        prog="python -m runtime.staging",
        description="Stage a model from s3://bucket/prefix/, hf://org/repo or a local folder into DEST "
        "(the FSx for Lustre mount): concurrent ranged reads, every byte verified, published atomically "
        "with a marker file; re-running on an unchanged source fetches nothing.",
        epilog="Prints one JSON line (path, files, bytes, unchanged, fetched_bytes, resumed_bytes, "
        "linked_files, wall_s). Exit 0 ok, 1 staging failed, 2 bad arguments, 130 interrupted.",
    )
    ap.add_argument("source", help="s3://bucket/prefix/, hf://org/repo[@rev], file://… or a local folder")
    ap.add_argument("dest", type=Path, help="model folder to publish, e.g. /fsx/models/<name>")
    ap.add_argument("--endpoint-url", default=None,
                    help="S3 endpoint of an S3-compatible server (SeaweedFS, MinIO); default AWS "
                    "(or AWS_ENDPOINT_URL_S3)")
    ap.add_argument("--include", action="append", default=None, metavar="GLOB",
                    help="take only files matching GLOB (repeatable); default: safetensors + config + tokenizer")
    ap.add_argument("--exclude", action="append", default=None, metavar="GLOB", help="skip files matching GLOB (repeatable)")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="parallel ranged reads (default: 4 per CPU within 16..64)")
    ap.add_argument("--part-size-mib", type=int, default=None,
                    help="bytes per ranged read and resume unit, MiB (default 32)")
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
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="rich progress bar on stderr (default: when stderr is a terminal)")
    return ap


def _options(args: argparse.Namespace) -> dict:
    opts: dict = {"s3_transport": args.s3_transport, "direct_io": args.direct_io, "fsync": args.fsync,
                  "record_sha256": args.record_sha256}
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
                "part_size_bytes": "--part-size-mib", "s3_transport": "--s3-transport"}


def main(argv: list[str] | None = None) -> int:
    """Run one staging; returns the exit status (see the module doc). Never raises StagingError."""
    ap = build_parser()
    args = ap.parse_args(argv)  # exits 2 with a usage message on bad arguments
    from pydantic import ValidationError

    from runtime.staging.manifest import StagingError
    from runtime.staging.stage import StageOptions, Stager

    try:
        options = StageOptions(**_options(args))
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        field = str(first["loc"][-1]) if first["loc"] else ""
        ap.print_usage(sys.stderr)
        print(f"error: {OPTION_NAMES.get(field, field)}: {first['msg']}, got {first.get('input')!r}", file=sys.stderr)
        return EXIT_USAGE
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        client = None
        if args.source.startswith("s3://"):
            from runtime.staging.s3 import make_client

            client = make_client(args.endpoint_url, transfer_methods=False)
        res = Stager(args.source, args.dest, s3_client=client, options=options, progress=progress).run()
    except StagingError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted: completed parts are kept; run again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    t = res.transfer
    print(json.dumps({
        "path": str(res.path), "files": len(res.manifest.files), "bytes": res.manifest.total_bytes,
        "unchanged": res.unchanged, "fetched_bytes": t.bytes_downloaded, "resumed_bytes": t.bytes_resumed,
        "linked_files": res.files_linked, "wall_s": round(res.wall_s, 3),
    }), flush=True)
    return EXIT_OK


if __name__ == "__main__":
    status = main()
    # The process exits next. Interpreter shutdown runs a last cyclic-GC pass over every live
    # object, botocore's loaded service model included: ~0.05-0.09 s of a ~0.45 s start-to-exit for
    # a 3-file model on 2 cores (bench/staging.py fixed_cost_s). Frozen objects are skipped by it;
    # their memory goes back with the process. Only here, never in main(): a caller's process
    # keeps its normal GC.
    gc.freeze()
    sys.exit(status)
