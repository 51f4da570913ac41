"""One serving worker of a given parallel layout: TP, TP + EP, attention-DP + EP (one node or across nodes),
and TP x PP across nodes, on top of :class:`runtime.perf.model.PerfModel`.

``Layout`` names the vLLM flags (vLLM 0.28 ``vllm/config/parallel.py``): ``tp`` = ``--tensor-parallel-size``
(attention and dense layers), ``pp`` = ``--pipeline-parallel-size`` (one stage per node), ``dp`` =
``--data-parallel-size`` (attention data parallelism: each DP rank runs its own sequences with the whole
attention), ``ep`` = ``--enable-expert-parallel`` (the experts are split whole over all ``tp x dp`` GPUs of
a stage instead of each expert over ``tp``).

Formulas (``WorkerPerf``), beyond PerfModel's:

* attention-DP prefill: a DP worker prefills ``dp`` prompts at once, one per rank: a prompt's latency is
  ``prefill_time_s(isl, dp, batch=dp)`` (an upper bound for a lone prompt, whose expert work is smaller) and
  the worker is occupied ``1/dp`` of the batch's busy time per prompt (the worker is queued as one server
  ``dp`` times as fast, M/G/1 rather than M/G/dp: optimistic on the wait at low load).
* pipeline parallelism (``pp`` stages of ``L/pp`` layers each, one node each; GPipe, Huang et al. 2019): each
  GPU holds ``1/pp`` of the worker's weights and of each token's KV; a prompt goes through the stages one
  after the other, so its latency is the whole model's time on ``tp`` GPUs plus ``pp - 1`` hand-offs of its
  hidden states (``isl x hidden x 2`` bytes at the per-GPU network bandwidth, all ``tp`` GPUs of a stage
  sending their share); the worker holds up to ``pp`` prompts in flight (vLLM keeps one batch per stage in
  flight, ``vllm/v1/engine/core.py`` batch queue), so while prompts queue it is occupied ``1/pp`` of that
  time per prompt. The pipeline bubble, stages idle while a lone prompt is in another stage, is the
  difference between the two: the queue model gets ``pp`` times the capacity only when prompts queue.
  Stages are assumed balanced (the LM head's stage is a little heavier).

Pure: no I/O. Times in seconds, sizes in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.perf.model import KV_MEMORY_RULES, MIN_KV_TOKENS, MemoryBreakdown, PerfModel


@dataclass(frozen=True)
class Layout:
    """Parallel layout of one worker; see the module docstring. ``gpus = tp x dp x pp``."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: bool = False

    def __post_init__(self) -> None:
        for k in ("tp", "pp", "dp"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Layout.{k} must be an integer >= 1, got {v!r}")
        if self.dp > 1 and self.pp > 1:
            raise ValueError("Layout: data-parallel attention with pipeline stages is not a layout pdserve models")

    @property
    def gpus(self) -> int:
        """GPUs of one worker."""
        return self.tp * self.dp * self.pp

    @property
    def stage_gpus(self) -> int:
        """GPUs of one pipeline stage (the PerfModel ``tp`` of the worker)."""
        return self.tp * self.dp

    @property
    def plain(self) -> bool:
        """True for plain tensor parallelism (what a DeploymentSpec pool with ``tp`` states)."""
        return self.pp == 1 and self.dp == 1 and not self.ep

    @property
    def label(self) -> str:
        """``TP8``, ``TP8 EP8``, ``DP16 EP16``, ``TP8 PP2``, ``TP2 DP4 EP8``."""
        parts = [f"TP{self.tp}"] if self.tp > 1 or self.dp == 1 else []
        if self.dp > 1:
            parts.append(f"DP{self.dp}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.ep:
            parts.append(f"EP{self.stage_gpus}")
        return " ".join(parts)

    def nodes(self, gpus_per_node: int) -> int:
        """Nodes the worker spans (ceil of its GPUs over ``gpus_per_node``)."""
        return -(-self.gpus // gpus_per_node)


class WorkerPerf:
    """Times and memory of one worker of ``layout`` (see the module docstring).

    Args:
        perf: the PerfModel of the layout's mapping (``expert_parallel = layout.ep``, ``attention_dp =
            layout.dp > 1``; for workers spanning nodes its ``inter_node_bw_bytes_per_s`` set).
        layout: the worker's layout.
        stage_link_bw_bytes_per_s: network bandwidth per GPU between pipeline stages (EFA), bytes/s; needed
            when ``layout.pp > 1``.

    Raises:
        ValueError: the PerfModel's mapping does not match the layout, or ``pp > 1`` without a bandwidth.
    """

    # one hand-off of a pipeline stage's output over the network: NCCL send/recv over EFA, latency per hop
    # (NCCL tuning.cc ``hwLat`` NET Simple: 14 us) rounded up to 20 us for the engine's own synchronisation
    STAGE_HANDOFF_LATENCY_S = 20e-6

    def __init__(self, perf: PerfModel, layout: Layout, stage_link_bw_bytes_per_s: float = 0.0) -> None:
        # perf may be any object with PerfModel's methods (runtime.tuner.profiles.ProfilePerf: plain TP only)
        ep, adp = getattr(perf, "expert_parallel", False), getattr(perf, "attention_dp", False)
        if ep != (layout.ep and bool(perf.model.num_experts)) or adp != (layout.dp > 1):
            raise ValueError(f"PerfModel(expert_parallel={ep}, attention_dp={adp}) does not match layout "
                             f"{layout.label}")
        if layout.pp > 1 and stage_link_bw_bytes_per_s <= 0:
            raise ValueError(f"layout {layout.label}: pipeline stages need the network bandwidth between nodes")
        self.perf, self.layout, self.link_bw = perf, layout, float(stage_link_bw_bytes_per_s)
        self.model, self.gpu = perf.model, perf.gpu
        self.tp = layout.stage_gpus
        self.gpus_per_node = int(getattr(perf, "gpus_per_node", 0) or perf.gpu.num_gpus_per_node)

    @property
    def gpus(self) -> int:
        return self.layout.gpus

    # ------------------------------------------------------------------ memory
    def memory_breakdown(self, gpu_memory_utilization: float = 0.9) -> MemoryBreakdown:
        """Per-GPU memory plan: PerfModel's for one stage, with ``1/pp`` of the weights."""
        mb = self.perf.memory_breakdown(self.tp, gpu_memory_utilization)
        pp = self.layout.pp
        if pp == 1:
            return mb
        weights = mb.weights_bytes / pp
        free = mb.budget_bytes - weights - mb.activations_bytes - mb.reserve_bytes
        if KV_MEMORY_RULES.get(getattr(self.perf, "backend", "vllm"), "of_total") == "of_free" and free > 0:
            free *= mb.kv_free_fraction
        return replace(mb, weights_bytes=weights, kv_bytes=free)

    def kv_bytes_per_token_rank(self) -> float:
        """KV bytes one cached token costs one GPU (``1/pp`` of a stage's)."""
        return self.perf.kv_bytes_per_token_rank(self.tp) / self.layout.pp

    def kv_capacity_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV-cache capacity of the worker, tokens, all its DP ranks together (the tokens its sequences may hold
        at once); 0 when the weights do not fit. One sequence lies on one rank: see
        :meth:`kv_capacity_tokens_per_rank`."""
        if self.layout.pp == 1:
            return self.perf.kv_capacity_tokens(self.tp, gpu_memory_utilization)
        kv = self.memory_breakdown(gpu_memory_utilization).kv_bytes
        return int(kv // self.kv_bytes_per_token_rank()) if kv > 0 else 0

    def kv_capacity_tokens_per_rank(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV-cache capacity of one DP rank, tokens: the longest sequence the worker can hold (each rank of a
        data-parallel worker is its own vLLM engine, holding whole sequences, so vLLM checks
        ``--max-model-len`` against one rank's cache); the worker's capacity for ``dp`` 1."""
        return self.kv_capacity_tokens(gpu_memory_utilization) // self.layout.dp

    def fits(self, gpu_memory_utilization: float = 0.9) -> bool:
        """The weights fit and leave at least one KV block; a stage's GPUs fit in one node unless the stage is
        an attention-DP worker with a known network between its nodes (``PerfModel.fits``)."""
        if self.layout.pp == 1:
            return self.perf.fits(self.tp, gpu_memory_utilization)
        return self.tp <= self.gpus_per_node and self.kv_capacity_tokens(gpu_memory_utilization) >= MIN_KV_TOKENS

    # ------------------------------------------------------------------ time
    def _handoffs_s(self, tokens: int) -> float:
        pp = self.layout.pp
        if pp == 1:
            return 0.0
        per_gpu = tokens * self.model.hidden_size * 2.0 / self.tp  # bf16 hidden states, split over the stage
        return (pp - 1) * (per_gpu / self.link_bw + self.STAGE_HANDOFF_LATENCY_S)

    def prefill_time_s(self, isl_tokens: int) -> float:
        """Time to first token of one prompt of ``isl_tokens`` on this worker (no queueing), seconds."""
        dp = self.layout.dp
        return self.perf.prefill_time_s(isl_tokens, self.tp, batch=dp) + self._handoffs_s(isl_tokens)

    def prefill_busy_s(self, isl_tokens: int) -> float:
        """Seconds of the worker's capacity one prompt uses while prompts queue (the M/G/1 service time)."""
        dp, pp = self.layout.dp, self.layout.pp
        busy = self.perf.prefill_busy_s(isl_tokens, self.tp, batch=dp) / dp
        return busy / pp + self._handoffs_s(isl_tokens) / pp

    def decode_step_time_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of ``batch`` sequences (spread evenly over the DP ranks), seconds.

        Raises:
            ValueError: a pipelined worker (decode pools are never pipelined: the NixlConnector rule in
                ``runtime.tuner.layouts``).
        """
        if self.layout.pp > 1:
            raise ValueError(f"layout {self.layout.label}: decode with pipeline stages is not modelled")
        return self.perf.decode_step_time_s(batch, context_tokens, self.tp)
