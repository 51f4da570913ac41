"""The one pydantic configuration tree of pdserve.

`DeploymentSpec` is what the tuner produces, what MLflow registers, what `promote` renders into
Kubernetes objects and what the runtime (router + planner) runs from. Every field has a description
and, where it has one, a unit in its name (``*_ms``, ``*_s``, ``*_tokens``, ``num_*``).

Validation happens at the edge (CLI, pipeline components, server start); the pure core receives
validated objects. No globals are read at import time. Every float field refuses Infinity and NaN (they do
not survive a JSON round trip); a pool's replicas lie within [min_replicas, max_replicas]; model.name and
planner.predictor are checked against the same rules the stager and the planner apply.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator, model_serializer,
                      model_validator)

from runtime.planner.types import SPEC_SETTINGS, PlannerConfig

Precision = Literal["bf16", "fp8"]
TP_DEGREES = (1, 2, 4, 8)
LAYOUT_DEFAULTS = {"pp": 1, "dp": 1, "ep": False, "nodes": 1}  # PoolSpec's plain single-node TP layout


class _Strict(BaseModel):
    # allow_inf_nan=False: every float field of the tree refuses Infinity/NaN. JSON has no such numbers
    # (model_dump_json writes them as null), so a spec holding one would not survive the trip to the
    # runtime (`pdserve serve` hands it RouterSpec/DeploymentSpec JSON) or to MLflow / `tune --out`.
    model_config = ConfigDict(extra="forbid", frozen=False, allow_inf_nan=False)


def check_model_name(model_name: str) -> str:
    """Return `model_name` when it is a clean relative path under `models/` (e.g. `llama8` or `org/llama8`).

    Raises:
        ValueError: empty, absolute, containing a NUL or a backslash, or with an empty, `.` or `..` component
            (each of which would publish outside `<fsx_root>/models/` or at a different name); containing
            whitespace or a `$`, or starting with `-` (the rendered workers take the name as a container argument:
            the kubelet expands `$(VAR)` there, and vLLM reads a leading `-` as an option), which the renderer
            (runtime/deploy/render.py) refuses: such a name could be tuned and registered but never deployed.
    """
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name {model_name!r}: must be a non-empty relative path under models/")
    if "\0" in model_name or "\\" in model_name:
        raise ValueError(f"model_name {model_name!r}: must not contain a NUL or a backslash")
    if model_name.startswith("/"):
        raise ValueError(f"model_name {model_name!r}: must be relative to <fsx_root>/models, not absolute")
    if any(part in ("", ".", "..") for part in model_name.split("/")):
        raise ValueError(f"model_name {model_name!r}: every path component must be a name (no empty, '.' or '..')")
    if any(c.isspace() for c in model_name) or "$" in model_name or model_name.startswith("-"):
        raise ValueError(f"model_name {model_name!r}: must not contain whitespace or '$' nor start with '-' (the "
                         "workers take it as a container argument)")
    return model_name


class ModelRef(_Strict):
    """Which model is served and where its weights are."""

    name: str = Field(
        min_length=1,
        description="Model name used in the OpenAI API (`model` field), in MLflow and as the staged folder "
        "name under models/: a clean relative path such as `llama8` or `org/llama8` (no empty, '.' or '..' "
        "component, no leading '/' or '-', no NUL, backslash, whitespace or '$'; runtime.config.check_model_name).",
    )
    path: str = Field(
        default="",
        description="Folder with config.json, weights and tokenizer (a staged FSx path or a local folder).",
    )
    storage_uri: str = Field(
        default="",
        description="Where KServe finds the weights on the cluster, e.g. pvc://fsx-claim/models/<name>.",
    )
    quantization: str = Field(
        default="",
        description="The checkpoint's own quantization (config.json quantization_config.quant_method: fp8, "
        "modelopt, mxfp4, ...); '' for a bf16/fp16 checkpoint. vLLM reads it from the checkpoint itself.",
    )
    mla: bool = Field(
        default=False,
        description="The model caches MLA's compressed KV latent (DeepSeek-V2/V3): vLLM's NixlConnector then "
        "accepts a prefill TP larger than the decode TP (the latent is whole on every rank).",
    )
    context_tokens: int = Field(
        default=0, ge=0,
        description="The model's context window, tokens, as `tune` read it from config.json (the length vLLM "
        "derives from it); 0 when unknown. `promote --max-model-len` is held to it when the model folder cannot "
        "be read where promote runs.",
    )

    @field_validator("name")
    @classmethod
    def _clean_name(cls, v: str) -> str:
        try:
            return check_model_name(v)
        except ValueError as exc:
            raise ValueError(str(exc).replace("model_name", "model.name", 1)) from None


class SloSpec(_Strict):
    """Latency service-level objectives, both as 90th percentiles."""

    ttft_p90_ms: float = Field(default=2000.0, gt=0, allow_inf_nan=False,
                               description="Time to first token, p90, milliseconds.")
    itl_p90_ms: float = Field(default=50.0, gt=0, allow_inf_nan=False,
                              description="Inter-token latency (TPOT), p90, milliseconds.")


class WorkloadSpec(_Strict):
    """The traffic the deployment is sized for."""

    isl_tokens: int = Field(default=3000, gt=0, description="Mean input sequence length, tokens.")
    osl_tokens: int = Field(default=150, gt=0, description="Mean output sequence length, tokens.")
    request_rate_per_s: float = Field(default=10.0, gt=0, allow_inf_nan=False, description="Target request rate, requests/s.")

    def check_max_model_len(self, max_model_len_tokens: object) -> None:
        """Refuse a vLLM ``--max-model-len`` that is no positive number of tokens or that would refuse the
        requests this workload describes (below ISL + OSL).

        Raises:
            ValueError: either, the message naming the bound.
        """
        if isinstance(max_model_len_tokens, bool) or not isinstance(max_model_len_tokens, int) \
                or max_model_len_tokens <= 0:
            raise ValueError(f"max_model_len must be a positive number of tokens, got {max_model_len_tokens!r}")
        need = self.isl_tokens + self.osl_tokens
        if max_model_len_tokens < need:
            raise ValueError(f"max_model_len {max_model_len_tokens} < the workload's ISL + OSL ({need} tokens): the "
                             "requests this configuration is tuned for would be refused")


class PoolSpec(_Strict):
    """One worker pool (prefill or decode)."""

    tp: int = Field(default=1, description="Tensor-parallel degree (a worker holds tp x dp x pp GPUs; `gpus`).")
    replicas: int = Field(default=1, ge=0, description="Number of workers.")
    min_replicas: int = Field(default=1, ge=0, description="Planner lower bound.")
    max_replicas: int = Field(default=8, ge=1, description="Planner upper bound.")
    # The worker's parallel layout (runtime/perf/worker.py Layout; docs/design/perf-model.md#parallel-layouts).
    # Defaults state plain TP on one node; spec_digest leaves them out at their defaults (runtime/deploy/render.py).
    pp: int = Field(default=1, ge=1, description="Pipeline stages per worker (vLLM --pipeline-parallel-size).")
    dp: int = Field(default=1, ge=1, description="Attention data-parallel ranks per worker, each of `tp` GPUs "
                    "(vLLM --data-parallel-size); > 1 only with `ep`.")
    ep: bool = Field(default=False, description="Experts split whole over the worker's tp x dp GPUs "
                     "(vLLM --enable-expert-parallel; MoE models).")
    nodes: int = Field(default=1, ge=1, description="Nodes one worker spans (a LeaderWorkerSet group of that "
                       "many pods when > 1); each holds tp x dp x pp / nodes GPUs.")

    @property
    def gpus(self) -> int:
        """GPUs of one worker: tp x dp x pp."""
        return self.tp * self.dp * self.pp

    @model_serializer(mode="wrap")
    def _layout_if_set(self, handler: SerializerFunctionWrapHandler) -> dict:
        # layout fields at their defaults are left out: a plain-TP spec serialises (and hashes, render.spec_digest)
        # to the same JSON whether or not it was written by a pdserve that knows layouts
        out = handler(self)
        return {k: v for k, v in out.items() if k not in LAYOUT_DEFAULTS or v != LAYOUT_DEFAULTS[k]}

    @field_validator("tp")
    @classmethod
    def _tp_is_power_of_two(cls, v: int) -> int:
        if v not in TP_DEGREES:
            raise ValueError(f"tp must be one of {TP_DEGREES}, got {v}")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> "PoolSpec":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        # the planner only ever moves a pool within [min_replicas, max_replicas]; a starting point outside
        # it would be "corrected" on the first tick (and render refuses replicas > max_replicas)
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"replicas {self.replicas} is outside [min_replicas {self.min_replicas}, "
                             f"max_replicas {self.max_replicas}]")
        return self._layout()

    def _layout(self) -> "PoolSpec":
        # runtime/tuner/layouts.py rules 6-7, and what vLLM's multi-node launch splits evenly
        if self.dp > 1 and not self.ep:
            raise ValueError(f"dp {self.dp} without ep: data-parallel attention is deployed with expert "
                             "parallelism only (without it the ranks are replicas: raise replicas instead)")
        if self.dp > 1 and self.pp > 1:
            raise ValueError(f"dp {self.dp} with pp {self.pp}: data-parallel attention with pipeline stages "
                             "is not a layout pdserve deploys")
        if self.gpus % self.nodes or self.tp > self.gpus // self.nodes:
            raise ValueError(f"nodes {self.nodes}: tp {self.tp} x dp {self.dp} x pp {self.pp} GPUs do not split "
                             "into whole tensor-parallel groups per node (tensor parallelism stays in a node)")
        if self.nodes > 1 and self.pp > 1 and self.pp % self.nodes:
            raise ValueError(f"pp {self.pp} over nodes {self.nodes}: every node must hold whole pipeline stages")
        if self.nodes > 1 and self.dp > 1 and self.dp % self.nodes:
            # vLLM starts --data-parallel-size-local ranks on each node, and the runtime finds rank r on the pod
            # of node r // (dp / nodes)
            raise ValueError(f"dp {self.dp} over nodes {self.nodes}: every node runs the same number of "
                             "data-parallel ranks")
        return self


class KvOffloadSpec(_Strict):
    """KV cache tiers below the GPU, through vLLM's own offloading connector (docs/architecture.md#kv-cache-tiers).

    Rendered as vLLM ``OffloadingConnector`` composed with the NIXL connector in a ``MultiConnector``
    (runtime/engines/vllm_worker.py ``kv_transfer_config``). vLLM 0.28 runs it on CUDA/XPU GPUs only.
    """

    cpu_gib: float = Field(
        default=0.0,
        ge=0,
        description="Host-memory KV tier per vLLM engine, GiB: its tp x pp GPU ranks together (a worker with "
        "attention data parallelism holds one per dp rank); 0 = no offload tier (vLLM kv_connector_extra_config."
        "cpu_bytes_to_use of the OffloadingConnector). Blocks are evicted LRU.",
    )
    disk_path: str | None = Field(
        default=None,
        min_length=1,
        description="Filesystem tier below the CPU tier, a folder on the worker (on Kubernetes a node-local emptyDir "
        "is mounted there); None = none. Needs cpu_gib > 0 (it reads through the CPU tier: vLLM TieringOffloadingSpec, secondary tier "
        "'fs'). vLLM 0.28 neither bounds nor evicts this tier: size the volume and clean it outside vLLM.",
    )

    @model_validator(mode="after")
    def _disk_needs_cpu(self) -> "KvOffloadSpec":
        if self.disk_path is not None and self.cpu_gib <= 0:
            raise ValueError("kv_offload.disk_path needs kv_offload.cpu_gib > 0: vLLM's filesystem tier is a "
                             "secondary tier that loads through the CPU tier")
        return self


#: vLLM NIXL `kv_lease_duration` default, seconds (vllm/distributed/kv_transfer/kv_connector/v1/nixl/
#: base_scheduler.py, 0.28): a prefill worker's lease when `EngineSpec.kv_lease_s` is None.
DEFAULT_KV_LEASE_S = 30.0


class EngineSpec(_Strict):
    """vLLM worker settings that prefill and decode must share (NixlConnector requires it)."""

    dtype: Literal["auto", "bfloat16", "float", "float16", "float32", "half"] = Field(
        default="bfloat16",
        description="Weights/activation dtype passed to vLLM --dtype; vLLM's own choices (vllm/config/model.py ModelDType: "
        "auto, bfloat16, float, float16, float32, half). Precision names such as bf16/fp8 are not dtypes: "
        "FP8 is DeploymentSpec.precision (quantization and KV-cache flags).",
    )
    block_size_tokens: int = Field(default=16, gt=0, description="KV block size, tokens (vLLM --block-size).")
    max_model_len_tokens: int = Field(default=4096, gt=0, description="vLLM --max-model-len, tokens.")
    kv_capacity_tokens: int = Field(
        default=0,
        ge=0,
        description="KV cache capacity of one engine (a prefill or a decode worker, one DP rank of a "
        "data-parallel one; the smaller of the two), tokens, as the tuner's performance model sizes it at "
        "gpu_memory_utilization; 0: not known. A max_model_len_tokens above it is refused (vLLM does not start "
        "when one sequence of that length does not fit).",
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="vLLM memory fraction.")
    kv_backends: list[str] = Field(
        default_factory=lambda: ["UCX"],
        min_length=1,
        description="NIXL backends; LIBFABRIC on EKS nodes with EFA (UCX silently falls back to TCP there).",
    )
    kv_lease_s: int | None = Field(
        default=None,
        ge=6,
        description="Seconds a prefill worker keeps a finished request's KV blocks for the decode worker to "
        "pull (vLLM kv_connector_extra_config.kv_lease_duration; >= 6: vLLM heartbeats every lease // 6 s). "
        "None: vLLM's own default (30 s in vLLM 0.28). The runtime is told the lease and bounds every decode "
        "leg by it (docs/serving.md).",
    )
    kv_offload: KvOffloadSpec = Field(
        default_factory=KvOffloadSpec,
        description="KV cache tiers below the GPU (CPU memory, filesystem) per worker (KvOffloadSpec).",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Extra vLLM CLI arguments (not --scheduling-policy: router.prefill_priority sets the prefill "
        "workers' policy, and the runtime's priorities must match it).",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_scheduling_policy(cls, v: list[str]) -> list[str]:
        for a in v:
            if a.replace("_", "-").split("=", 1)[0] == "--scheduling-policy":
                raise ValueError("--scheduling-policy in engine.extra_args: set router.prefill_priority instead "
                                 "('length': prefill workers schedule by the runtime's priorities; 'fcfs': none)")
        return v


class RouterSpec(_Strict):
    """KV-cache-aware disaggregated router settings (see runtime/router)."""

    policy: str = Field(
        default="kv_aware",
        description="Routing policy name: kv_aware, dynamo_cost, least_loaded, round_robin or random "
        "(registry runtime.router.policies.POLICIES).",
    )
    overlap_weight: float = Field(
        default=1.0,
        ge=0,
        description="dynamo_cost: Dynamo's overlap_score_weight, the weight of (uncached) prefill blocks "
        "against decode blocks in its cost (dimensionless).",
    )
    temperature: float = Field(default=0.0, ge=0, description="Softmax temperature; 0 = argmin.")
    disagg_min_uncached_tokens: int = Field(
        default=512,
        ge=0,
        description="Prefill locally on the decode worker when the uncached prompt part is shorter (tokens).",
    )
    migration_limit: int = Field(
        default=1,
        ge=0,
        description="Decode-worker failovers allowed per request; 0 ends a request whose decode worker fails with "
                    "an error (a stream continued after its first tokens goes on from the tokens sent, or ends "
                    "with an error that says why: docs/serving.md).",
    )
    approx_ttl_s: float = Field(default=120.0, gt=0, description="TTL of learned (approximate) prefix entries, s.")
    decode_weight: float = Field(
        default=0.0,
        ge=0,
        description="kv_aware cost when choosing where to prefill: weight of one active decode token "
        "relative to one queued prefill token (dimensionless; see runtime/router/policies.py). The decode "
        "pool of a disaggregated deployment is always chosen with weight >= 1 (load + own cache).",
    )
    balance_weight: float = Field(
        default=0.02,
        ge=0,
        description="kv_aware cost: penalty per unit of prefill work (seconds with a performance model, "
        "else tokens) by which a worker's cumulative routed prefill exceeds the pool mean (dimensionless "
        "ratio; evens out long-run busy time; Mooncake bench: imbalance 1.6-1.8 at 0 -> 1.01-1.06 at 0.02).",
    )
    inflight_overlap: bool = Field(
        default=False,
        description="kv_aware: also count prefixes of routed requests whose prefill has not finished (before "
        "their KV events arrive) as cached; costs ~2 index updates of the prompt's blocks per request.",
    )
    prefill_priority: Literal["length", "fcfs"] = Field(
        default="length",
        description="Order of each prefill worker's waiting queue. 'length': short prompts first, by "
        "power-of-two prompt-length bucket with aging (a prompt yields only to shorter ones arriving within "
        "bucket x 1 s after it, so long prompts cannot starve; runtime/router/priority.py); the prefill "
        "workers run vLLM --scheduling-policy priority and the runtime sets every prefill request's "
        "priority (a client's is replaced), so short prompts do not miss TTFT behind a multi-second "
        "prefill. 'fcfs': vLLM's default first come, first served.",
    )
    disagg_max_prefill_queue_tokens: int = Field(
        default=32768,
        ge=0,
        description="Prefill pool counts as saturated (prefill locally on the decode worker) when even the "
        "chosen prefill worker has more queued uncached prompt tokens than this (tokens).",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from runtime.router.policies import POLICIES  # lazy: the router package imports this module

        if v not in POLICIES:
            raise ValueError(f"unknown router policy {v!r}; choose one of {sorted(POLICIES)}")
        return v


def planner_field(name: str, **override: Any) -> Any:
    """The PlannerSpec field for PlannerConfig's setting ``name``: its default, description and bounds are
    declared once, on the core's field (runtime.planner.types.setting); ``override`` replaces any of them
    here. Raises KeyError for a name that is not such a setting."""
    f = _PLANNER_SETTINGS[name]
    kw = {"default": f.default, "description": f.metadata["doc"], **f.metadata["bounds"]} | override
    return Field(**kw)


_PLANNER_SETTINGS = {f.name: f for f in dataclasses.fields(PlannerConfig) if f.name in SPEC_SETTINGS}


class PlannerSpec(_Strict):
    """SLO planner settings (see runtime/planner)."""

    mode: Literal["off", "sla", "load"] = Field(default="off", description="Scaling mode.")
    predictor: str = planner_field("predictor")
    interval_s: float = planner_field("interval_s")
    drain_cap_s: float = Field(
        default=120.0, gt=0, le=3600,
        description="Longest drain of a worker a scale-down removes, seconds: it takes no new request and is "
        "stopped once its in-flight requests finish, or after this long (streams still running then continue "
        "on another decode worker); Kubernetes worker pods get it as their preStop wait and grace period. At "
        "least the prefill workers' KV lease (engine.kv_lease_s), which a draining prefill worker holds for.")
    gpu_budget: int = planner_field("gpu_budget")
    predictor_window_ticks: int = planner_field("predictor_window_ticks")
    window_hold_s: float = planner_field("window_hold_s")
    burst_quantile: float = planner_field("burst_quantile")
    worker_start_s: float = planner_field("worker_start_s")
    scale_down_delay_s: float = planner_field("scale_down_delay_s")
    decode_scale_down_delay_s: float = planner_field("decode_scale_down_delay_s")
    cooldown_s: float = planner_field("cooldown_s")
    size_on_peak: bool = planner_field("size_on_peak")
    peak_window_ticks: int | None = planner_field("peak_window_ticks")
    peak_quantile: float | None = planner_field("peak_quantile")
    prefill_staffing_beta: float | None = planner_field("prefill_staffing_beta")
    staffing_dispersion_ref: float | None = planner_field("staffing_dispersion_ref")
    staffing_dispersion_floor: float = planner_field("staffing_dispersion_floor")
    prefill_level_window_ticks: int = planner_field("prefill_level_window_ticks")
    ttft_correction_max: float = planner_field("ttft_correction_max")
    target_utilization: float = planner_field("target_utilization")
    reserved_priority_share: float = planner_field("reserved_priority_share")
    burst_headroom: float = planner_field("burst_headroom")
    burst_factor: float = planner_field("burst_factor")
    burst_max_s: float = planner_field("burst_max_s")
    allow_aggregated: bool = planner_field("allow_aggregated")
    load_queue_up_per_worker: float = planner_field("load_queue_up_per_worker")
    load_queue_down_per_worker: float = planner_field("load_queue_down_per_worker")
    load_kv_up: float = planner_field("load_kv_up")
    load_kv_down: float = planner_field("load_kv_down")

    @field_validator("predictor")
    @classmethod
    def _known_predictor(cls, v: str) -> str:
        from runtime.planner.predictors import PREDICTORS  # lazy, like RouterSpec's policy check

        if v not in PREDICTORS:
            raise ValueError(f"unknown planner.predictor {v!r}; choose one of {sorted(PREDICTORS)}")
        return v

    @model_validator(mode="after")
    def _load_thresholds_ordered(self) -> "PlannerSpec":
        if self.load_kv_down >= self.load_kv_up:
            raise ValueError(f"planner.load_kv_down ({self.load_kv_down}) must be < load_kv_up ({self.load_kv_up})")
        if self.load_queue_down_per_worker >= self.load_queue_up_per_worker:
            raise ValueError(
                f"planner.load_queue_down_per_worker ({self.load_queue_down_per_worker}) must be < "
                f"load_queue_up_per_worker ({self.load_queue_up_per_worker})"
            )
        return self


class OverloadSpec(_Strict):
    """Overload protection of the runtime: per-worker circuit breakers and admission control
    (runtime/router/breaker.py, runtime/router/admission.py)."""

    breaker_failures: int = Field(
        default=3, ge=1,
        description="Failures in a row (5xx answers, failed or slow health checks) that open a worker's breaker "
        "(no traffic); a refused or reset connection opens it at once.")
    breaker_cooldown_s: float = Field(
        default=10.0, gt=0, description="Seconds an open breaker waits before it lets probes through (half-open).")
    breaker_probes: int = Field(
        default=2, ge=1,
        description="Successful probes (health checks of a half-open worker, one at a time) that close its "
        "breaker; a failed probe opens it again.")
    breaker_latency_factor: float = Field(
        default=10.0, gt=1,
        description="A health check slower than this many times the other workers' median recent health-check "
        "latency (and than breaker_latency_floor_s) counts as a failure (dimensionless).")
    breaker_latency_floor_s: float = Field(
        default=1.0, gt=0, description="Health checks at least this fast are never latency outliers, seconds.")
    breaker_latency_window: int = Field(
        default=3, ge=1,
        description="Recent health-check latencies kept per worker: a worker's median over its last N is its "
        "part of the outlier test's baseline once it has N (a larger N outlasts more odd checks but follows a "
        "pool-wide slow-down more slowly; keep it below 2 x breaker_failures).")
    breaker_stall_s: float = Field(
        default=12.0, gt=0,
        description="Seconds every stream in flight on a worker that has sent its first chunk must receive nothing "
        "for the worker to be stalled (its engine stopped generating while /health answers): each check round it "
        "is stalled counts as a failed health check. A queue wait before a first token never counts, nor does a "
        "stream that may pause while its engine works (a stream_interval above 1, tools) or one its client does "
        "not read. Default: the "
        "breaker's evidence window with the default settings, breaker_failures x (2 s check interval + 2 s health "
        "timeout), well above a live engine's longest step (a chunked-prefill step on CPU takes seconds).")
    shed_ttft_factor: float | None = Field(
        default=None, gt=0,
        description="Admission control: answer 429 with Retry-After when a request's predicted TTFT (queue "
        "wait included) exceeds this many times slo.ttft_p90_ms (below 1: headroom for the prediction's "
        "error); null: admit everything.")
    shed_priority_factor: float = Field(
        default=2.0, ge=1,
        description="Priority traffic (prompts in priority bucket 0, runtime/router/priority.py) is shed only "
        "when its predicted TTFT exceeds this many times the bound of other traffic.")


class DeploymentSpec(_Strict):
    """Everything needed to deploy one disaggregated model endpoint."""

    model: ModelRef = Field(description="The served model: API name, weights folder, storage URI (ModelRef).")
    gpu: str = Field(default="H100-SXM", description="GPU catalog name (runtime/perf): the planner sizes pools "
                     "with its performance model.")
    precision: Precision = Field(default="bf16", description="Weight and KV precision.")
    slo: SloSpec = Field(default_factory=SloSpec, description="Latency SLOs, p90 TTFT and ITL in ms (SloSpec).")
    workload: WorkloadSpec = Field(
        default_factory=WorkloadSpec, description="Traffic the deployment is sized for: ISL/OSL tokens, requests/s."
    )
    prefill: PoolSpec = Field(
        default_factory=PoolSpec, description="Prefill worker pool: TP degree, replicas and planner bounds."
    )
    decode: PoolSpec = Field(
        default_factory=PoolSpec, description="Decode worker pool: TP degree, replicas and planner bounds."
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec, description="vLLM settings prefill and decode workers share (EngineSpec)."
    )
    router: RouterSpec = Field(
        default_factory=RouterSpec, description="KV-aware disaggregated router settings (RouterSpec)."
    )
    planner: PlannerSpec = Field(
        default_factory=PlannerSpec, description="SLO planner settings: mode, predictor, intervals (PlannerSpec)."
    )
    overload: OverloadSpec = Field(
        default_factory=OverloadSpec, description="Circuit breakers and load shedding of the runtime (OverloadSpec)."
    )

    @field_validator("gpu")
    @classmethod
    def _known_gpu(cls, v: str) -> str:
        from runtime.perf.gpus import get_gpu  # lazy, like PlannerSpec's predictor check

        try:
            get_gpu(v)
        except KeyError as e:  # the planner of the runtime would fail on it only once it starts
            raise ValueError(e.args[0]) from None
        return v

    @model_validator(mode="after")
    def _kv_offload_on_gpus(self) -> "DeploymentSpec":
        # vllm/v1/kv_offload/cpu/spec.py get_worker: "CPU Offloading is currently only supported on CUDA-alike
        # and XPU GPUs" (the worker fails at start-up otherwise)
        if self.gpu.upper() == "CPU" and self.engine.kv_offload.cpu_gib > 0:
            raise ValueError("engine.kv_offload.cpu_gib > 0 on gpu 'CPU': vLLM 0.28's offloading connector runs on "
                             "CUDA/XPU GPUs only; set it to 0 for CPU workers")
        return self

    @model_validator(mode="after")
    def _drain_cap_covers_kv_lease(self) -> "DeploymentSpec":
        # a prefill worker's drain holds for its KV lease (every handoff it made is read or expired); a cap
        # below the lease stops it with handoffs still to be read (runtime/deploy/workers.py prestop_command)
        lease = self.engine.kv_lease_s or DEFAULT_KV_LEASE_S
        if self.planner.drain_cap_s < lease:
            raise ValueError(f"planner.drain_cap_s ({self.planner.drain_cap_s:g} s) is below the prefill workers' "
                             f"KV lease ({lease:g} s, engine.kv_lease_s): a draining prefill worker would stop "
                             "with KV handoffs still unread; raise drain_cap_s or lower kv_lease_s")
        return self

    @model_validator(mode="after")
    def _prefill_tp_le_decode_tp(self) -> "DeploymentSpec":
        # vLLM NixlConnector refuses prefill TP > decode TP for non-MLA models
        # (docs/architecture.md#pd-disaggregation-with-nixl).
        if self.prefill.tp > self.decode.tp and not self.model.mla:
            raise ValueError(
                f"prefill.tp ({self.prefill.tp}) > decode.tp ({self.decode.tp}): NixlConnector "
                "requires prefill TP <= decode TP unless the model uses MLA (model.mla)"
            )
        if self.decode.pp > 1:  # vLLM NixlConnector: "consumer (decode) does not support pipeline_parallel_size > 1"
            raise ValueError(f"decode.pp ({self.decode.pp}) > 1: NixlConnector decode workers refuse pipeline stages")
        if self.planner.mode != "off" and self.prefill.min_replicas == 0 and not self.planner.allow_aggregated:
            raise ValueError(
                "prefill.min_replicas 0 lets the planner remove every prefill worker, which is aggregated serving "
                "(decode workers prefill), but planner.allow_aggregated is false: set prefill.min_replicas >= 1 or "
                "planner.allow_aggregated true"
            )
        return self
