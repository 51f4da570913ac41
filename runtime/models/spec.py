"""Model architecture from a Hugging Face ``config.json``: parameters, active parameters, KV bytes/token.

Pure: takes the already-parsed ``config.json`` dict (see ``runtime.modelfiles.load`` for the file adapter).

Supported families (field names as the model owners publish them; runtime/modelfiles/catalog holds one config of each):

* dense / GQA decoders: Llama 3.x, Mistral, Qwen3 (``head_dim`` may differ from hidden/heads)
* MoE: Mixtral (``num_local_experts``), Qwen3-MoE (``num_experts``, ``moe_intermediate_size``),
  gpt-oss (``num_local_experts``, ``experts_per_token``, biases), Llama 4 (``text_config``,
  ``interleave_moe_layer_step``, one shared expert), DeepSeek-V3/R1 (``n_routed_experts``,
  ``n_shared_experts``, ``first_k_dense_replace``)
* MLA (multi-head latent attention, DeepSeek-V2/V3/R1): the KV cache holds one compressed latent of
  ``kv_lora_rank + qk_rope_head_dim`` values per layer and token (DeepSeek-V2 paper, arXiv:2405.04434
  section 2.1), replicated on every tensor-parallel rank (vLLM MLA backends).

Parameter counting follows the module shapes of the Hugging Face ``transformers`` implementations
(``modeling_llama.py``, ``modeling_mixtral.py``, ``modeling_qwen3_moe.py``, ``modeling_deepseek.py``,
``modeling_gpt_oss.py``, ``modeling_llama4.py``); norms are counted, rotary buffers are not. DeepSeek's
multi-token-prediction layer (``num_nextn_predict_layers``) is not served by default and not counted.
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any

from runtime.models.quant import CheckpointPrecision, detect_precision, module_unquantized

# Config keys of architectures whose layers this module cannot count (state-space / hybrid / linear
# attention). Seeing one is an error naming it rather than a silently wrong parameter count.
UNSUPPORTED_ARCHITECTURE_KEYS = (
    "attn_type_list",  # MiniMax-M1/-Text-01: lightning (linear) attention layers
    "ssm_cfg",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "attn_layer_period",
    "attn_layer_offset",
    "layers_block_type",
    "hybrid_override_pattern",
    "linear_attn_config",
    "linear_num_key_heads",
    "rwkv_version",
    "full_attn_interval",
)

KNOWN_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
        "llama4",
        "llama4_text",
        "gpt_oss",
    }
)


#: MoE model types whose routed experts have their own width, ``moe_intermediate_size`` (transformers'
#: Qwen2MoeConfig, Qwen3MoeConfig, DeepseekV2Config, DeepseekV3Config); Mixtral, gpt-oss and Llama 4 size
#: their experts at ``intermediate_size``
_OWN_EXPERT_WIDTH_TYPES = frozenset({"qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"})


# ``layer_types`` entries (transformers ``configuration_utils.ALLOWED_ATTN_LAYER_TYPES`` spelling) whose layers
# this module models: full attention, sliding-window attention (gpt-oss, Qwen2/3 with use_sliding_window) and
# Llama 4's chunked attention (sized by ``attention_chunk_size``). Any other entry (linear_attention, hybrid,
# ...) is an error naming it rather than a silently wrong KV / FLOP count.
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


#: one routed expert's weights under ``experts.{e}`` (Qwen-MoE, DeepSeek; Mixtral names them w1 / w3 / w2), and
#: the tensors gpt-oss and Llama 4 store under ``experts`` with every expert in each
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_PROJECTIONS = ("w1", "w3", "w2")
FUSED_EXPERT_TENSORS = ("gate_up_proj", "down_proj")


class ModelConfigError(ValueError):
    """A ``config.json`` lacks a needed field, has an invalid value, or describes an unsupported layer type.

    The message names every offending field.
    """


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a decoder-only transformer, enough for memory and FLOP arithmetic.

    Build with :meth:`from_hf_config`. All counts are whole numbers of parameters / heads / tokens.
    ``num_experts == 0`` means dense. ``is_mla`` selects the DeepSeek latent KV cache.
    """

    name: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # FFN width of dense layers
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False  # q/k RMSNorm weights, head_dim each per layer (Qwen3; Llama 4's L2 norm has none)
    # MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int = 0
    moe_bias: bool = False
    moe_layer_ids: tuple[int, ...] = ()  # indices of the MoE layers (the others have a dense FFN)
    # MLA
    is_mla: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Sliding-window layers (gpt-oss alternates sliding/full; Llama 4's chunked-attention layers are counted
    # here too, with the chunk as window): the window in tokens, 0 if none.
    sliding_window_tokens: int = 0
    num_sliding_layers: int = 0
    quant_method: str = ""  # from config.json quantization_config (fp8, mxfp4, modelopt, ...), "" if none
    quant_algo: str = ""  # quantization_config.quant_algo (ModelOpt: FP8, NVFP4, ...), "" if none
    # what the checkpoint stores (runtime.models.quant.detect_precision): weights bf16 / fp8 / fp8-block /
    # mxfp4 / nvfp4 / unknown, KV "fp8" when it carries FP8 KV scales, and a note when it cannot be told
    weight_format: str = "bf16"
    kv_cache_format: str = ""
    precision_note: str = ""
    # block-wise FP8 checkpoints: (block_n, block_k) of the weight blocks, () otherwise; the modules the
    # quantization config keeps in 16 bits, as it lists them (names, ``re:`` regexes, ``*`` wildcards)
    weight_block_size: tuple[int, ...] = ()
    unquantized_modules: tuple[str, ...] = ()
    max_position_embeddings: int = 0  # longest context the model was trained for, tokens; 0 if not given
    # longest context vLLM serves from this config (RoPE scaling applied, see `derived_max_model_len`); 0 if
    # the config gives no max_position_embeddings
    max_context_tokens: int = 0
    # LongRoPE models (Phi-3 and its kin): the original context, tokens, up to which vLLM keeps the short
    # factors; a --max-model-len above it makes vLLM apply the long factors to every sequence (see
    # `longrope_original_tokens`); 0 for other models
    longrope_original_tokens: int = 0
    # what precedes ``model.layers.{i}`` in the text model's module names: "language_model." for multimodal
    # wrappers with a ``text_config`` (Llama 4), "" for text-only checkpoints
    module_prefix: str = ""
    _counts: dict = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str) -> "ModelSpec":
        """Parse a Hugging Face ``config.json`` dict.

        Args:
            cfg: the parsed JSON object. Multimodal configs with a ``text_config`` (Llama 4) use it.
            name: model name for messages and MLflow (e.g. ``meta-llama/Llama-3.1-8B``).

        Raises:
            ModelConfigError: naming every missing required field (``model_type`` included: transformers and
                vLLM refuse a config without one), non-positive value, wrongly typed field
                (e.g. ``tie_word_embeddings`` not a JSON boolean, ``layer_types`` not a list of strings), unknown
                layer type, unsupported architecture key (see ``UNSUPPORTED_ARCHITECTURE_KEYS``), RoPE scaling
                vLLM cannot build (see ``derived_max_model_len``), or a quantization config whose 16-bit routed
                experts vLLM cannot load (see ``expert_quant_problem``). Any other
                failure on a malformed config (a wrong-typed field this parser does not check by name) is
                also a ModelConfigError naming the model, with the original exception as ``__cause__``.
        """
        try:
            return cls._from_hf_config(cfg, name)
        except ModelConfigError:
            raise
        except (TypeError, AttributeError, KeyError, IndexError, ValueError, OverflowError) as e:
            raise ModelConfigError(
                f"{name}: malformed config.json (a field has the wrong type or shape): {type(e).__name__}: {e}"
            ) from e

    @classmethod
    def _from_hf_config(cls, cfg: Any, name: str) -> "ModelSpec":
        if not isinstance(cfg, dict):
            raise ModelConfigError(f"{name}: config.json must be a JSON object, got {type(cfg).__name__}")
        text = cfg.get("text_config")
        c: dict[str, Any] = {**cfg, **text} if isinstance(text, dict) else dict(cfg)

        unsupported = [k for k in UNSUPPORTED_ARCHITECTURE_KEYS if k in c]
        if unsupported:
            raise ModelConfigError(
                f"{name}: unsupported architecture field(s) {', '.join(unsupported)} "
                f"(model_type={c.get('model_type')!r}); only attention+MLP/MoE decoders are modelled"
            )

        top_type = cfg.get("model_type")
        if top_type is None:
            # transformers' AutoConfig refuses such a config ("Should have a `model_type` key"), so vLLM cannot
            # serve it, and every architecture default below (tied embeddings, qk norms, expert layout) hangs on it
            raise ModelConfigError(
                f"{name}: config.json is missing required field model_type (transformers and vLLM refuse a config "
                f"without it); supported: {', '.join(sorted(KNOWN_MODEL_TYPES))}"
            )
        if not isinstance(top_type, str) or not isinstance(c.get("model_type"), str):
            raise ModelConfigError(f"{name}: field model_type must be a string, got {_short(c.get('model_type'))}")
        model_type = c["model_type"]
        if model_type not in KNOWN_MODEL_TYPES:
            raise ModelConfigError(
                f"{name}: model_type {model_type!r} is not an architecture pdserve models (its layer types, "
                f"defaults such as tied embeddings, and KV layout are unknown); supported: "
                f"{', '.join(sorted(KNOWN_MODEL_TYPES))}"
            )
        _check_numbers(c, name)
        is_mla = "kv_lora_rank" in c and c.get("kv_lora_rank") is not None
        num_experts = int(_first(c, "num_local_experts", "num_experts", "n_routed_experts") or 0)

        required = ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"]
        if num_experts == 0 or _needs_dense_ffn(c, num_experts):
            required.append("intermediate_size")
        if num_experts:
            if _first(c, "num_experts_per_tok", "experts_per_token") is None:
                required.append("num_experts_per_tok")
        if is_mla:
            required += ["qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"]
        missing = [k for k in required if c.get(k) is None]
        if missing:
            raise ModelConfigError(
                f"{name}: config.json is missing required field(s): {', '.join(missing)}"
                + (f" (model_type={model_type!r})" if model_type else "")
            )

        hidden = _pos_int(c, "hidden_size", name)
        layers = _pos_int(c, "num_hidden_layers", name)
        heads = _pos_int(c, "num_attention_heads", name)
        kv_heads = int(c.get("num_key_value_heads") or heads)  # HF default: MHA when absent
        if kv_heads <= 0 or heads % kv_heads:
            raise ModelConfigError(
                f"{name}: num_key_value_heads={kv_heads} must be positive and divide num_attention_heads={heads}"
            )
        head_dim = int(c.get("head_dim") or 0) or hidden // heads
        if head_dim <= 0:
            raise ModelConfigError(f"{name}: hidden_size={hidden} < num_attention_heads={heads} and no head_dim: "
                                   "the attention head width would be 0")
        vocab = _pos_int(c, "vocab_size", name)
        inter = int(c.get("intermediate_size") or 0)

        kw: dict[str, Any] = {}
        if num_experts:
            top_k = int(_first(c, "num_experts_per_tok", "experts_per_token"))
            if not 0 < top_k <= num_experts:
                raise ModelConfigError(f"{name}: num_experts_per_tok={top_k} not in 1..{num_experts}")
            if c.get("moe_intermediate_size") is None and (
                    model_type in _OWN_EXPERT_WIDTH_TYPES or "n_routed_experts" in c):
                # these configs' experts are narrower than the dense FFN (Qwen3-235B: 1,536 against 12,288);
                # transformers fills a per-class default the checkpoint may not have been trained with, and
                # intermediate_size would size every expert several times too large
                raise ModelConfigError(
                    f"{name}: model_type {model_type!r} needs moe_intermediate_size (the width of one routed "
                    f"expert); it is absent, and intermediate_size={inter} is the dense layers' width"
                )
            moe_inter = int(c.get("moe_intermediate_size") or inter)
            dense_inter = inter
            shared, shared_inter = 0, 0
            if model_type.startswith("llama4"):
                step = int(c.get("interleave_moe_layer_step") or 1)
                num_moe = layers // step
                moe_ids = [i for i in range(layers) if (i + 1) % step == 0]
                dense_inter = int(c.get("intermediate_size_mlp") or inter)
                shared, shared_inter = 1, inter  # Llama4TextMoe: one shared expert of intermediate_size
            elif "n_routed_experts" in c:  # DeepSeek
                first_dense = int(c.get("first_k_dense_replace") or 0)
                freq = int(c.get("moe_layer_freq") or 1)
                moe_ids = [i for i in range(first_dense, layers) if i % freq == 0]
                num_moe = len(moe_ids)
                shared = int(c.get("n_shared_experts") or 0)
                shared_inter = moe_inter
            else:
                sparse_step = int(c.get("decoder_sparse_step") or 1)
                dense_only = set(_int_list(c, "mlp_only_layers", name))
                moe_ids = [i for i in range(layers) if i not in dense_only and (i + 1) % sparse_step == 0]
                num_moe = len(moe_ids)
                shared_inter = int(c.get("shared_expert_intermediate_size") or 0)
                shared = 1 if shared_inter else 0
            kw.update(
                num_experts=num_experts,
                num_experts_per_tok=top_k,
                moe_intermediate_size=moe_inter,
                num_shared_experts=shared,
                shared_expert_intermediate_size=shared_inter,
                num_moe_layers=num_moe,
                moe_layer_ids=tuple(moe_ids),
                moe_bias=model_type == "gpt_oss",
            )
            inter = dense_inter
        if is_mla:
            kw.update(
                is_mla=True,
                q_lora_rank=int(c.get("q_lora_rank") or 0),
                kv_lora_rank=int(c["kv_lora_rank"]),
                qk_nope_head_dim=int(c["qk_nope_head_dim"]),
                qk_rope_head_dim=int(c["qk_rope_head_dim"]),
                v_head_dim=int(c["v_head_dim"]),
            )
            head_dim = int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"])
        layer_types = _layer_types(c, layers, model_type, name)
        window = int(c.get("sliding_window") or 0)
        if window and layer_types:
            kw.update(
                sliding_window_tokens=window,
                num_sliding_layers=sum(1 for t in layer_types if t == "sliding_attention"),
            )
        chunk = int(c.get("attention_chunk_size") or 0)
        if chunk and model_type.startswith("llama4"):
            # Llama 4: RoPE layers attend within 8192-token chunks, every 4th layer (NoPE) globally
            # (transformers Llama4TextConfig: no_rope_layers[i] = 1 -> chunked, default interval 4).
            rope_layers = _int_list(c, "no_rope_layers", name)
            if not rope_layers:
                step = int(c.get("no_rope_layer_interval") or 4)
                rope_layers = [int((i + 1) % step != 0) for i in range(layers)]
            kw.update(sliding_window_tokens=chunk, num_sliding_layers=sum(1 for x in rope_layers if x))
        quant = cfg.get("quantization_config") or c.get("quantization_config") or {}
        if isinstance(text, dict):
            # a multimodal wrapper (Llama4ForConditionalGeneration): vLLM builds the text model under
            # ``language_model`` and its checkpoint names the weights so, which ignore lists follow
            kw["module_prefix"] = "language_model."
        spec = cls(
            name=name,
            model_type=model_type,
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            tie_word_embeddings=_bool(c, "tie_word_embeddings", False, name),
            attention_bias=_bool(c, "attention_bias", False, name),
            # Qwen3: q_norm / k_norm are RMSNorms with a head_dim weight each. Llama 4's use_qk_norm is
            # Llama4TextL2Norm, which has no weight (transformers modeling_llama4.py): nothing to count.
            qk_norm=model_type.startswith("qwen3")
            or (_bool(c, "use_qk_norm", False, name) and not model_type.startswith("llama4")),
            quant_method=_quant_method(quant, name),
            quant_algo=_quant_algo(quant, name),
            **_precision_fields(quant, name),
            max_position_embeddings=int(c.get("max_position_embeddings") or 0),
            max_context_tokens=derived_max_model_len(c, model_type, name),
            longrope_original_tokens=longrope_original_tokens(c, name),
            **kw,
        )
        problem = spec.expert_quant_problem
        if problem:
            raise ModelConfigError(problem)
        return spec

    @property
    def checkpoint_precision(self) -> CheckpointPrecision:
        """What the checkpoint stores (``runtime.models.quant``): weight format, KV scales, note."""
        return CheckpointPrecision(self.weight_format, self.kv_cache_format, self.quant_method, self.precision_note,
                                   self.weight_block_size, self.unquantized_modules)

    # ------------------------------------------------------------------ parameter counts
    @property
    def num_moe_layers_or_zero(self) -> int:
        return self.num_moe_layers if self.num_experts else 0

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense (non-MoE) FFN."""
        return self.num_layers - self.num_moe_layers_or_zero

    @property
    def attention_params_per_layer(self) -> int:
        """Weights (+ biases, + attention norms) of one attention block, parameters."""
        h = self.hidden_size
        if self.is_mla:
            qk_head = self.qk_nope_head_dim + self.qk_rope_head_dim
            n = self.num_attention_heads
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * qk_head
            else:
                q = h * n * qk_head
            kv = (
                h * (self.kv_lora_rank + self.qk_rope_head_dim)
                + self.kv_lora_rank
                + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
            )
            o = n * self.v_head_dim * h
            return q + kv + o
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        p = h * q_out + 2 * h * kv_out + q_out * h
        if self.attention_bias:
            p += q_out + 2 * kv_out + h
        if self.model_type == "gpt_oss":
            p += self.num_attention_heads  # attention sinks
        if self.qk_norm:
            p += 2 * self.head_dim
        return p

    def _mlp_params(self, inter: int, bias: bool = False) -> int:
        # gated (SwiGLU) MLP: gate, up (hidden x inter) and down (inter x hidden)
        return 3 * self.hidden_size * inter + ((2 * inter + self.hidden_size) if bias else 0)

    @property
    def moe_params_per_layer(self) -> tuple[int, int]:
        """(total, active-per-token) parameters of one MoE FFN incl. router and shared experts."""
        expert = self._mlp_params(self.moe_intermediate_size, self.moe_bias)
        router = self.hidden_size * self.num_experts + (self.num_experts if self.moe_bias else 0)
        if self.model_type.startswith("deepseek"):
            router += self.num_experts  # e_score_correction_bias
        shared = self.num_shared_experts * self._mlp_params(self.shared_expert_intermediate_size)
        total = self.num_experts * expert + router + shared
        active = self.num_experts_per_tok * expert + router + shared
        return total, active

    @property
    def embedding_params(self) -> int:
        """Input embedding + LM head (0 extra when tied), parameters."""
        e = self.vocab_size * self.hidden_size
        return e if self.tie_word_embeddings else 2 * e

    def _count(self) -> tuple[int, int]:
        if "n" not in self._counts:
            norms = 2 * self.hidden_size
            per_layer_common = self.attention_params_per_layer + norms
            dense_ffn = self._mlp_params(self.intermediate_size)
            moe_total, moe_active = self.moe_params_per_layer if self.num_experts else (0, 0)
            body_total = (
                self.num_layers * per_layer_common
                + self.num_dense_layers * dense_ffn
                + self.num_moe_layers_or_zero * moe_total
            )
            body_active = (
                self.num_layers * per_layer_common
                + self.num_dense_layers * dense_ffn
                + self.num_moe_layers_or_zero * moe_active
            )
            tail = self.embedding_params + self.hidden_size  # + final norm
            self._counts["n"] = (body_total + tail, body_active + tail)
        return self._counts["n"]

    @property
    def num_params(self) -> int:
        """All parameters (embedding, LM head unless tied, every expert), parameters."""
        return self._count()[0]

    @property
    def num_active_params(self) -> int:
        """Parameters touched per token (top-k experts + shared + dense parts), parameters."""
        return self._count()[1]

    @property
    def num_active_matmul_params(self) -> int:
        """Active parameters that take part in per-token matmuls: active minus the input embedding
        (a lookup), plus the LM head even when tied. ``2 *`` this is the linear FLOPs per token."""
        return self.num_active_params - self.vocab_size * self.hidden_size + (
            self.vocab_size * self.hidden_size if self.tie_word_embeddings else 0
        )

    # ------------------------------------------------------------------ KV cache
    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads stored on one TP rank; vLLM replicates KV heads when ``tp > num_kv_heads``."""
        _check_tp(tp)
        return max(1, math.ceil(self.num_kv_heads / tp))

    def kv_bytes_per_token(self, kv_dtype_bytes: float, tp: int = 1) -> float:
        """KV-cache bytes one token occupies on ONE tensor-parallel rank.

        GQA/MHA: ``2 (K and V) * num_layers * kv_heads_per_rank(tp) * head_dim * kv_dtype_bytes``.
        MLA: ``num_layers * (kv_lora_rank + qk_rope_head_dim) * kv_dtype_bytes`` on every rank (the
        latent is not split by TP). All layers are counted, sliding-window ones included (conservative).

        Args:
            kv_dtype_bytes: bytes per cached value (2 for bf16, 1 for fp8).
            tp: tensor-parallel degree, >= 1.

        Raises:
            ValueError: tp < 1 or kv_dtype_bytes <= 0.
        """
        if kv_dtype_bytes <= 0:
            raise ValueError(f"kv_dtype_bytes must be > 0, got {kv_dtype_bytes}")
        _check_tp(tp)
        if self.is_mla:
            return float(self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * kv_dtype_bytes)
        return float(2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * kv_dtype_bytes)

    # ------------------------------------------------------------------ module names and quantisation
    def _moe_prefix(self) -> str:
        """The checkpoint's name of a layer's FFN block (``model.layers.{i}.<this>``)."""
        if self.model_type.startswith("llama4"):
            return "feed_forward"
        return "block_sparse_moe" if self.model_type == "mixtral" else "mlp"

    def _is_moe_layer(self, i: int) -> bool:
        return bool(self.num_experts) and (i in self.moe_layer_ids if self.moe_layer_ids
                                           else i >= self.num_layers - self.num_moe_layers)

    def linear_modules(self) -> list[tuple[str, int]]:
        """(checkpoint module name, parameters) of every linear layer outside the routed experts, the embedding
        and the LM head, as the Hugging Face checkpoints name them (``model.layers.{i}.self_attn.q_proj``, ...;
        MLA: ``q_a_proj`` / ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; a
        dense FFN's ``gate_proj`` / ``up_proj`` / ``down_proj``; an MoE layer's router ``gate`` (gpt-oss and
        Llama 4: ``router``) and shared experts), each preceded by ``module_prefix`` (a multimodal wrapper's
        ``language_model.``). Biases are counted with their layer; norms are not linear."""
        h, out = self.hidden_size, []
        b = 1 if self.attention_bias else 0
        ffn = self._moe_prefix()
        for i in range(self.num_layers):
            a = f"{self.module_prefix}model.layers.{i}.self_attn"
            if self.is_mla:
                n, qk = self.num_attention_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
                if self.q_lora_rank:
                    out += [(f"{a}.q_a_proj", h * self.q_lora_rank), (f"{a}.q_b_proj", self.q_lora_rank * n * qk)]
                else:
                    out.append((f"{a}.q_proj", h * n * qk))
                out += [(f"{a}.kv_a_proj_with_mqa", h * (self.kv_lora_rank + self.qk_rope_head_dim)),
                        (f"{a}.kv_b_proj", self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)),
                        (f"{a}.o_proj", n * self.v_head_dim * h)]
            else:
                q, kv = self.num_attention_heads * self.head_dim, self.num_kv_heads * self.head_dim
                out += [(f"{a}.q_proj", (h + b) * q), (f"{a}.k_proj", (h + b) * kv), (f"{a}.v_proj", (h + b) * kv),
                        (f"{a}.o_proj", q * h + b * h)]
            f = f"{self.module_prefix}model.layers.{i}.{ffn}"
            if not self._is_moe_layer(i):
                w = self.intermediate_size
                out += [(f"{f}.gate_proj", h * w), (f"{f}.up_proj", h * w), (f"{f}.down_proj", w * h)]
                continue
            router = "router" if self.model_type == "gpt_oss" or self.model_type.startswith("llama4") else "gate"
            out.append((f"{f}.{router}", h * self.num_experts))
            if self.num_shared_experts and self.shared_expert_intermediate_size:
                w = self.num_shared_experts * self.shared_expert_intermediate_size
                s = f"{f}.{self._shared_expert_name()}"
                out += [(f"{s}.gate_proj", h * w), (f"{s}.up_proj", h * w), (f"{s}.down_proj", w * h)]
        return out

    def _shared_expert_name(self) -> str:
        return "shared_experts" if self.model_type.startswith("deepseek") else "shared_expert"

    def module_is_unquantized(self, name: str) -> bool:
        """True when the quantization config keeps module ``name`` (a full path as :meth:`linear_modules` gives
        it, ``module_prefix`` included) in 16 bits (``runtime.models.quant.module_unquantized``). A ModelOpt
        entry naming a module (no wildcard) also matches it without a wrapper's ``language_model.`` prefix, as
        vLLM 0.28's ``ModelOptQuantConfigBase.is_layer_excluded`` matches it (on the name with the prefix
        removed); the other methods match the full path only (vLLM ``is_layer_skipped``)."""
        if module_unquantized(name, self.unquantized_modules):
            return True
        bare = name.removeprefix(self.module_prefix) if self.module_prefix else name
        if bare == name or not self.quant_method.lower().startswith("modelopt"):
            return False
        plain = tuple(p for p in self.unquantized_modules if not (p.startswith("re:") or "*" in p or "?" in p))
        return module_unquantized(bare, plain)

    @property
    def unquantized_linear_params(self) -> int:
        """Parameters of the linear layers of :meth:`linear_modules` that the quantization config keeps in 16
        bits (``unquantized_modules``, matched by :meth:`module_is_unquantized`; e.g. Llama-3.1-405B-FP8 keeps
        every attention projection and the first and last layers' MLPs in bf16). The routed experts (see
        :attr:`unquantized_expert_params`), embedding and LM head are not counted here."""
        if not self.unquantized_modules:
            return 0
        if "u" not in self._counts:
            self._counts["u"] = sum(n for name, n in self.linear_modules() if self.module_is_unquantized(name))
        return self._counts["u"]

    # ------------------------------------------------------------------ routed experts kept in 16 bits
    def _fused_experts(self) -> bool:
        """gpt-oss and Llama 4 checkpoints store each MoE layer's experts as two tensors holding every expert
        (``experts.gate_up_proj``, ``experts.down_proj``), not one module per expert."""
        return self.model_type == "gpt_oss" or self.model_type.startswith("llama4")

    def _expert_projections(self) -> tuple[str, ...]:
        """Names of one expert's weights under ``experts.{e}`` (Mixtral ``w1`` / ``w3`` / ``w2``, Qwen-MoE and
        DeepSeek ``gate_proj`` / ``up_proj`` / ``down_proj``), or the fused tensors under ``experts``."""
        if self._fused_experts():
            return FUSED_EXPERT_TENSORS
        return MIXTRAL_EXPERT_PROJECTIONS if self.model_type == "mixtral" else EXPERT_PROJECTIONS

    def experts_module(self, layer: int) -> str:
        """The module that holds MoE layer ``layer``'s routed experts, as vLLM 0.28 prefixes its fused-MoE layer
        and the checkpoint names its weights' parent: ``{module_prefix}model.layers.{layer}.{mlp | block_sparse_moe
        | feed_forward}.experts``."""
        return f"{self.module_prefix}model.layers.{layer}.{self._moe_prefix()}.experts"

    def routed_expert_modules(self, layer: int) -> list[str]:
        """Checkpoint names of MoE layer ``layer``'s routed-expert weights: ``{experts}.{e}.{projection}`` for every
        expert ``e`` in ``0 .. num_experts - 1`` and projection (Qwen-MoE / DeepSeek ``gate_proj``, ``up_proj``,
        ``down_proj``; Mixtral ``w1``, ``w3``, ``w2``), or the two fused tensors ``{experts}.gate_up_proj`` and
        ``{experts}.down_proj`` of gpt-oss and Llama 4 (``experts`` = :meth:`experts_module`). A DeepSeek-V3 layer
        has 256 x 3 names: callers walk them once per spec (``_expert_precision`` caches its answer)."""
        base = self.experts_module(layer)
        if self._fused_experts():
            return [f"{base}.{t}" for t in FUSED_EXPERT_TENSORS]
        projections = self._expert_projections()
        return [f"{base}.{e}.{p}" for e in range(self.num_experts) for p in projections]

    def _experts_named_by(self, base: str, entry: str) -> list[str]:
        """The routed-expert weights under ``base`` (:meth:`experts_module`) that the plain (no regex, no
        wildcard) ignore entry ``entry`` names: itself or its children (``experts.17`` names expert 17's
        projections), worked out from the name instead of walking every expert."""
        rest = entry[len(base) + 1:].split(".")
        projections = self._expert_projections()
        if self._fused_experts():
            return [entry] if len(rest) == 1 and rest[0] in projections else []
        e = rest[0]
        if not (e.isdigit() and str(int(e)) == e and int(e) < self.num_experts):
            return []
        if len(rest) == 1:
            return [f"{entry}.{p}" for p in projections]
        return [entry] if len(rest) == 2 and rest[1] in projections else []

    def _expert_patterns(self) -> tuple[tuple[str, ...], tuple[re.Pattern, ...]]:
        """The ignore entries that can name a routed expert's weight: (plain names, compiled regexes and
        wildcards). Plain names are kept whole (a layer's experts are matched against them by name); a
        ModelOpt entry also stands for itself under ``module_prefix`` (:meth:`module_is_unquantized`). A wildcard
        is dropped when some run of literal characters in it occurs in no expert name (``model.layers.*.self_attn``
        cannot match ``model.layers.3.mlp.experts.0.down_proj``); digit runs are compared as one digit, so the
        test holds for every layer and expert number. ``re:`` regexes are kept (what they match cannot be told
        from their text)."""
        modelopt = self.quant_method.lower().startswith("modelopt")
        plain: list[str] = []
        patterns: list[re.Pattern] = []
        templates = [_digits_as_zero(n) for n in (
            [f"{self.experts_module(0)}.{t}" for t in FUSED_EXPERT_TENSORS] if self._fused_experts()
            else [f"{self.experts_module(0)}.0.{p}" for p in self._expert_projections()])]
        for p in self.unquantized_modules:
            if p.startswith("re:"):
                try:
                    patterns.append(re.compile(p[3:]))
                except re.error:
                    continue  # module_unquantized skips it too
            elif "*" in p or "?" in p:
                runs = [_digits_as_zero(r) for r in re.split(r"[*?]", p) if r]
                if "[" in p or any(all(r in t for r in runs) for t in templates):
                    patterns += [re.compile(fnmatch.translate(p)), re.compile(fnmatch.translate(p + ".*"))]
            else:
                plain.append(p)
                if modelopt and self.module_prefix:
                    plain.append(self.module_prefix + p)
        return tuple(plain), tuple(patterns)

    def _expert_precision(self) -> tuple[tuple[int, ...], str]:
        """(MoE layers whose routed experts the checkpoint keeps in 16 bits, why vLLM cannot load the checkpoint or
        ""), computed once per spec: the tuner builds a PerfModel per candidate and each asks."""
        if "experts16" in self._counts:
            return self._counts["experts16"]
        wide: list[int] = []
        problems: list[tuple[int, str]] = []
        if self.num_experts and self.unquantized_modules:
            plain, patterns = self._expert_patterns()
            for i in (i for i in range(self.num_layers) if self._is_moe_layer(i)):
                base = self.experts_module(i)
                total = len(FUSED_EXPERT_TENSORS) if self._fused_experts() else (
                    self.num_experts * len(self._expert_projections()))
                kept: set[str] = set()
                if any(base == p or base.startswith(p + ".") for p in plain):
                    kept_n = total
                else:
                    for p in plain:
                        if p.startswith(base + "."):
                            kept.update(self._experts_named_by(base, p))
                    if patterns:
                        kept.update(n for n in self.routed_expert_modules(i) if any(rx.match(n) for rx in patterns))
                    kept_n = len(kept)
                vllm_wide, why = self._vllm_keeps_experts_wide(base)
                what = (f"the quantization config keeps {kept_n} of the {total} routed-expert weights of {base} "
                        "in 16 bits")
                if 0 < kept_n < total:
                    first = sorted(kept, key=_natural)[0]
                    problems.append((i, f"{what} (e.g. {first}), the others quantised; vLLM 0.28 builds a MoE "
                                        "layer's experts as one fused module of one precision, so some of them "
                                        "would be loaded at the wrong width"))
                elif why and vllm_wide is None:
                    problems.append((i, f"{what}, but {why}"))
                elif why and vllm_wide != (kept_n == total):
                    problems.append((i, f"{what}, but {why}: the experts would be loaded at the wrong width"))
                elif kept_n == total:
                    wide.append(i)
        problem = ""
        if problems:
            first = problems[0][1]
            more = f" ({len(problems)} MoE layers like it)" if len(problems) > 1 else ""
            problem = f"{self.name}: {first}{more}; vLLM cannot load this checkpoint, so it is not sized"
        self._counts["experts16"] = (tuple(wide), problem)
        return self._counts["experts16"]

    def _vllm_keeps_experts_wide(self, base: str) -> tuple[bool | None, str]:
        """Whether vLLM 0.28 builds the fused-MoE layer ``base`` (:meth:`experts_module`) unquantised, and the rule
        that decides it: (True / False, why) for the methods whose MoE exclusion is modelled, (None, why) when vLLM
        refuses the layer, (None, "") for the other methods. vLLM picks ONE method per fused-MoE layer, never per
        expert:

        * ``fp8`` (``Fp8Config.get_quant_method``, ``is_layer_skipped`` in exact mode): unquantised when an ignore
          entry containing ``experts`` contains ``base`` (``model.layers.3.mlp.experts.17.down_proj`` excludes
          every expert of layer 3); ``re:`` and ``*`` entries are compared as plain text;
        * ModelOpt (``ModelOptQuantConfigBase.is_layer_excluded``): that, or an entry that is a substring of
          ``base`` (also with ``language_model.`` removed), or a wildcard ``fnmatch`` matches ``base`` itself
          (``model.layers.*.mlp.experts.*`` does not: ``base`` has nothing after ``experts``);
        * compressed-tensors (``CompressedTensorsMoEMethod.get_moe_method``): unquantised when ``ignore`` (names,
          ``re:`` regexes) matches expert 0's ``gate_proj``, ``up_proj`` and ``down_proj`` (vLLM asks for those
          names in every family); vLLM raises when it matches only some of them;
        * ``mxfp4`` (``Mxfp4Config``): the experts are always quantised.
        """
        method = self.quant_method.lower()
        ignored = self.unquantized_modules
        exact = next((e for e in ignored if "experts" in e and base in e), "")
        if method == "fp8":
            return bool(exact), (f"vLLM's fp8 exclusion {'matches' if exact else 'does not match'} the fused "
                                 f"layer {base}" + (f" (entry {exact!r})" if exact else ""))
        if method.startswith("modelopt"):
            bare = base.removeprefix("language_model.")
            hit = exact or next((e for e in ignored if e != base and (e in base or e in bare)), "") or next(
                (e for e in ignored if fnmatch.fnmatchcase(base, e)), "")
            return bool(hit), (f"vLLM's ModelOpt exclude_modules {'match' if hit else 'do not match'} the fused "
                               f"layer {base}" + (f" (entry {hit!r})" if hit else ""))
        if method == "compressed-tensors":
            names = [f"{base}.0.{p}" for p in EXPERT_PROJECTIONS]
            flags = [any(_ct_ignores(n, e) for e in ignored) for n in names]
            if any(flags) and not all(flags):
                return None, (f"vLLM's compressed-tensors ignore matches only some of {', '.join(names)}, and "
                              "vLLM refuses that ('All MoE projections need to have same quantization scheme')")
            return all(flags), (f"vLLM's compressed-tensors ignore {'matches' if all(flags) else 'does not match'} "
                                f"{names[0]} and its siblings, which decide the whole fused layer")
        if method == "mxfp4":
            return False, "vLLM's mxfp4 method quantises every fused-MoE layer"
        return None, ""

    @property
    def unquantized_expert_layers(self) -> tuple[int, ...]:
        """Indices of the MoE layers whose routed experts (all of them: vLLM cannot load fewer, see
        :meth:`expert_quant_problem`) the quantization config keeps in 16 bits, e.g. ``model.layers.3.mlp.experts``
        in an fp8 ``ignored_layers``."""
        return self._expert_precision()[0]

    @property
    def unquantized_expert_params(self) -> int:
        """Parameters of the routed experts kept in 16 bits (:attr:`unquantized_expert_layers` x ``num_experts``
        x one expert's weights and biases), parameters."""
        return len(self.unquantized_expert_layers) * self.num_experts * self._mlp_params(
            self.moe_intermediate_size, self.moe_bias)

    @property
    def expert_quant_problem(self) -> str:
        """Why vLLM 0.28 cannot load this checkpoint's routed experts, "" when it can. vLLM gives all routed experts
        of a MoE layer one quantization method (one fused-MoE module, ``_vllm_keeps_experts_wide``), so an ignore
        list that keeps only some of a layer's experts (or only some of their projections) in 16 bits, or keeps
        them all while vLLM's own exclusion rule for the method builds the layer quantised (or the reverse),
        loads weights at the wrong width; ``from_hf_config`` refuses such a config with this message."""
        return self._expert_precision()[1]

    def block_quant_problem(self, tp: int, expert_parallel: bool = False) -> str:
        """Why vLLM 0.28 refuses to load this block-quantised checkpoint (``weight_block_size``
        ``[block_n, block_k]``) with attention / dense tensor parallelism ``tp``, "" when it loads it.

        What vLLM checks, and only that (``quantization/utils/fp8_utils.py`` ``validate_fp8_block_shape`` for
        linear layers, ``Fp8MoEMethod`` / ``CompressedTensorsW8A8Fp8MoEMethod.create_weights`` for the experts):

        * routed experts: the expert width per rank, ``moe_intermediate_size / tp`` (the whole width with
          expert parallelism: vLLM's ``FusedMoEParallelConfig`` gives each EP rank whole experts, MoE TP 1), is a
          multiple of ``block_n``, and, when ``tp > 1``, of ``block_k``;
        * with ``tp > 1``: every row-parallel layer's input share (attention ``o_proj``: heads x head_dim / tp;
          ``down_proj`` of dense FFNs and shared experts: width / tp) is a multiple of ``block_k``, and every
          column-parallel layer's output share a multiple of ``block_n``; ``fp8`` checkpoints skip that check
          for merged layers (QKV, gate/up: ``MergedColumnParallelLinear._maybe_allow_fp8_block_shape_mismatch``),
          compressed-tensors ones do not (their config has no ``weight_block_size`` attribute).

        ModelOpt ``FP8_PB_WO`` (128 x 128 blocks) is checked as vLLM's ``ModelOptFp8PbWoLinearMethod.create_weights``
        does, at every ``tp`` including 1: each quantised linear layer's output share (a merged layer's parts
        summed: QKV, gate/up, MLA ``q_a_proj`` + ``kv_a_proj_with_mqa``) and input share are multiples of 128;
        its routed experts load through the per-tensor ``ModelOptFp8MoEMethod`` and are not checked.

        Layers the config keeps unquantised (:meth:`module_is_unquantized`) are not checked. Attention-DP workers
        (TP 1 per rank) check the experts only.

        Raises:
            ValueError: ``tp`` is not an integer >= 1.
        """
        _check_tp(tp)
        if len(self.weight_block_size) != 2:
            return ""
        bn, bk = self.weight_block_size
        if self.quant_algo == "FP8_PB_WO":
            if ("pb_wo", tp) not in self._counts:  # walks every layer: the tuner asks once per candidate
                self._counts[("pb_wo", tp)] = self._pb_wo_problem(tp)
            return self._counts[("pb_wo", tp)]
        merged = self.quant_method.lower() == "compressed-tensors"  # no fp8 mismatch allowance for merged layers
        checks: list[tuple[str, str, int, str]] = []  # (module name, what, size, "n"/"k")
        moe = [i for i in range(self.num_layers) if self._is_moe_layer(i)]
        dense = [i for i in range(self.num_layers) if not self._is_moe_layer(i)]
        ffn = self._moe_prefix()
        layer = f"{self.module_prefix}model.layers"
        if moe:
            w = self.moe_intermediate_size if expert_parallel else self.moe_intermediate_size // tp
            how = (f"moe_intermediate_size {self.moe_intermediate_size}" if expert_parallel
                   else f"moe_intermediate_size {self.moe_intermediate_size} / TP {tp}")
            name = f"{layer}.{moe[0]}.{ffn}.experts"
            checks.append((name, f"expert width per rank {w} ({how})", w, "n"))
            if tp > 1:
                checks.append((name, f"expert down_proj input per rank {w} ({how})", w, "k"))
        if tp > 1:
            a = f"{layer}.0.self_attn"
            n = self.num_attention_heads
            if self.is_mla:
                qk = self.qk_nope_head_dim + self.qk_rope_head_dim
                q = "q_b_proj" if self.q_lora_rank else "q_proj"
                checks += [(f"{a}.{q}", f"{q} output per rank {n * qk // tp}", n * qk // tp, "n"),
                           (f"{a}.kv_b_proj", f"kv_b_proj output per rank "
                            f"{n * (self.qk_nope_head_dim + self.v_head_dim) // tp}",
                            n * (self.qk_nope_head_dim + self.v_head_dim) // tp, "n"),
                           (f"{a}.o_proj", f"o_proj input per rank {n * self.v_head_dim // tp}",
                            n * self.v_head_dim // tp, "k")]
            else:
                q = n * self.head_dim // tp
                checks.append((f"{a}.o_proj", f"o_proj input per rank {q} ({n} heads x {self.head_dim} / TP {tp})",
                               q, "k"))
                if merged:
                    kv = self.kv_heads_per_rank(tp) * self.head_dim
                    checks += [(f"{a}.q_proj", f"q_proj output per rank {q}", q, "n"),
                               (f"{a}.k_proj", f"k_proj / v_proj output per rank {kv}", kv, "n")]
            mlps = []
            if dense:
                mlps.append((f"{layer}.{dense[0]}.{ffn}", "", self.intermediate_size))
            if moe and self.num_shared_experts and self.shared_expert_intermediate_size:
                mlps.append((f"{layer}.{moe[0]}.{ffn}.{self._shared_expert_name()}", "shared expert ",
                             self.num_shared_experts * self.shared_expert_intermediate_size))
            for prefix, what, width in mlps:
                w = width // tp
                checks.append((f"{prefix}.down_proj", f"{what}down_proj input per rank {w} ({width} / TP {tp})",
                               w, "k"))
                if merged:
                    checks.append((f"{prefix}.gate_proj", f"{what}gate_proj / up_proj output per rank {w}", w, "n"))
        for name, what, size, dim in checks:
            block = bn if dim == "n" else bk
            if size % block and not self.module_is_unquantized(name):
                return (f"{what} is not a multiple of the {self.weight_format} weight block_{dim} {block} "
                        f"(weight_block_size [{bn}, {bk}]): vLLM refuses to load it")
        return ""

    def _pb_wo_problem(self, tp: int) -> str:
        """``block_quant_problem`` for ModelOpt ``FP8_PB_WO``: every quantised linear layer of every layer, as
        ``ModelOptFp8PbWoLinearMethod.create_weights`` checks its per-rank shape (``output_size_per_partition``
        summed over a merged layer's parts, ``input_size_per_partition``). Routers are built unquantised by
        vLLM's MoE models and are not checked."""
        bn, bk = self.weight_block_size
        h, n = self.hidden_size, self.num_attention_heads
        # (shard module suffixes, what, out per rank, in per rank), for attention and for each kind of FFN
        attn: list[tuple[tuple[str, ...], str, int, int]] = []
        if self.is_mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            kv_a = self.kv_lora_rank + self.qk_rope_head_dim
            if self.q_lora_rank:
                attn += [(("q_a_proj", "kv_a_proj_with_mqa"), "q_a_proj + kv_a_proj_with_mqa (fused_qkv_a_proj)",
                          self.q_lora_rank + kv_a, h),
                         (("q_b_proj",), "q_b_proj", n * qk // tp, self.q_lora_rank)]
            else:
                attn += [(("q_proj",), "q_proj", n * qk // tp, h), (("kv_a_proj_with_mqa",), "kv_a_proj_with_mqa",
                                                                     kv_a, h)]
            attn += [(("kv_b_proj",), "kv_b_proj", n * (self.qk_nope_head_dim + self.v_head_dim) // tp,
                      self.kv_lora_rank),
                     (("o_proj",), "o_proj", h, n * self.v_head_dim // tp)]
        else:
            qkv = (n // tp + 2 * self.kv_heads_per_rank(tp)) * self.head_dim
            attn += [(("q_proj", "k_proj", "v_proj"), "q_proj + k_proj + v_proj (qkv_proj)", qkv, h),
                     (("o_proj",), "o_proj", h, n * self.head_dim // tp)]

        def mlp(width: int) -> list[tuple[tuple[str, ...], str, int, int]]:
            return [(("gate_proj", "up_proj"), "gate_proj + up_proj", 2 * width // tp, h),
                    (("down_proj",), "down_proj", h, width // tp)]

        ffn = self._moe_prefix()
        shared = self.num_shared_experts * self.shared_expert_intermediate_size
        for i in range(self.num_layers):
            base = f"{self.module_prefix}model.layers.{i}"
            groups = [(f"{base}.self_attn", attn)]
            if not self._is_moe_layer(i):
                groups.append((f"{base}.{ffn}", mlp(self.intermediate_size)))
            elif shared:
                groups.append((f"{base}.{ffn}.{self._shared_expert_name()}", mlp(shared)))
            for prefix, checks in groups:
                for shards, what, out, inp in checks:
                    if all(self.module_is_unquantized(f"{prefix}.{s}") for s in shards):
                        continue
                    for size, dim, block in ((out, "n", bn), (inp, "k", bk)):
                        if size % block:
                            side = "output" if dim == "n" else "input"
                            return (f"{prefix}.{what} {side} per rank {size} (TP {tp}) is not a multiple of the "
                                    f"ModelOpt FP8_PB_WO weight block_{dim} {block} (blocks [{bn}, {bk}]): "
                                    "vLLM refuses to load it")
        return ""

    def tp_divides_heads(self, tp: int) -> bool:
        """True when vLLM can shard the attention over ``tp`` ranks: ``tp`` divides the attention heads,
        and either divides the KV heads or is a multiple of them (then each KV head is replicated on
        ``tp / num_kv_heads`` ranks, as vLLM's QKVParallelLinear does; ``kv_heads_per_rank`` counts the
        copies). MLA has no KV heads: only attention heads count."""
        _check_tp(tp)
        if self.num_attention_heads % tp:
            return False
        return self.is_mla or self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0


def _digits_as_zero(s: str) -> str:
    """``s`` with every run of digits replaced by one ``0``: a substring of a module name stays a substring of
    the name so rewritten, whatever the layer and expert numbers."""
    return re.sub(r"[0-9]+", "0", s)


def _natural(name: str) -> list:
    """Sort key ordering ``experts.2`` before ``experts.10``."""
    return [int(t) if t.isdigit() else t for t in re.split(r"([0-9]+)", name)]


def _ct_ignores(name: str, entry: str) -> bool:
    """vLLM 0.28 compressed-tensors ``_is_equal_or_regex_match``: ``re:`` entries by ``re.match``, others equal."""
    if entry.startswith("re:"):
        try:
            return re.match(entry[3:], name) is not None
        except re.error:
            return False
    return entry == name


def _first(c: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if c.get(k) is not None:
            return c[k]
    return None


def _short(v: Any, limit: int = 80) -> str:
    """``repr(v)`` cut to ``limit`` characters for error messages."""
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _bool(c: dict[str, Any], key: str, default: bool, name: str) -> bool:
    """A JSON boolean field; absent or null -> ``default``. Raises ModelConfigError naming the field for any
    other value (the string ``"false"`` would otherwise be truthy)."""
    v = c.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ModelConfigError(f"{name}: field {key} must be a JSON boolean (true/false), got {_short(v)}")
    return v


def _int_list(c: dict[str, Any], key: str, name: str) -> list[int]:
    """A list of whole numbers (layer indices or 0/1 flags); absent or null -> []. Raises ModelConfigError
    naming the field when it is not a list or holds a non-integer (bools included)."""
    v = c.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ModelConfigError(f"{name}: field {key} must be a list of integers, got {_short(v)}")
    return v


def _layer_types(c: dict[str, Any], layers: int, model_type: str, name: str) -> list[str]:
    """``layer_types``: absent or null -> []; else a list of one known type (``KNOWN_LAYER_TYPES``) per layer.

    Raises:
        ModelConfigError: not a list of strings, a length other than ``num_hidden_layers``, an unknown layer
            type (named, with the known ones), or ``chunked_attention`` outside Llama 4.
    """
    v = c.get("layer_types")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise ModelConfigError(
            f"{name}: field layer_types must be a list of strings (one per layer), got {_short(v)}"
        )
    unknown = sorted(set(v) - set(KNOWN_LAYER_TYPES))
    if unknown:
        raise ModelConfigError(
            f"{name}: layer_types has layer type(s) pdserve does not model: {', '.join(unknown)}; "
            f"known: {', '.join(KNOWN_LAYER_TYPES)}"
        )
    if "chunked_attention" in v and not model_type.startswith("llama4"):
        raise ModelConfigError(
            f"{name}: layer_types chunked_attention is modelled only for Llama 4 (attention_chunk_size), "
            f"model_type={model_type!r}"
        )
    if v and len(v) != layers:
        raise ModelConfigError(
            f"{name}: layer_types has {len(v)} entries but num_hidden_layers={layers} (one per layer)"
        )
    return v


def _quant_method(quant: Any, name: str) -> str:
    """``quantization_config.quant_method`` as a string; "" when there is no quantization_config or the
    method is absent / null. Raises ModelConfigError when quantization_config is not a JSON object or the
    method is present but not a string."""
    if not quant:
        return ""
    if not isinstance(quant, dict):
        raise ModelConfigError(f"{name}: field quantization_config must be a JSON object, got {_short(quant)}")
    v = quant.get("quant_method")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ModelConfigError(f"{name}: field quantization_config.quant_method must be a string, got {_short(v)}")
    return v


def _quant_algo(quant: Any, name: str) -> str:
    """``quantization_config.quant_algo`` (ModelOpt checkpoints: ``FP8``, ``NVFP4``, ...), upper-cased; ""
    when absent or null. Raises ModelConfigError when present but not a string."""
    v = quant.get("quant_algo") if isinstance(quant, dict) else None
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ModelConfigError(f"{name}: field quantization_config.quant_algo must be a string, got {_short(v)}")
    return v.upper()


def _precision_fields(quant: Any, name: str) -> dict[str, str]:
    """``weight_format`` / ``kv_cache_format`` / ``precision_note`` of ``quantization_config`` (already checked
    to be an object by ``_quant_method``)."""
    p = detect_precision(quant, name)
    return {"weight_format": p.weights, "kv_cache_format": p.kv_cache, "precision_note": p.note,
            "weight_block_size": p.block_size, "unquantized_modules": p.unquantized}


def _needs_dense_ffn(c: dict[str, Any], num_experts: int) -> bool:
    if "n_routed_experts" in c:
        return int(c.get("first_k_dense_replace") or 0) > 0
    if str(c.get("model_type", "")).startswith("llama4"):
        return True
    if c.get("moe_intermediate_size") is None:
        return True  # Mixtral / gpt-oss: experts use intermediate_size
    return bool(c.get("mlp_only_layers")) or int(c.get("decoder_sparse_step") or 1) > 1


# Numeric config fields and the smallest value each may take when present (None/absent = not used).
_MIN_VALUE = {
    "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 1,
    "num_key_value_heads": 1, "head_dim": 1, "intermediate_size": 1, "intermediate_size_mlp": 1,
    "moe_intermediate_size": 1, "shared_expert_intermediate_size": 0,
    "num_local_experts": 0, "num_experts": 0, "n_routed_experts": 0, "n_shared_experts": 0,
    "num_experts_per_tok": 1, "experts_per_token": 1,
    "interleave_moe_layer_step": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1, "decoder_sparse_step": 1,
    "kv_lora_rank": 1, "q_lora_rank": 0, "qk_nope_head_dim": 1, "qk_rope_head_dim": 1, "v_head_dim": 1,
    "sliding_window": 0, "attention_chunk_size": 0, "no_rope_layer_interval": 1, "max_position_embeddings": 1,
}


#: upper bounds: the engines index sizes and positions with 32-bit integers, so a larger value is no model
#: vLLM can serve; the parser counts layers one by one (the deepest published decoders have a few hundred
#: layers), so an absurd layer count is refused rather than walked for minutes
_MAX_VALUE = 2**31 - 1
_MAX_VALUE_BY_KEY = {"num_hidden_layers": 10_000}


def _check_numbers(c: dict[str, Any], name: str) -> None:
    """Every numeric field that is present must be a whole number (not a bool, string or fraction) at
    least its minimum (``_MIN_VALUE``) and at most its maximum (``_MAX_VALUE_BY_KEY``, else
    ``_MAX_VALUE``). Raises ModelConfigError naming every offending field."""
    bad = []
    for key, least in _MIN_VALUE.items():
        v = c.get(key)
        if v is None:
            continue
        most = _MAX_VALUE_BY_KEY.get(key, _MAX_VALUE)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
            bad.append(f"{key}={v!r} (must be a whole number)")
        elif v < least:
            bad.append(f"{key}={v!r} (must be >= {least})")
        elif v > most:
            bad.append(f"{key}={v!r} (must be <= {most})")
    if bad:
        raise ModelConfigError(f"{name}: invalid config.json field(s): {'; '.join(bad)}")


def _pos_int(c: dict[str, Any], key: str, name: str) -> int:
    try:
        v = int(c[key])
    except (TypeError, ValueError):
        raise ModelConfigError(f"{name}: field {key} must be an integer, got {c[key]!r}") from None
    if v <= 0:
        raise ModelConfigError(f"{name}: field {key} must be > 0, got {v}")
    return v


def _check_tp(tp: int) -> None:
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")


#: types whose ``factor`` vLLM does not apply to the context (``_get_and_verify_max_len``): their
#: ``max_position_embeddings`` is already the extended length. Any other type's ``factor``, ``default`` (and
#: ``mrope``, which vLLM renames to it) included, multiplies it.
_UNSCALED_ROPE_TYPES = ("su", "longrope", "llama3")

#: the RoPE types vLLM 0.28 builds (``model_executor/layers/rotary_embedding/__init__.py`` ``get_rope``; any other
#: is "Unknown RoPE scaling type"), with the legacy spellings it renames first (``transformers_utils/config.py``
#: ``patch_legacy_rope_type``: ``su`` -> ``longrope``, ``mrope`` -> ``default``)
KNOWN_ROPE_TYPES = ("default", "linear", "dynamic", "ntk", "yarn", "longrope", "llama3", "deepseek_yarn",
                    "deepseek_llama_scaling", "proportional", "mllama4", "xdrope", "openpangu", "telechat3-yarn",
                    "su", "mrope")
#: the types whose ``get_rope`` branch reads ``factor`` (transformers' rope validation also requires it for
#: linear, dynamic, yarn and llama3); dynamic NTK may give ``alpha`` instead
_FACTOR_ROPE_TYPES = ("linear", "dynamic", "ntk", "yarn", "llama3", "deepseek_yarn", "deepseek_llama_scaling",
                      "telechat3-yarn")


def derived_max_model_len(c: dict[str, Any], model_type: str, name: str) -> int:
    """The longest context, tokens, vLLM derives from a (text) config: ``max_position_embeddings``, times the
    RoPE scaling ``factor`` for scaling types that extend it (linear, dynamic, yarn, ...; YaRN multiplies its
    ``original_max_position_embeddings``), unchanged for llama3/longrope/su (their ``max_position_embeddings``
    is already the extended length) and for Gemma 3. Source: vLLM 0.28 ``vllm/config/model.py``
    ``_get_and_verify_max_len``. 0 when the config has no ``max_position_embeddings``.

    ``rope_scaling`` (or ``rope_parameters``, flat or per layer type) is read for this length only; its other
    fields (theta, frequency factors, ``mrope_section``, ...) change no size pdserve computes and are not read.

    Raises:
        ModelConfigError: ``rope_scaling`` / ``rope_parameters`` (or one per-layer-type entry) is not an object;
            its type is not one vLLM builds (``KNOWN_ROPE_TYPES``), or ``rope_type`` and legacy ``type``
            disagree (vLLM refuses both); a type that needs a ``factor`` has none; the factor or original length
            is not a positive number.
    """
    base = int(c.get("max_position_embeddings") or 0)
    if "gemma3" in model_type:
        return base
    factor, limit = 1.0, float(base)
    for where, rp in _rope_entries(c, name):
        rope_type = _rope_type(rp, where, name)
        if rope_type in _FACTOR_ROPE_TYPES and "factor" not in rp and not (rope_type == "dynamic" and "alpha" in rp):
            raise ModelConfigError(f"{name}: {where} of type {rope_type!r} has no factor (vLLM and transformers "
                                   "need one to build it)")
        if rope_type in _UNSCALED_ROPE_TYPES:
            continue
        f = rp.get("factor", factor)
        f = 1.0 if f is None else f
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
            raise ModelConfigError(f"{name}: {where}.factor must be a positive number, got {f!r}")
        factor = float(f)
        if rope_type == "yarn" and rp.get("original_max_position_embeddings") is not None:
            orig = rp["original_max_position_embeddings"]
            if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
                raise ModelConfigError(f"{name}: {where}.original_max_position_embeddings must be a "
                                       f"positive integer, got {orig!r}")
            limit = float(orig)
    return int(limit * factor) if base else 0


def longrope_original_tokens(c: dict[str, Any], name: str) -> int:
    """The original context, tokens, of a (text) config with LongRoPE scaling (``longrope``, legacy ``su``):
    its ``original_max_position_embeddings`` (the config's own, else the RoPE object's); 0 for any other RoPE.

    vLLM 0.28 keeps LongRoPE's short factors only while ``max_model_len`` is at most this length and applies
    the long factors to every sequence above it, "at the cost of some performance degradation for shorter
    sequences" (``Phi3LongRoPEScaledRotaryEmbedding``); without ``--max-model-len`` it serves this length
    (``vllm/config/model.py`` ``_get_and_verify_max_len``).

    Raises:
        ModelConfigError: as `derived_max_model_len`, or an original length that is not a positive integer.
    """
    for where, rp in _rope_entries(c, name):
        if _rope_type(rp, where, name) not in ("longrope", "su"):
            continue
        orig = c.get("original_max_position_embeddings", rp.get("original_max_position_embeddings"))
        if orig is None:
            return 0
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise ModelConfigError(f"{name}: original_max_position_embeddings of a LongRoPE model must be a "
                                   f"positive integer, got {orig!r}")
        return orig
    return 0


def _rope_entries(c: dict[str, Any], name: str) -> list[tuple[str, Any]]:
    """(where, RoPE object) of a config's ``rope_scaling`` (or ``rope_parameters``): one entry, or one per
    layer type in transformers v5's nested form (null entries, NoPE layer types, left out; vLLM tells the
    nested form by its keys, ``is_rope_parameters_nested``: all of them layer type names); [] without one.

    Raises:
        ModelConfigError: the field is not an object or null.
    """
    key = "rope_scaling" if c.get("rope_scaling") is not None else "rope_parameters"
    rope = c.get(key)
    if rope is None:
        return []
    if not isinstance(rope, dict):
        raise ModelConfigError(f"{name}: {key} must be a JSON object or null, got {_short(rope)}")
    if rope and all(k in KNOWN_LAYER_TYPES for k in rope):
        return [(f"{key}.{k}", v) for k, v in rope.items() if v is not None]
    return [(key, rope)]


def _rope_type(rp: Any, where: str, name: str) -> str:
    """The RoPE type of one ``rope_scaling`` object (``rope_type``, else legacy ``type``, else ``default``).

    Raises:
        ModelConfigError: ``rp`` is not an object, the type is not a string or not in ``KNOWN_ROPE_TYPES``, or
            ``rope_type`` and ``type`` name different types (other than vLLM's accepted su/longrope and
            mrope/default pairs).
    """
    if not isinstance(rp, dict):
        raise ModelConfigError(f"{name}: {where} must be a JSON object, got {_short(rp)}")
    modern, legacy = rp.get("rope_type"), rp.get("type")
    if modern is not None and legacy is not None and modern != legacy and (legacy, modern) not in (
            ("su", "longrope"), ("mrope", "default")):
        raise ModelConfigError(f"{name}: {where} has rope_type {modern!r} and type {legacy!r}; vLLM refuses "
                               "a config whose two fields disagree")
    rope_type = modern if modern is not None else legacy if legacy is not None else "default"
    if not isinstance(rope_type, str) or rope_type not in KNOWN_ROPE_TYPES:
        raise ModelConfigError(
            f"{name}: {where} has RoPE type {_short(rope_type)}, which vLLM cannot build (its factor's effect on "
            f"the context length is unknown); known: {', '.join(KNOWN_ROPE_TYPES)}"
        )
    return rope_type
