"""Operator overrides of the vLLM workers' engine settings, checked before they reach a spec (adapter: it
imports the pinned vLLM to read its own argument parser).

`--engine-arg KEY=VALUE` (KEY as vLLM's flag without the dashes, `max-num-seqs` or `max_num_seqs`) becomes a
vLLM flag in `EngineSpec.extra_args`, which both the local workers (runtime/engines/vllm_worker.py) and the
rendered worker Deployments (runtime/deploy/workers.py) pass to vLLM after pdserve's own flags. Each one is
checked against the parser vLLM itself builds (`EngineArgs.add_cli_args`, vllm/engine/arg_utils.py): an unknown
KEY, a value of the wrong type or outside its choices is refused here, with vLLM's own message, instead of a
worker that fails to start on the cluster. Flags pdserve sets from the spec (`RESERVED`) are refused with the
setting that controls them, since a second copy would silently override what the tuner sized.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import operator
from collections.abc import Iterable
from functools import lru_cache

from runtime.config import DeploymentSpec, EngineSpec

# vLLM flags whose value is a credential: an engine argument is recorded in the spec, the MLflow run and the
# rendered manifests, where a secret must never be. The workers load the staged model from the PVC and need
# no Hub token.
CREDENTIAL_ARGS = frozenset({"hf-token", "api-key"})

# vLLM flags pdserve derives from the spec (runtime/deploy/workers.py vllm_args, runtime/engines/vllm_worker.py),
# each with what sets it; tests/unit/test_engine_overrides.py checks that every flag vllm_args renders is here.
RESERVED: dict[str, str] = {
    "model": "the staged model path",
    "served-model-name": "the model name",
    "host": "the worker address",
    "port": "the worker port (ClusterTarget.worker_port)",
    "tensor-parallel-size": "the tuner's TP (spec prefill.tp / decode.tp)",
    "dtype": "engine.dtype",
    "block-size": "engine.block_size_tokens (prefill and decode must agree)",
    "max-model-len": "--max-model-len (engine.max_model_len_tokens)",
    "gpu-memory-utilization": "engine.gpu_memory_utilization (the tuner sized the KV capacity with it)",
    "enable-prefix-caching": "pdserve (KV-aware routing needs prefix caching)",
    "kv-transfer-config": "engine.kv_backends and engine.kv_lease_s (NIXL P/D transfer)",
    "kv-events-config": "pdserve (the KV-aware router subscribes to the workers' KV events)",
    "scheduling-policy": "router.prefill_priority",
    "quantization": "the checkpoint's quantization_config and --precision (the tuner sized the weights with them)",
    # a pool's layout (runtime/deploy/workers.py layout_args, multinode_args)
    "pipeline-parallel-size": "the pool's layout (spec prefill.pp / decode.pp)",
    "data-parallel-size": "the pool's layout (spec prefill.dp / decode.dp)",
    "enable-expert-parallel": "the pool's layout (spec prefill.ep / decode.ep)",
    "data-parallel-size-local": "the pool's layout (dp / nodes per node)",
    "data-parallel-address": "the LeaderWorkerSet leader's address",
    "data-parallel-rpc-port": "pdserve (the multi-node DP coordinator's port)",
    "nnodes": "the pool's layout (spec prefill.nodes / decode.nodes)",
    "node-rank": "the pod's index in its LeaderWorkerSet group",
    "master-addr": "the LeaderWorkerSet leader's address",
    "master-port": "pdserve (the multi-node rendezvous port)",
    "distributed-executor-backend": "pdserve (multiprocessing across nodes)",
    "headless": "pdserve (every pod of a multi-node worker but the leader)",
}
# `--kv-cache-dtype` values by the bytes per KV element they store (vLLM CacheDType): an engine argument may
# choose among the encodings of the width the tuner sized the KV cache for (`DeploymentSpec.precision`: fp8 one
# byte, bf16 two), never another width, which would make the KV capacity the spec records and the planner
# plans with wrong
KV_CACHE_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
                        "fp8_inc": 1, "fp8_ds_mla": 1, "fp8_per_token_head": 1, "int8_per_token_head": 1}
PRECISION_KV_BYTES = {"bf16": 2, "fp8": 1}
TRUE_WORDS, FALSE_WORDS = frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off"})


@lru_cache(maxsize=1)
def vllm_engine_parser() -> argparse.ArgumentParser:
    """vLLM's engine-argument parser (`EngineArgs.add_cli_args(FlexibleArgumentParser())`) of the installed,
    pinned vLLM; built once (importing vLLM takes seconds)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm", add_help=False))


def parse_engine_arg(item: str) -> tuple[str, str]:
    """`"max_num_seqs=64"` / `"--max-num-seqs=64"` -> `("max-num-seqs", "64")` (vLLM's flag spelling).

    Raises:
        ValueError: no '=' or an empty KEY.
    """
    key, sep, value = str(item).partition("=")
    key = key.strip().lstrip("-").replace("_", "-")
    if not sep or not key:
        raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE with KEY a vLLM engine argument, "
                         "e.g. max-num-seqs=128")
    return key, value.strip()


def engine_arg_flags(items: Iterable[str], parser: argparse.ArgumentParser | None = None) -> list[str]:
    """vLLM flags for `--engine-arg KEY=VALUE` items, in order: `--KEY=VALUE`, or for a boolean argument
    (VALUE true/false, 1/0, yes/no, on/off) `--KEY` / `--no-KEY`. A later item for the same KEY wins.

    `parser`: vLLM's engine-argument parser (default: `vllm_engine_parser()`).

    Raises:
        ValueError: a malformed item; a KEY in `CREDENTIAL_ARGS`; a VALUE holding '$'; a KEY in `RESERVED` (the message names the setting to use); a KEY that is
            not an engine argument of the pinned vLLM (the message suggests close ones); a boolean with another
            VALUE; a VALUE vLLM's parser refuses (type, choices, JSON), with vLLM's message; a number outside
            the bounds vLLM's config class declares for that field (`max-num-seqs=0`: `SchedulerConfig.max_num_seqs`
            is `Field(ge=1)`), which vLLM's parser does not check and the engine refuses only when it starts.
    """
    parser = parser or vllm_engine_parser()
    options = {s: a for a in parser._actions for s in a.option_strings}  # noqa: SLF001 - argparse has no public list
    chosen: dict[str, list[str]] = {}
    for item in items:
        key, value = parse_engine_arg(item)
        if key in CREDENTIAL_ARGS:  # named by its key only: the value is the secret
            raise ValueError(f"--engine-arg {key}=...: a credential, which would be written into the deployment "
                             "spec, the MLflow run and the manifests; the workers load the staged model and need none")
        if "$" in value:  # runtime.deploy.render refuses it too: the kubelet expands $(VAR) in container args
            raise ValueError(f"--engine-arg {item!r}: VALUE must not contain '$' (Kubernetes expands $(VAR) in "
                             "the workers' container args)")
        base = key[3:] if key.startswith("no-") and key[3:] in RESERVED else key
        if base in RESERVED:
            raise ValueError(f"--engine-arg {item!r}: pdserve sets --{base} itself from {RESERVED[base]}")
        action = options.get(f"--{key}")
        if action is None:
            near = difflib.get_close_matches(f"--{key}", list(options), n=3)
            raise ValueError(f"--engine-arg {item!r}: --{key} is not an engine argument of the installed vLLM"
                             + (f" (did you mean {', '.join(near)}?)" if near else ""))
        if action.nargs == 0:  # store_true/store_false/BooleanOptionalAction: a switch
            word = value.lower()
            negatable = isinstance(action, argparse.BooleanOptionalAction)
            if word in TRUE_WORDS:
                flags = [f"--{key}"]
            elif word in FALSE_WORDS and negatable:
                flags = [f"--no-{key}"]
            else:
                allowed = "true or false" if negatable else "true"
                raise ValueError(f"--engine-arg {item!r}: --{key} is a switch: VALUE must be {allowed}")
        else:
            flags = [f"--{key}={value}"]
        chosen.pop(action.dest, None)
        chosen[action.dest] = flags
    out = [f for flags in chosen.values() for f in flags]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = parser.parse_args(out)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln] or err.getvalue().splitlines()[-1:]
        msg = lines[-1].split("error:", 1)[-1].strip() if lines else "refused"
        raise ValueError(f"--engine-arg: vLLM refuses {' '.join(out)}: {msg}") from None
    for dest, flags in chosen.items():
        problem = _bound_problem(parser, dest, getattr(parsed, dest, None))
        if problem:
            raise ValueError(f"--engine-arg: vLLM refuses {' '.join(flags)}: {problem}")
    return out


# annotated_types' numeric bounds (what pydantic's Field(ge=..., gt=..., le=..., lt=...) records), as comparisons
_BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt), ("le", "<=", operator.le), ("lt", "<", operator.lt))


def _bound_problem(parser: argparse.ArgumentParser, dest: str, value: object) -> str | None:
    """Why `value` breaks a numeric bound vLLM's config class declares for argument `dest`, or None.

    vLLM builds each argument group of its parser from one config class (the group's title, e.g.
    `SchedulerConfig`; vllm/engine/arg_utils.py `get_kwargs`) whose pydantic fields carry the bounds the engine
    enforces when it builds its config at start-up. Only numbers are checked (other values go through the
    parser's own type and choices)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    import vllm.config  # imported by vllm_engine_parser already

    for group in parser._action_groups:  # noqa: SLF001 - argparse has no public list
        if any(a.dest == dest for a in group._group_actions):  # noqa: SLF001
            fields = getattr(getattr(vllm.config, str(group.title), None), "__pydantic_fields__", None) or {}
            field = fields.get(dest)
            for meta in getattr(field, "metadata", ()) or ():
                for attr, op, ok in _BOUNDS:
                    bound = getattr(meta, attr, None)
                    if isinstance(bound, int | float) and not ok(value, bound):
                        return f"{dest} must be {op} {bound} ({group.title}.{dest}), got {value}"
            return None
    return None


def _check_kv_cache_dtype(flags: list[str], precision: str) -> None:
    """Raises ValueError: a `--kv-cache-dtype` among `flags` whose width is not the one `precision` sizes."""
    want = PRECISION_KV_BYTES.get(precision)
    for f in flags:
        if f.startswith("--kv-cache-dtype="):
            value = f.split("=", 1)[1]
            width = KV_CACHE_DTYPE_BYTES.get(value)
            if width is None:  # 4-bit and mixed encodings: the performance model sizes none of them
                raise ValueError(f"--engine-arg kv-cache-dtype={value}: the tuner sizes KV caches of 1 or 2 bytes "
                                 f"per element only ({', '.join(KV_CACHE_DTYPE_BYTES)})")
            if want is not None and width != want:
                raise ValueError(f"--engine-arg kv-cache-dtype={value}: the configuration was tuned for precision "
                                 f"{precision} ({want}-byte KV elements, which size its KV capacity and batch); "
                                 f"{value} stores {width}-byte ones: choose it with --precision and tune again")


def with_engine_overrides(spec: DeploymentSpec, *, max_model_len_tokens: int | None = None,
                          engine_args: Iterable[str] = (),
                          parser: argparse.ArgumentParser | None = None,
                          context_tokens: int | None = None) -> DeploymentSpec:
    """`spec` with an operator's `--max-model-len` and `--engine-arg` items (for a spec that exists already,
    e.g. the champion `promote` deploys; `tune` uses `TuneResult.to_deployment_spec(max_model_len_tokens=...)`,
    which also checks the model's context and KV capacity). Engine flags replace `engine.extra_args` entries of
    the same argument and are appended after the others; the spec records them.

    `context_tokens`: the model's context window (`ModelSpec.max_context_tokens`), when the caller could read
    the model's config; `max_model_len_tokens` above it is refused, as vLLM refuses to start with it.

    Raises:
        ValueError: an item `engine_arg_flags` refuses, or `max_model_len_tokens` not a positive int, below
            the spec's workload ISL + OSL (the requests it was tuned for would be refused), above
            `context_tokens` or above the KV capacity of one engine the spec records
            (`engine.kv_capacity_tokens`); a `kv-cache-dtype` whose bytes per element are not those the
            spec's precision sized (`KV_CACHE_DTYPE_BYTES`).
    """
    update: dict = {}
    if max_model_len_tokens is not None:
        spec.workload.check_max_model_len(max_model_len_tokens)
        if context_tokens and max_model_len_tokens > context_tokens:  # TuneResult.max_model_len_tokens' bound
            raise ValueError(f"max_model_len {max_model_len_tokens} > the model's context window ({context_tokens} "
                             "tokens): vLLM refuses to start")
        cap = spec.engine.kv_capacity_tokens
        if cap and max_model_len_tokens > cap:
            raise ValueError(f"max_model_len {max_model_len_tokens} > the KV capacity of one engine ({cap} tokens, "
                             "as tune sized it): vLLM refuses to start; re-tune with a larger TP or use a "
                             "shorter limit")
        update["max_model_len_tokens"] = max_model_len_tokens
    items = list(engine_args)
    if items:
        parser = parser or vllm_engine_parser()
        flags = engine_arg_flags(items, parser)
        _check_kv_cache_dtype(flags, spec.precision)
        options = {s: a for a in parser._actions for s in a.option_strings}  # noqa: SLF001
        new = {options[f.split("=", 1)[0]].dest for f in flags}
        kept, old, i = [], list(spec.engine.extra_args), 0
        while i < len(old):  # drop an overridden flag, and its value when it is given as a separate word
            a, i = old[i], i + 1
            action = options.get(a.split("=", 1)[0]) if a.startswith("--") else None
            takes_value = action is not None and action.nargs != 0 and "=" not in a
            if action is not None and action.dest in new:
                i += 1 if takes_value and i < len(old) else 0
                continue
            kept.append(a)
        update["extra_args"] = kept + flags
    if not update:
        return spec
    engine = EngineSpec.model_validate(spec.engine.model_dump() | update)
    return spec.model_copy(update={"engine": engine})
