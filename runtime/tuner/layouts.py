"""Which worker layouts the tuner searches, and which prefill / decode pairs vLLM's NixlConnector serves.

Search space per pool (``layouts``), ``n`` = GPUs per node, ``tps`` = the TP degrees given:

* ``parallelism="tp"``: plain tensor parallelism ``TPt`` for ``t`` in ``tps``, one node per worker.
* ``parallelism="all"`` adds, for MoE models: ``TPt EPt`` (experts split whole over the TP group) for ``t >= 2``,
  and attention-DP with expert parallelism ``DPt EPt`` for ``t >= 2`` in ``tps``, and across nodes
  ``DP(kn) EP(kn)`` for ``k`` in ``MULTI_NODE_COUNTS`` (wide EP, llm-d / vLLM ``--data-parallel-size`` with
  ``--data-parallel-size-local n``); for every model, prefill workers of ``TPn PPk`` (one pipeline stage per
  node, vLLM's recommended multi-node layout: TP inside a node, PP across nodes). Layouts across nodes need
  the network bandwidth of the node's instance type (``runtime.perf.instances``): none known, none searched.
* ``parallelism="auto"``: ``tp`` when plain tensor parallelism has a feasible candidate, else ``all`` (a model
  no node holds, or an SLO only other layouts meet). ``auto`` prefers a plain-TP winner wherever one exists (a
  plain Deployment per worker, no LeaderWorkerSet); ``all`` compares every layout (MoE models often need fewer
  GPUs with EP). Every layout here is a DeploymentSpec pool (``runtime.config.PoolSpec`` tp, pp, dp, ep, nodes)
  that ``runtime.deploy`` renders. ``tune`` defaults to ``tp``: what a caller that shows only TP degrees can
  show.

Pair rules (``pair_problem``), from vLLM 0.28's NixlConnector
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl``) and pdserve's own deployment rules; a refused pair is
named with its rule:

1. attention TP of each pool divides the attention heads (and the KV heads, or is a multiple of them);
2. non-MLA models: prefill attention TP <= decode attention TP (pdserve's rule for a P/D pair: each decode rank
   reads its heads from one prefill rank); MLA caches one latent on every rank, so any pair works;
3. decode workers are never pipelined: ``NixlConnector`` consumers refuse ``pipeline_parallel_size > 1``
   (``base_worker.py``: "consumer (decode) does not support pipeline_parallel_size > 1"), and ``pp`` is
   never searched for decode;
4. a pipelined prefill needs a uniform KV layout per layer: models with sliding-window or chunked layers use
   the hybrid KV cache (HMA), which the connector refuses with ``pipeline_parallel_size > 1``
   (``base_worker.py``);
5. expert parallelism needs the experts to divide evenly over the EP group (``num_experts % gpus == 0``);
6. data-parallel attention is searched with expert parallelism only (without it a DP group is just replicas);
7. tensor parallelism never crosses nodes (every layer's all-reduce would run over the network); a worker
   spans nodes through pipeline stages or wide EP only;
8. block-quantised checkpoints (FP8 ``weight_block_size`` ``[block_n, block_k]``) keep whole blocks on each
   rank: the expert width per rank (``moe_intermediate_size / TP``, whole with EP) is a multiple of
   ``block_n`` (and of ``block_k`` when TP > 1), and with TP > 1 each row-parallel layer's input share
   (``o_proj``, ``down_proj``) a multiple of ``block_k``; vLLM refuses to load other shards
   (``ModelSpec.block_quant_problem``; Qwen3-235B-A22B-FP8: 1536 / 8 = 192, so no TP 8 without EP).

Pure: no I/O.
"""

from __future__ import annotations

from runtime.models.spec import ModelSpec
from runtime.perf.worker import Layout

PARALLELISMS = ("tp", "all", "auto")
MULTI_NODE_COUNTS = (2, 4)  # nodes per worker searched for wide EP and pipeline stages


def check_parallelism(parallelism: str) -> str:
    """``parallelism`` lower-cased when it is one of ``PARALLELISMS``.

    Raises:
        ValueError: anything else (the message lists them).
    """
    p = parallelism.lower() if isinstance(parallelism, str) else parallelism
    if p not in PARALLELISMS:
        raise ValueError(f"parallelism {parallelism!r}: must be one of {', '.join(PARALLELISMS)} (tp: tensor "
                         "parallelism on one node; all: also expert / data-parallel attention and multi-node "
                         "workers; auto: all where the model benefits)")
    return p


def resolve_parallelism(parallelism: str, tp_feasible: bool) -> str:
    """``tp`` or ``all``: ``auto`` is ``tp`` when plain tensor parallelism has a feasible candidate, else
    ``all`` (see the module docstring); others as given.

    Raises:
        ValueError: an unknown parallelism.
    """
    p = check_parallelism(parallelism)
    if p != "auto":
        return p
    return "tp" if tp_feasible else "all"


def layouts(model: ModelSpec, tps: tuple[int, ...], parallelism: str, gpus_per_node: int, multi_node: bool,
            role: str) -> list[Layout]:
    """The layouts searched for one pool (``role`` ``prefill`` or ``decode``), plain TP first.

    Args:
        model: architecture; tps: TP degrees; parallelism: ``tp`` or ``all`` (resolved);
        gpus_per_node: GPUs of one node; multi_node: whether layouts across nodes are searched (a network
        bandwidth is known); role: which pool.
    """
    out = [Layout(tp=t) for t in tps]
    if parallelism != "all":
        return out
    moe = bool(model.num_experts)
    if moe:
        out += [Layout(tp=t, ep=True) for t in tps if t >= 2]
        out += [Layout(tp=1, dp=t, ep=True) for t in tps if t >= 2]
    if multi_node and gpus_per_node in tps:
        if moe:
            out += [Layout(tp=1, dp=k * gpus_per_node, ep=True) for k in MULTI_NODE_COUNTS]
        if role == "prefill":
            out += [Layout(tp=gpus_per_node, pp=k) for k in MULTI_NODE_COUNTS]
    return out


def layout_problem(model: ModelSpec, layout: Layout, gpus_per_node: int) -> str:
    """Why ``model`` cannot run in ``layout`` (rules 1, 4-8 of the module docstring), "" when it can."""
    if not model.tp_divides_heads(layout.tp):
        return f"TP {layout.tp} does not divide {model.num_attention_heads} attention / {model.num_kv_heads} KV heads"
    if layout.tp > gpus_per_node:
        return f"TP {layout.tp} > {gpus_per_node} GPUs per node (tensor parallelism stays in a node)"
    block = model.block_quant_problem(layout.tp, expert_parallel=layout.ep and bool(model.num_experts))
    if block:
        return f"TP {layout.tp}: {block}"
    if layout.ep and model.num_experts % layout.stage_gpus:
        return f"EP {layout.stage_gpus} does not divide {model.num_experts} experts"
    if layout.dp > 1 and not (layout.ep and model.num_experts):
        return "data-parallel attention without expert parallelism"
    if layout.pp > 1 and model.sliding_window_tokens:
        return (f"PP {layout.pp}: NixlConnector refuses pipeline stages with the hybrid KV cache of "
                "sliding-window / chunked layers")
    return ""


def pair_problem(model: ModelSpec, prefill: Layout, decode: Layout) -> str:
    """Why a prefill worker of ``prefill`` cannot hand its KV cache to a decode worker of ``decode`` (rules 2-3),
    "" when it can."""
    if decode.pp > 1:
        return f"decode {decode.label}: NixlConnector decode workers refuse pipeline_parallel_size > 1"
    if not model.is_mla and prefill.tp > decode.tp:
        why = "prefill TP > decode TP (NixlConnector, non-MLA)"
        return why if prefill.plain and decode.plain else f"{why}: attention TP {prefill.tp} > {decode.tp}"
    return ""
