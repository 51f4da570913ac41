"""`python -m runtime.server --model-name NAME --prefill-url URL --decode-url URL --http-port PORT`.

Starts the pdserve runtime (KServe ModelServer with OpenAI routes) in front of the given vLLM workers.
`--prefill-url` and `--decode-url` may repeat (pools); without a prefill URL every request is prefilled on
its decode worker. Worker addresses come only from these flags.

`--router kv` replaces the fixed round-robin pairing with the KV-aware router (runtime.router): it needs
`--tokenizer-dir` (the served model folder) and takes the workers' KV-event endpoints with
`--prefill-kv-events` / `--decode-kv-events` (repeatable, in the order of the URLs) and the router settings
as RouterSpec JSON with `--router-spec`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", required=True, help="OpenAI model name (the workers' --served-model-name).")
    p.add_argument("--prefill-url", action="append", default=[], help="Prefill worker base URL (repeatable).")
    p.add_argument("--decode-url", action="append", default=[], required=True,
                   help="Decode worker base URL (repeatable).")
    p.add_argument("--host", default="127.0.0.1", help="Bind address (0.0.0.0 in a pod).")
    p.add_argument("--http-port", type=int, default=8080, help="HTTP port.")
    p.add_argument("--timeout-s", type=float, default=600.0, help="Read timeout of each worker call, seconds.")
    p.add_argument("--prefill-timeout-s", type=float, default=120.0,
                   help="A remote prefill slower than this is redone locally on the decode worker, seconds.")
    p.add_argument("--router", choices=("fixed", "kv"), default="fixed",
                   help="fixed: round-robin pairing; kv: KV-aware router (runtime.router).")
    p.add_argument("--router-spec", default="{}", help="RouterSpec as JSON (runtime/config.py), for --router kv.")
    p.add_argument("--block-size", type=int, default=16, help="Workers' KV block size, tokens (--block-size).")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="Served model folder (tokenizer), --router kv.")
    p.add_argument("--prefill-kv-events", action="append", default=[], help="ZMQ endpoint of a prefill worker.")
    p.add_argument("--decode-kv-events", action="append", default=[], help="ZMQ endpoint of a decode worker.")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pydantic import ValidationError

    from runtime.config import RouterSpec

    router_spec = None
    if args.router == "kv":
        try:
            router_spec = RouterSpec.model_validate_json(args.router_spec)
        except ValidationError as exc:
            sys.exit(f"--router-spec: {exc}")
        if args.tokenizer_dir is None:
            sys.exit("--tokenizer-dir is required with --router kv")
    # KServe parses sys.argv at import (parse_known_args); hide our flags from it.
    sys.argv = sys.argv[:1]
    from runtime.server.app import serve

    serve(
        args.model_name,
        prefill_urls=args.prefill_url,
        decode_urls=args.decode_url,
        host=args.host,
        http_port=args.http_port,
        timeout_s=args.timeout_s,
        router_spec=router_spec,
        block_size_tokens=args.block_size,
        tokenizer_dir=args.tokenizer_dir,
        prefill_kv_events=args.prefill_kv_events,
        decode_kv_events=args.decode_kv_events,
        prefill_timeout_s=args.prefill_timeout_s,
    )


if __name__ == "__main__":
    main()
