"""Adapter: record a tuning in MLflow and register the winner with alias ``champion``.

Layout in MLflow (any tracking URI; tested with the sqlite backend ``sqlite:///.../mlflow.db``):

* experiment ``experiment`` (created with an explicit artifact location so nothing lands in ``./mlruns``);
* one parent run per tuning (params: model, gpu, precision, SLO, workload, gpu_budget and planner_mode of the
  spec, ``inherited_from`` when ``tune --like`` took its defaults from a champion; metrics: the winner's
  (``best_*``, among them ``best_decode_worker_kv_capacity_tokens``, a whole decode worker over all its DP
  ranks, and ``best_engine_kv_capacity_tokens``, one engine: the smaller of one prefill and one decode DP rank,
  the DeploymentSpec's ``engine.kv_capacity_tokens``), and ``champion_*`` / ``challenger_*`` when it was
  compared with the registered champion);
* one nested child run per candidate (tag ``mlflow.parentRunId``): params model/gpu/precision/prefill_tp/
  decode_tp (tensor-parallel degrees)/slo_*, and after a wider search prefill_layout/decode_layout and
  prefill_worker_gpus/decode_worker_gpus (tp x dp x pp); metrics predicted_ttft_ms, predicted_itl_ms,
  goodput_per_gpu, usd_per_mtok, decode_worker_kv_capacity_tokens, prefill_worker_kv_capacity_tokens, ...;
* parent artifacts: ``pareto.png``, ``pareto.html``, ``candidates.md``, ``profiles/*.json``,
  ``deployment/deployment_spec.json`` (the winner's DeploymentSpec);
* registered model ``registered_model``: a new version whose source is the parent run's ``deployment``
  artifact folder, alias ``champion`` moved to it, unless a challenger-vs-champion comparison
  (runtime/tuner/champion.py) kept the old champion: then the version is registered without the alias and
  tagged ``pdserve.champion_decision=kept``. No pyfunc flavour: the version is data, not code.

Only ``MlflowClient`` is used (no global ``mlflow.set_tracking_uri``), so callers with other tracking URIs
are unaffected.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import posixpath
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from runtime.config import DeploymentSpec, ModelRef
from runtime.tracking.plots import pareto_html, pareto_png
from runtime.tracking.profiles_io import write_profiles
from runtime.tuner.profiles import build_profiles
from runtime.tuner.search import Candidate, TuneResult, deployment_perf

if TYPE_CHECKING:
    from runtime.tuner.champion import ChampionComparison

CHAMPION_ALIAS = "champion"
GPU_OPTION_TAG = "pdserve.gpu_option"  # model version tag: the --gpu value when it is an instance type
# MLflow error codes (mlflow/protos/databricks.proto) that mean "no such registered model / alias"; any other
# code (INTERNAL_ERROR for a refused connection, PERMISSION_DENIED, ...) means MLflow could not be asked.
NOT_FOUND_CODES = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
SPEC_ARTIFACT = "deployment/deployment_spec.json"
# what a DeploymentSpec deploys (runtime/config.py Precision); measured mode tunes at fp32 on the CPU entry
DEPLOYABLE_PRECISIONS = ("bf16", "fp8")


# The tracking URI schemes MLflow 3.x builds a store for without plugins (mlflow/tracking/_tracking_service/utils.py
# registers them; its UnsupportedModelRegistryStoreURIException lists the same): used only when MLflow's registry
# cannot be read (`_mlflow_schemes`). A database scheme may carry a driver (postgresql+psycopg2). "" and file: are
# its file store, which MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE. Whole URIs MLflow takes as they are
# (its TrackingStoreRegistry.get_store_builder): "databricks", "databricks-uc", "uc".
MLFLOW_URI_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc", "uc")
FILE_STORE_SCHEMES = ("", "file")
MLFLOW_WHOLE_URIS = ("databricks", "databricks-uc", "uc")


def _mlflow_schemes() -> tuple[str, ...]:
    """The schemes MLflow's tracking-store registry holds now: its own and those of installed plugins (e.g.
    SageMaker's managed MLflow, whose tracking URI is the server's ARN, `arn:aws:sagemaker:...`, through the
    `sagemaker-mlflow` plugin). `MLFLOW_URI_SCHEMES` when the registry (MLflow-internal) cannot be read."""
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        return tuple(str(k) for k in _tracking_store_registry._registry)
    except Exception:  # noqa: BLE001 - an MLflow without that internal: the built-in list
        return MLFLOW_URI_SCHEMES


def sqlite_database(uri: str) -> Path | None:
    """The database file of a ``sqlite:`` tracking URI as SQLAlchemy (which MLflow hands the URI to) reads it:
    query string dropped, percent-escapes decoded (sqlalchemy.engine.make_url). None for other URIs and
    in-memory databases.

    Raises:
        ValueError: a sqlite: URI SQLAlchemy cannot parse.
    """
    if not uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    try:
        db = make_url(uri).database
    except Exception as e:  # noqa: BLE001 - sqlalchemy.exc.ArgumentError and friends
        raise ValueError(f"{uri}: not a SQLAlchemy database URL: {e}") from None
    return None if not db or db == ":memory:" else Path(db)


def check_tracking_uri(uri: str, env: "dict[str, str] | None" = None) -> str:
    """Return ``uri`` when MLflow can open a store for it: a scheme its tracking-store registry holds (its own and
    installed plugins': `_mlflow_schemes`), one of ``MLFLOW_WHOLE_URIS``, or a plain path / file: URI when
    ``MLFLOW_ALLOW_FILE_STORE`` is true in ``env`` (default ``os.environ``). Reads no store, so a command refuses a
    mistyped URI before any work instead of failing after it.

    Raises:
        ValueError: another scheme, or a path or file: URI MLflow would refuse (the message suggests sqlite:///).
    """
    env = os.environ if env is None else env
    if uri in MLFLOW_WHOLE_URIS:
        return uri
    scheme = urlparse(uri).scheme.lower().split("+", 1)[0]
    if len(scheme) == 1:  # a Windows drive letter, C:\...: a path
        scheme = ""
    if scheme not in FILE_STORE_SCHEMES and scheme in _mlflow_schemes():
        return uri
    if scheme in FILE_STORE_SCHEMES:
        if env.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1"):
            return uri
        raise ValueError(f"{uri!r}: a path or file: URI names MLflow's file store, which MLflow refuses; give a "
                         f"database such as sqlite:///{uri.removeprefix('file://') or 'mlflow.db'} or an http(s):// "
                         "server")
    raise ValueError(f"{uri!r}: unsupported scheme {scheme!r}; MLflow takes sqlite:///PATH, http(s)://HOST, "
                     "postgresql://, mysql://, mssql://, databricks or a scheme of an installed MLflow plugin")


class TrackingError(RuntimeError):
    """MLflow has no champion / no spec artifact for a registered model (message names which)."""


class MissingFieldsError(TrackingError):
    """The champion's spec artifact does not state fields a caller must take from it; ``missing`` lists their
    dotted paths (e.g. ``planner.gpu_budget``)."""

    def __init__(self, message: str, missing: list[str]):
        super().__init__(message)
        self.missing = list(missing)


def check_registered_model_name(name: str) -> str:
    """Return ``name`` when MLflow's model registry accepts it as a registered model name.

    Same rule as MLflow's own check (mlflow/utils/validation.py ``_validate_model_name``, MLflow 3.x), applied
    here so a bad name is refused before any run is created or any file written.

    Raises:
        ValueError: empty/blank, contains '/' or ':', or not its own normalised path (e.g. '.', 'a/../b').
    """
    if name is None or not str(name).strip():
        raise ValueError(f"registered model name {name!r}: must not be empty")
    if "/" in name or ":" in name:
        raise ValueError(f"registered model name {name!r}: MLflow model names cannot contain '/' or ':'")
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith(".."):
        raise ValueError(f"registered model name {name!r}: MLflow refuses names that resolve to another path "
                         f"({norm!r})")
    return name


def check_renderable(spec: DeploymentSpec, registered_model: str) -> DeploymentSpec:
    """Return ``spec`` when ``pdserve promote`` can render it as registered model ``registered_model``.

    Runs the renderer (runtime/deploy/render.py ``render_all``, schema validation off) with the name promote
    uses (``dns_label(registered_model)``, revision ``v1``) and placeholder namespace/image/PVC, so a spec that
    could never be promoted (a model name with whitespace, empty, '..', a TP larger than the instance) is
    refused before it is registered and moves the ``champion`` alias away from a good version.

    Raises:
        runtime.deploy.errors.ManifestError: the renderer's own message (field named).
    """
    from runtime.deploy.mlflow_recorder import revision_for
    from runtime.deploy.render import render_all
    from runtime.deploy.target import dns_label

    render_all(spec, name=dns_label(registered_model), namespace="pdserve", image="pdserve-runtime:check",
               pvc_name="fsx-claim", revision=revision_for("1"), validate=False)
    return spec


def default_artifact_root(tracking_uri: str) -> Path | None:
    """``<db folder>/mlartifacts`` for ``sqlite:///path/to/mlflow.db``; None for other URIs."""
    if tracking_uri.startswith("sqlite:///"):
        return Path(unquote(tracking_uri[len("sqlite:///"):])).resolve().parent / "mlartifacts"
    if tracking_uri.startswith(("file:", "/")):
        p = urlparse(tracking_uri).path if tracking_uri.startswith("file:") else tracking_uri
        return Path(p) / "mlartifacts"
    return None


# MLflow prints "🏃 View run <name> at: <tracking URI>/#/..." to stdout on every set_terminated, with the URI's
# userinfo (user:password@) verbatim; this variable (mlflow/environment_variables.py, read on each call in
# mlflow/tracking/_tracking_service/client.py `_log_url`) turns that print off.
SUPPRESS_RUN_LINKS_ENV = "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"


@contextlib.contextmanager
def _no_run_links() -> Iterator[None]:
    """Within the block, MLflow prints no run/experiment links (they would echo credentials); the variable's
    previous value is restored afterwards."""
    old = os.environ.get(SUPPRESS_RUN_LINKS_ENV)
    os.environ[SUPPRESS_RUN_LINKS_ENV] = "true"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(SUPPRESS_RUN_LINKS_ENV, None)
        else:
            os.environ[SUPPRESS_RUN_LINKS_ENV] = old


def _client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _experiment_id(client, experiment: str, artifacts_dir: Path | None) -> str:
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    loc = None if artifacts_dir is None else Path(artifacts_dir).resolve().as_uri()
    return client.create_experiment(experiment, artifact_location=loc)


def _candidate_params(result: TuneResult, c: Candidate) -> dict[str, str]:
    params = {
        "model": result.model.name,
        "gpu": result.gpu.name,
        "precision": result.precision,
        "prefill_tp": str(c.prefill.tp),
        "decode_tp": str(c.decode.tp),
        "slo_ttft_p90_ms": f"{result.slo.ttft_p90_ms:g}",
        "slo_itl_p90_ms": f"{result.slo.itl_p90_ms:g}",
        "isl_tokens": str(result.workload.isl_tokens),
        "osl_tokens": str(result.workload.osl_tokens),
        "request_rate_per_s": f"{result.workload.request_rate_per_s:g}",
    }
    if result.parallelism != "tp":  # a wider search: the tp degrees alone do not say a worker's layout and GPUs
        params.update(parallelism=result.parallelism, prefill_layout=c.prefill.label, decode_layout=c.decode.label,
                      prefill_worker_gpus=str(c.prefill.gpus), decode_worker_gpus=str(c.decode.gpus))
    if result.weight_precision and result.weight_precision != result.precision:  # e.g. MXFP4 weights, bf16 KV
        params["weight_precision"] = result.weight_precision
    return params


def _candidate_metrics(c: Candidate) -> dict[str, float]:
    m = {
        "predicted_ttft_ms": c.ttft_ms,
        "predicted_ttft_unloaded_ms": c.ttft_unloaded_ms,
        "predicted_itl_ms": c.itl_ms,
        "goodput_per_gpu": c.goodput_per_gpu,
        "usd_per_mtok": c.usd_per_mtok if c.usd_per_mtok is not None else math.nan,
        "decode_batch": float(c.decode_batch),
        "prefill_replicas": float(c.prefill_replicas),
        "decode_replicas": float(c.decode_replicas),
        "num_gpus": float(c.num_gpus),
        # a whole decode / prefill worker, all its DP ranks (DeploymentSpec engine.kv_capacity_tokens is one
        # engine: the parent run's best_engine_kv_capacity_tokens)
        "decode_worker_kv_capacity_tokens": float(c.kv_capacity_tokens),
        "prefill_worker_kv_capacity_tokens": float(c.prefill_kv_capacity_tokens),
        "feasible": 1.0 if c.feasible else 0.0,
    }
    return {k: float(v) for k, v in m.items() if math.isfinite(v)}


def _end_failed(client, run_id: str) -> None:
    """Mark a run FAILED while an error propagates; a failure to do so (MLflow gone) must not hide that error."""
    try:
        client.set_terminated(run_id, status="FAILED")
    except Exception:  # noqa: BLE001 - best effort; the original error is what the caller sees
        pass


def _log(client, run_id: str, params: dict[str, str], metrics: dict[str, float], tags: dict[str, str]):
    from mlflow.entities import Metric, Param, RunTag

    client.log_batch(
        run_id,
        metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()],
        params=[Param(k, v) for k, v in params.items()],
        tags=[RunTag(k, v) for k, v in tags.items()],
    )


def log_tuning(
    result: TuneResult,
    *,
    tracking_uri: str,
    experiment: str,
    registered_model: str | None,
    artifacts_dir: Path | None = None,
    model_ref: ModelRef | None = None,
    spec: DeploymentSpec | None = None,
    traffic_trace_uri: str | None = None,
    comparison: "ChampionComparison | None" = None,
    compared_version: str | None = None,
    inherited_from: str | None = None,
    gpu_option: str | None = None,
) -> str | None:
    """Log ``result`` (parent + one child run per candidate, plot, profiles, spec) and register the winner.

    Args:
        tracking_uri: e.g. ``sqlite:///.pdserve/mlflow.db``.
        experiment: experiment name (created when absent).
        registered_model: registry name; the new version gets alias ``champion``. None: log only.
        artifacts_dir: artifact root for a NEW experiment (default: ``mlartifacts`` beside a sqlite db).
        model_ref: ModelRef for the DeploymentSpec (default: ``ModelRef(name=result.model.name)``); ignored
            when ``spec`` is given.
        spec: the DeploymentSpec to log and register, exactly as the caller deploys it (e.g. what
            ``pdserve tune --out`` writes, with its planner.gpu_budget). Default:
            ``result.to_deployment_spec(model_ref)`` (planner and engine settings at their defaults); for a
            measured-mode result (fp32, not deployable) and no ``registered_model``, no spec is logged.
        traffic_trace_uri: the trace the workload was read from (``pdserve tune --trace`` path, the pipeline's
            ``traffic_trace_uri``), logged as the parent run's param ``traffic_trace_uri`` beside the
            workload's ``isl_tokens``/``osl_tokens``/``request_rate_per_s`` (the trace's means and the rate
            sized for); None or empty: a workload of mean lengths, no such param.
        comparison: the winner (challenger) against ``registered_model``'s champion, version
            ``compared_version`` (runtime/tuner/champion.py ``compare_with_champion``). Logged on the parent
            run: metrics ``champion_num_gpus``, ``champion_goodput_per_gpu``, ``champion_usd_per_mtok``, the same
            ``challenger_*``, ``champion_improvement_pct``, ``champion_min_improvement_pct``,
            ``champion_replaced`` (1/0); param ``champion_version``; tags ``pdserve.champion_decision``
            (``replaced``/``kept``) and ``pdserve.champion_reason``. When ``comparison.replace`` is False the new
            version is registered WITHOUT the alias (tagged ``pdserve.champion_decision=kept`` with the
            reason), so the old champion stays and the winner can still be inspected or promoted by hand.
            Also kept when the alias no longer points at ``compared_version`` at registration time (another
            tuning moved it meanwhile). None: the alias moves to the new version (no champion to compare).
        inherited_from: ``"<registered model> v<version>"`` whose champion gave the defaults
            (``pdserve tune --like``), logged as param ``inherited_from``.
        gpu_option: the ``--gpu`` / ``gpu`` value the tuning was given. When it is not the catalog name the
            spec records (an AWS instance type such as ``g6e.12xlarge``, which also bounded TP by its GPU
            count), it is logged as param ``gpu_option`` and as the version's tag ``pdserve.gpu_option``, so
            ``pdserve tune --like`` re-tunes on the same instance type (:func:`champion_gpu_option`).

    Returns:
        The registered model version (a string such as ``"3"``), or None when nothing was registered. Whether
        the alias moved to it: the version's tag ``pdserve.champion_decision`` (``replaced``/``kept``; absent
        without a ``comparison``: moved), or :func:`champion_version`.

    Raises:
        ValueError: ``registered_model`` is not a name MLflow accepts (checked before any run is created).
        runtime.deploy.errors.ManifestError: (a ValueError) with ``registered_model``, the spec cannot be
            rendered by ``pdserve promote`` (``check_renderable``; before any run is created).

    MLflow's own "View run ... at: <URI>" lines are not printed (they would repeat a URI's password).
    """
    with _no_run_links():
        return _log_tuning(result, tracking_uri=tracking_uri, experiment=experiment,
                           registered_model=registered_model, artifacts_dir=artifacts_dir, model_ref=model_ref,
                           spec=spec, traffic_trace_uri=traffic_trace_uri, comparison=comparison,
                           compared_version=compared_version, inherited_from=inherited_from,
                           gpu_option=gpu_option)


def _comparison_log(cmp: "ChampionComparison", compared_version: str | None
                    ) -> tuple[dict[str, str], dict[str, float], dict[str, str]]:
    """Params, metrics and tags of a challenger-vs-champion comparison for the parent run."""
    metrics: dict[str, float] = {"champion_min_improvement_pct": cmp.min_improvement_pct,
                                 "champion_replaced": 1.0 if cmp.replace else 0.0}
    for side, c in (("champion", cmp.champion), ("challenger", cmp.challenger)):
        metrics[f"{side}_feasible"] = 1.0 if c.feasible else 0.0
        if c.feasible:
            metrics[f"{side}_num_gpus"] = float(c.num_gpus)
            metrics[f"{side}_goodput_per_gpu"] = float(c.goodput_per_gpu)
            if c.usd_per_mtok is not None:
                metrics[f"{side}_usd_per_mtok"] = float(c.usd_per_mtok)
    if cmp.improvement_pct is not None:
        metrics["champion_improvement_pct"] = float(cmp.improvement_pct)
    ch = cmp.champion
    params = {"champion_prefill_tp": str(ch.prefill.tp), "champion_decode_tp": str(ch.decode.tp),
              "champion_prefill_layout": ch.prefill.label, "champion_decode_layout": ch.decode.label,
              "champion_metric": cmp.metric or "none"}
    if compared_version is not None:
        params["champion_version"] = str(compared_version)
    tags = {"pdserve.champion_decision": "replaced" if cmp.replace else "kept",
            "pdserve.champion_reason": cmp.reason[:4000]}
    return params, {k: v for k, v in metrics.items() if math.isfinite(v)}, tags


def _log_tuning(result: TuneResult, *, tracking_uri: str, experiment: str, registered_model: str | None,
                artifacts_dir: Path | None, model_ref: ModelRef | None, spec: DeploymentSpec | None,
                traffic_trace_uri: str | None = None, comparison: "ChampionComparison | None" = None,
                compared_version: str | None = None, inherited_from: str | None = None,
                gpu_option: str | None = None) -> str | None:
    if registered_model is not None:
        check_registered_model_name(registered_model)  # before any run exists
    if spec is None and (registered_model is not None or result.precision in DEPLOYABLE_PRECISIONS):
        spec = result.to_deployment_spec(model_ref or ModelRef(name=result.model.name))
    # else: measured mode (CPU, fp32): not a deployable GPU spec, so the runs are logged without one
    if registered_model is not None:
        check_renderable(spec, registered_model)  # a champion promote cannot render must not be registered
    client = _client(tracking_uri)
    exp_id = _experiment_id(client, experiment, artifacts_dir or default_artifact_root(tracking_uri))
    b = result.best
    parent = client.create_run(exp_id, run_name=f"tune-{result.model.name.split('/')[-1]}-{result.gpu.name}")
    pid = parent.info.run_id
    try:
        params = _candidate_params(result, b)
        params = {k: v for k, v in params.items()
                  if k not in ("prefill_tp", "decode_tp", "prefill_worker_gpus", "decode_worker_gpus")}
        params["num_candidates"] = str(len(result.candidates))
        if traffic_trace_uri:
            params["traffic_trace_uri"] = traffic_trace_uri
        if spec is not None:  # what `pdserve tune --like` inherits besides gpu, precision and SLO
            params.update(gpu_budget=str(spec.planner.gpu_budget), planner_mode=spec.planner.mode)
        if inherited_from:
            params["inherited_from"] = inherited_from
        if gpu_option and gpu_option != result.gpu.name:
            params["gpu_option"] = gpu_option
        metrics = {f"best_{k}": v for k, v in _candidate_metrics(b).items()}
        metrics.update(best_prefill_tp=float(b.prefill.tp), best_decode_tp=float(b.decode.tp),
                       best_prefill_worker_gpus=float(b.prefill.gpus), best_decode_worker_gpus=float(b.decode.gpus),
                       num_feasible=float(sum(c.feasible for c in result.candidates)),
                       best_engine_kv_capacity_tokens=float(result.engine_kv_capacity_tokens))
        tags = {"pdserve.kind": "tuning", "pdserve.winner": b.label}
        if comparison is not None:
            cp, cm, ct = _comparison_log(comparison, compared_version)
            params.update(cp)
            metrics.update(cm)
            tags.update(ct)
        _log(client, pid, params, metrics, tags)
        for c in result.candidates:
            child = client.create_run(
                exp_id, run_name=c.label, tags={"mlflow.parentRunId": pid, "pdserve.kind": "candidate"}
            )
            tags = {"feasible": str(c.feasible).lower(), "reason": c.reason[:4000],
                    "champion": str(c == b).lower()}
            try:
                _log(client, child.info.run_id, _candidate_params(result, c), _candidate_metrics(c), tags)
            except BaseException:
                _end_failed(client, child.info.run_id)
                raise
            client.set_terminated(child.info.run_id)

        with tempfile.TemporaryDirectory(prefix="pdserve-tune-") as tmp:
            t = Path(tmp)
            png = pareto_png(result, t / "pareto.png")
            (t / "pareto.html").write_text(pareto_html(result, png))
            (t / "candidates.md").write_text(result.markdown_table())
            from runtime.tuner.profiles import ProfilePerf

            if isinstance(result.perf, ProfilePerf):  # measured mode: log the measurements
                prof = result.perf.profiles
            else:
                # profiles of plain-TP workers only (a planner scales those; other layouts have no profile yet)
                prof = build_profiles(result.perf or deployment_perf(result.model, result.gpu, result.precision),
                                      tuple(sorted({c.prefill_tp for c in result.candidates if c.plain_tp})),
                                      tuple(sorted({c.decode_tp for c in result.candidates if c.plain_tp})))
            write_profiles(prof, t / "profiles")
            for name in ("pareto.png", "pareto.html", "candidates.md"):
                client.log_artifact(pid, str(t / name))
            client.log_artifacts(pid, str(t / "profiles"), "profiles")
            if spec is not None:
                (t / "deployment").mkdir()
                (t / SPEC_ARTIFACT).write_text(spec.model_dump_json(indent=2))
                client.log_artifacts(pid, str(t / "deployment"), "deployment")
        client.set_terminated(pid)
    except BaseException:
        _end_failed(client, pid)
        raise

    if registered_model is None:
        return None
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(registered_model)
    except MlflowException as e:
        if "already exists" not in str(e).lower() and "RESOURCE_ALREADY_EXISTS" not in str(e):
            raise
    source = f"{client.get_run(pid).info.artifact_uri}/deployment"
    promote, why = True, ""
    if comparison is not None:
        promote, why = comparison.replace, comparison.reason
        if promote and compared_version is not None:
            now = _alias_version(client, registered_model)  # compare-then-set: not atomic, but never blind
            if now != str(compared_version):
                promote, why = False, (f"the {CHAMPION_ALIAS!r} alias moved from version {compared_version} to "
                                       f"{now} while this tuning ran; compare again before replacing it")
                client.set_tag(pid, "pdserve.champion_decision", "kept")
                client.set_tag(pid, "pdserve.champion_reason", why)
    # prefill_tp / decode_tp: vLLM --tensor-parallel-size of each pool; the layout and GPUs say the rest
    tags = {"prefill_tp": str(b.prefill.tp), "decode_tp": str(b.decode.tp), "gpu": result.gpu.name,
            "prefill_layout": b.prefill.label, "decode_layout": b.decode.label,
            "prefill_worker_gpus": str(b.prefill.gpus), "decode_worker_gpus": str(b.decode.gpus)}
    if gpu_option and gpu_option != result.gpu.name:
        tags[GPU_OPTION_TAG] = gpu_option
    if comparison is not None:
        tags.update({"pdserve.champion_decision": "replaced" if promote else "kept",
                     "pdserve.champion_reason": why[:4000]})
    mv = client.create_model_version(
        registered_model, source=source, run_id=pid, tags=tags,
        description=f"pdserve tuning winner {b.label} for {result.model.name} on {result.gpu.name}"
                    + ("" if promote else f"; not the {CHAMPION_ALIAS}: {why}"),
    )
    if promote:
        client.set_registered_model_alias(registered_model, CHAMPION_ALIAS, mv.version)
    return str(mv.version)


def _alias_version(client, registered_model: str) -> str | None:
    """The version behind alias ``champion``; None when the model or the alias does not exist.

    Raises:
        mlflow.exceptions.MlflowException: any other failure (MLflow unreachable, refused).
    """
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(registered_model, CHAMPION_ALIAS).version)
    except MlflowException as e:
        if e.error_code in NOT_FOUND_CODES:
            return None
        raise


INHERITED_FIELDS = ("gpu", "precision", "slo.ttft_p90_ms", "slo.itl_p90_ms", "planner.gpu_budget", "planner.mode")
"""The DeploymentSpec fields ``pdserve tune --like`` takes from a champion (dotted paths in its JSON)."""


def champion_version(tracking_uri: str, registered_model: str) -> str | None:
    """The version behind alias ``champion`` of ``registered_model``; None when the model or the alias is absent.

    Raises:
        TrackingError: MLflow could not be asked (message redacted, names the registered model).
    """
    from mlflow.exceptions import MlflowException

    from runtime.redact import redact_userinfo

    try:
        return _alias_version(_client(tracking_uri), registered_model)
    except MlflowException as e:
        raise TrackingError(f"cannot read alias {CHAMPION_ALIAS!r} of registered model {registered_model!r} from "
                            f"MLflow at {redact_userinfo(tracking_uri)} ({e.error_code}): "
                            f"{redact_userinfo(str(e))}") from None


def champion_gpu_option(tracking_uri: str, registered_model: str, version: str) -> str | None:
    """The ``--gpu`` value (an AWS instance type) version ``version`` of ``registered_model`` was tuned with
    (tag ``pdserve.gpu_option``, :func:`log_tuning` ``gpu_option``); None when the tuning was given the GPU's
    catalog name (the spec's ``gpu``) or the version predates the tag.

    Raises:
        TrackingError: MLflow could not be asked (message redacted, names the registered model and version).
    """
    from mlflow.exceptions import MlflowException

    from runtime.redact import redact_userinfo

    try:
        mv = _client(tracking_uri).get_model_version(registered_model, str(version))
    except MlflowException as e:
        raise TrackingError(f"cannot read version {version} of registered model {registered_model!r} from MLflow "
                            f"at {redact_userinfo(tracking_uri)} ({e.error_code}): {redact_userinfo(str(e))}"
                            ) from None
    return (mv.tags or {}).get(GPU_OPTION_TAG) or None


def find_champion(tracking_uri: str, registered_model: str) -> tuple[str, DeploymentSpec] | None:
    """:func:`load_champion`, or None when ``registered_model`` or its ``champion`` alias does not exist (a first
    registration). Every other failure raises as :func:`load_champion` does (TrackingError)."""
    if champion_version(tracking_uri, registered_model) is None:
        return None
    return load_champion(tracking_uri, registered_model)


def _missing(doc: object, paths: tuple[str, ...]) -> list[str]:
    """The dotted ``paths`` that name no value in the JSON object ``doc``."""
    out = []
    for path in paths:
        node = doc
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            out.append(path)
    return out


def load_champion(tracking_uri: str, registered_model: str, *,
                  require: tuple[str, ...] = ()) -> tuple[str, DeploymentSpec]:
    """The version behind alias ``champion`` and its DeploymentSpec (validated).

    Args:
        require: dotted DeploymentSpec fields (e.g. :data:`INHERITED_FIELDS`) that the artifact's JSON must
            state itself: a spec written before a field existed validates with that field's default, which a
            caller inheriting the value must not take for the champion's.

    Raises:
        TrackingError: no such registered model, or it has no ``champion`` alias (the message says which, and
            lists the versions there are), the spec artifact is missing, or MLflow could not be asked
            (connection refused, auth, server error: said so, not reported as a missing champion).
            Also: the spec artifact is unreadable, empty, not UTF-8 JSON or not a valid DeploymentSpec (the
            message names the registered model, version, artifact and run, and the failing fields), or lacks
            a ``require``d field (MissingFieldsError; the message names every missing one).
            Messages never contain the userinfo (`user:password@`) of a URI (runtime/redact.py).
    """
    from mlflow.exceptions import MlflowException
    from pydantic import ValidationError

    from runtime.redact import redact_userinfo

    client = _client(tracking_uri)
    where = redact_userinfo(tracking_uri)
    try:
        mv = client.get_model_version_by_alias(registered_model, CHAMPION_ALIAS)
    except MlflowException as e:
        detail = redact_userinfo(str(e))
        if e.error_code in NOT_FOUND_CODES:
            raise TrackingError(
                f"registered model {registered_model!r} has no {CHAMPION_ALIAS!r} version at {where}: "
                f"{_why_no_champion(client, registered_model) or detail}"
            ) from None
        raise TrackingError(f"cannot read alias {CHAMPION_ALIAS!r} of registered model {registered_model!r} from "
                            f"MLflow at {where} ({e.error_code}): {detail}") from None
    with tempfile.TemporaryDirectory(prefix="pdserve-champion-") as tmp:
        try:
            local = client.download_artifacts(mv.run_id, SPEC_ARTIFACT, tmp)
        except (MlflowException, OSError) as e:
            raise TrackingError(
                f"{registered_model} v{mv.version}: artifact {SPEC_ARTIFACT} missing in run {mv.run_id}: "
                f"{redact_userinfo(str(e))}"
            ) from None
        what = f"registered model {registered_model!r} version {mv.version}: artifact {SPEC_ARTIFACT} of run {mv.run_id}"
        problem, missing = None, []
        try:
            raw = Path(local).read_bytes()
            spec = DeploymentSpec.model_validate_json(raw)
        except OSError as e:
            problem = f"cannot be read: {e.strerror or e}"
        except ValidationError as e:  # not JSON (empty, truncated, not UTF-8) or not a DeploymentSpec
            problem = "is not a valid DeploymentSpec: " + "; ".join(
                f"{'.'.join(map(str, x['loc'])) or 'document'}: {x['msg']}" for x in e.errors(include_url=False))
        else:
            missing = _missing(json.loads(raw), tuple(require)) if require else []
            if missing:
                problem = (f"does not state {', '.join(missing)} (a spec written before "
                           f"{'that field' if len(missing) == 1 else 'those fields'} existed?), so "
                           f"{'it' if len(missing) == 1 else 'they'} cannot be inherited: give "
                           f"{'it' if len(missing) == 1 else 'them'} explicitly")
        if missing:
            raise MissingFieldsError(f"{what} {problem}", missing)
        if problem is not None:
            raise TrackingError(f"{what} {problem}")
    return str(mv.version), spec


def _why_no_champion(client, registered_model: str) -> str | None:
    """``no such registered model`` or ``the alias is not set (versions: 1, 2)``; None when MLflow cannot say."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(registered_model)
    except MlflowException as e:
        return "no such registered model" if e.error_code == "RESOURCE_DOES_NOT_EXIST" else None
    try:
        versions = sorted((int(v.version) for v in client.search_model_versions(f"name='{registered_model}'")))
    except (MlflowException, ValueError):
        versions = []
    listed = f" (versions: {', '.join(map(str, versions))})" if versions else " (it has no versions)"
    return f"the model exists but its {CHAMPION_ALIAS!r} alias is not set{listed}"
