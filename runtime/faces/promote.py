"""`pdserve promote`: options → runtime.usecases.promote.PromoteRequest → promote → one line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from runtime.image import DEFAULT_IMAGE
from runtime.faces.common import (DEFAULT_STATE, check_engine_options, check_output_file, console, fail, usage,
                                  verbose_given)


def _sqlite_database(uri: str) -> Path | None:
    """The database file of a `sqlite:` tracking URI as SQLAlchemy (which MLflow hands the URI to) reads it:
    query string dropped, percent-escapes decoded (sqlalchemy.engine.make_url). None for other URIs and
    in-memory databases; a URI SQLAlchemy cannot parse fails (one error line)."""
    from runtime.tracking.mlflow_runs import sqlite_database

    try:
        return sqlite_database(uri)
    except ValueError as e:
        usage(f"--mlflow-uri {e}")



def promote(
    ctx: typer.Context,
    registered_model: Annotated[str, typer.Argument(help="MLflow registered model name.", metavar="REGISTERED_MODEL")],
    mlflow_uri: Annotated[str, typer.Option(help="MLflow tracking URI.")] = f"sqlite:///{DEFAULT_STATE / 'mlflow.db'}",
    out: Annotated[Path, typer.Option(help="Where to write the validated YAML; an existing file is replaced only "
                                           "when it holds manifests `pdserve promote` wrote (or with --force).")
                   ] = Path("manifests.yaml"),
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing --out file that is not an earlier output of `pdserve promote`.")
    ] = False,
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace.")] = "pdserve",
    image: Annotated[str, typer.Option(help="pdserve runtime image.")] = DEFAULT_IMAGE,
    pvc: Annotated[str, typer.Option(help="FSx for Lustre PVC holding the models.")] = "fsx-claim",
    apply: Annotated[bool, typer.Option("--apply", help="Server-side apply to the cluster of --kube-context: the new "
                                        "version starts as a canary beside the current champion, is probed against the "
                                        "SLO and rolled back automatically when it misses (exit 1).")] = False,
    kube_context: Annotated[str, typer.Option(help="kubeconfig context to apply to (required with --apply outside a "
                                              "Kubernetes pod; inside one, empty = the pod's service account).")] = "",
    allow_unstaged: Annotated[bool, typer.Option(
        "--allow-unstaged", help="Promote even when the champion's model path is not a verified staged folder "
        "(e.g. it is only mounted on the cluster).")] = False,
    expect_version: Annotated[Optional[str], typer.Option(
        "--expect-version", metavar="VERSION",
        help="Promote only when alias champion is this version, e.g. the one `pdserve tune --register` just "
             "made champion (its --decision-out); another version fails (exit 1) before anything is rendered or "
             "applied.")] = None,
    skip_if_live: Annotated[bool, typer.Option(
        "--skip-if-live", help="With --apply: apply nothing when the InferenceService already serves this "
                               "version's revision with the same --image (exit 0), instead of a canary of the "
                               "serving revision; what a scheduled re-tune's promote step runs.")] = False,
    traffic_upload: Annotated[Optional[str], typer.Option(
        metavar="s3://BUCKET/PREFIX/",
        help="Record the endpoint's traffic (one line per finished request: time, prompt and completion tokens, "
             "no content) and ship it every 5 min to PREFIX<InferenceService>/<pod>/: the --traffic of `pdserve "
             "batch retune-schedule`. Credentials: the optional Secret pdserve-s3, else the IAM role of the "
             "<InferenceService>-runtime service account.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(
        "--max-model-len", metavar="TOKENS",
        help="Deploy with this vLLM --max-model-len instead of the champion's: at least its workload's ISL + "
             "OSL, at most the model's context window (from its folder's config.json, else the one tune recorded) "
             "and the KV capacity of one engine tune recorded.")] = None,
    engine_arg: Annotated[Optional[list[str]], typer.Option(
        "--engine-arg", metavar="KEY=VALUE",
        help="A vLLM engine argument to deploy with (repeatable), e.g. max-num-seqs=128 or "
             "enable-chunked-prefill=false; checked against the pinned vLLM's parser; it replaces the "
             "champion's engine.extra_args entry of the same argument.")] = None,
) -> None:
    """Render the `champion` version's ClusterServingRuntime, InferenceService and worker pools; validate; write
    (with --apply, roll out as a canary).

    The InferenceService is named after REGISTERED_MODEL: unchanged when it is a DNS-1035 label of at most
    45 characters, else lower-cased with other characters as '-' plus an 8-hex-digit hash of the name.

    Refuses a champion whose model path is not a staged folder with a valid marker (see `pdserve stage`)
    unless --allow-unstaged."""
    if expect_version is not None and not expect_version.strip():  # the use case reads "" as "no guard"
        usage("--expect-version: empty; give the version alias champion must name (tune --decision-values' "
              "registered_version), or leave the option out")
    if expect_version is not None and not re.fullmatch(r"[1-9][0-9]*", expect_version):  # MLflow numbers 1, 2, ...
        usage(f"--expect-version {expect_version!r}: must be a model version number (1, 2, ...)")
    from runtime.tracking.mlflow_runs import check_registered_model_name

    try:
        check_registered_model_name(registered_model)
    except ValueError as e:  # before MLflow is asked: its own message names no argument
        usage(f"REGISTERED_MODEL: {e}")
    if skip_if_live and not apply:
        usage("--skip-if-live: only applies with --apply")
    engine_args = list(engine_arg or [])
    check_engine_options(max_model_len, engine_args, verbose_given(ctx))
    if skip_if_live and (max_model_len is not None or engine_args):
        usage("--skip-if-live: not with --max-model-len / --engine-arg (the live revision of this version would "
              "be kept without them)")
    if apply and not kube_context:
        from runtime.deploy.kube import in_cluster_available

        if not in_cluster_available():
            usage("--apply needs --kube-context, or must run inside a Kubernetes pod (in-cluster service-account "
                  "config); no cluster is assumed")
    if apply and kube_context:  # a context the kubeconfig lacks is a bad value: refused before anything is written
        from runtime.deploy.errors import KubeconfigError
        from runtime.deploy.kube import Kube

        try:
            Kube.from_context(kube_context)
        except KubeconfigError as e:
            usage(f"--kube-context {kube_context}: {e}")
    _check_target_options(namespace, pvc, image)
    _check_out_options(out, traffic_upload)
    from runtime.tracking.mlflow_runs import check_tracking_uri

    try:
        check_tracking_uri(mlflow_uri)
    except ValueError as e:
        usage(f"--mlflow-uri {e}")
    db_file = _sqlite_database(mlflow_uri)
    if db_file is not None and not db_file.is_file():  # MLflow would create an empty database there
        usage(f"--mlflow-uri {mlflow_uri}: no such database file {db_file} (run `pdserve tune ... --mlflow-uri ... "
              "--register` or `pdserve demo` first)")
    from runtime.paths import overwrites

    if overwrites(out, [db_file]):  # the registry itself would be replaced by the YAML
        usage(f"--out {out}: is the MLflow database of --mlflow-uri; choose another file")
    check_output_file("--out", out, "manifests", force)
    from runtime.deploy.errors import ManifestError, RolledBackError
    from runtime.staging.manifest import StagingError
    from runtime.tracking.mlflow_runs import TrackingError

    from runtime.usecases.promote import PromoteRequest, PromoteValueError, promote as run_promote

    try:
        info = run_promote(PromoteRequest(
            registered_model=registered_model, mlflow_tracking_uri=mlflow_uri, out_path=str(out),
            namespace=namespace, image=image, pvc_name=pvc, expect_version=expect_version or "", apply=apply,
            kube_context=kube_context, require_staged=not allow_unstaged, traffic_upload_uri=traffic_upload or "",
            skip_if_live=skip_if_live, max_model_len_tokens=max_model_len, engine_args=engine_args))
    except RolledBackError as e:  # manifests were written; the canary was rolled back
        fail(str(e))
    except PromoteValueError as e:  # --max-model-len / --engine-arg against the champion's spec
        usage(str(e))
    except StagingError as e:  # the champion's model folder is not a verified staged copy
        fail(f"{e} (`pdserve stage` the model and tune that folder, or pass --allow-unstaged to promote it "
              "anyway)")
    except (TrackingError, ManifestError, ValueError, OSError) as e:  # ours, and files: their message says it
        fail(str(e))
    except KeyError as e:  # an unknown GPU or instance type: the message lists the known ones
        fail(str(e.args[0]) if e.args else str(e))
    except Exception as e:  # noqa: BLE001 - unexpected: one line, no traceback
        fail(str(e) or f"unexpected {type(e).__name__} (no message)")
    console.print(escape(f"version {info.version}: {info.num_objects} objects {json.dumps(info.kinds)} → {out}")
                  + (" (applied)" if info.applied else "")
                  + (f" (already live as revision v{info.version} with image {image}: nothing applied)"
                     if info.already_live else ""))


def _check_out_options(out: Path, traffic_upload: str | None) -> None:
    """--out (a file that can be written) and --traffic-upload (an s3:// prefix), before MLflow is read: a bad
    value exits 2 naming its option, not 1 with an OS error after the champion was rendered."""
    from runtime.paths import output_file_problem
    from runtime.s3uri import check_upload_uri

    problems = []
    problem = output_file_problem(out)
    if problem:
        problems.append(f"--out {out}: {problem}")
    if traffic_upload:
        try:
            check_upload_uri(traffic_upload)
        except ValueError as e:  # names --traffic-upload
            problems.append(str(e))
    if problems:
        usage("; ".join(problems))


def _check_target_options(namespace: str, pvc: str, image: str) -> None:
    """--namespace, --pvc and --image as the renderer checks them (runtime.deploy.render), before MLflow is read:
    a bad value exits 2 naming its option, not 1 after the champion was fetched."""
    from runtime.deploy.errors import ManifestError
    from runtime.deploy.target import DNS1123_LABEL, DNS1123_SUBDOMAIN, MAX_SUBDOMAIN_CHARS, check_name
    from runtime.image import split_reference

    problems = []
    for option, value, pattern, max_chars in (("--namespace", namespace, DNS1123_LABEL, None),
                                              ("--pvc", pvc, DNS1123_SUBDOMAIN, MAX_SUBDOMAIN_CHARS)):
        try:
            check_name(option, value, pattern=pattern, **({} if max_chars is None else {"max_chars": max_chars}))
        except ManifestError as e:
            problems.append(str(e))
    try:
        split_reference(image)
    except ValueError as e:
        problems.append(f"--image: {e}")
    if problems:
        usage("; ".join(problems))
