"""Configuration as plain dataclasses.

`ModelConfig` mirrors a DeepSeek-V3 `config.json` (Hugging Face field names). The engine-side configs
(`SpeculativeConfig`, `KvCacheConfig`, `LLMConfig`) mirror TensorRT-LLM's LLM-API objects of the same
names; the CLI flags and the YAML file both fill these objects, nothing else.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# --------------------------------------------------------------------------------------------
# Model config (config.json)
# --------------------------------------------------------------------------------------------

_REQUIRED_INT = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "intermediate_size", "vocab_size",
)


@dataclass
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    vocab_size: int
    q_lora_rank: Optional[int] = None
    moe_intermediate_size: int = 0
    n_routed_experts: Optional[int] = None
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    num_nextn_predict_layers: int = 0
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Any = None
    torch_dtype: Optional[str] = None
    quantization_config: Optional[dict] = None
    raw: dict = field(default_factory=dict, repr=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Numbers cached per token per layer: the latent c_kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_mtp_modules(self) -> int:
        return self.num_nextn_predict_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Main layers follow first_k_dense_replace / moe_layer_freq; MTP layers count from
        num_hidden_layers, so on a real DeepSeek-V3 they are MoE layers too."""
        return (
            self.n_routed_experts is not None
            and self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs and rs.get("type", rs.get("rope_type")) == "yarn":
            mscale_all_dim = rs.get("mscale_all_dim", 0)
            if mscale_all_dim:
                m = yarn_get_mscale(float(rs["factor"]), float(mscale_all_dim))
                scale = scale * m * m
        return scale

    # ---- loading -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        missing = [k for k in _REQUIRED_INT if k not in d]
        if missing:
            raise ValueError(f"{source}: missing required field(s) {', '.join(missing)}; "
                             "a DeepSeek-V3 config.json needs them")
        kwargs: dict[str, Any] = {}
        for name in cls.__dataclass_fields__:
            if name != "raw" and name in d:
                kwargs[name] = d[name]
        rp = d.get("rope_parameters")
        if isinstance(rp, dict):   # transformers 5.x writes rope_theta / YaRN here
            if "rope_theta" in rp:
                kwargs["rope_theta"] = rp["rope_theta"]
            if rp.get("rope_type", rp.get("type", "default")) != "default" and not kwargs.get("rope_scaling"):
                kwargs["rope_scaling"] = dict(rp)
        cfg = cls(**kwargs, raw=dict(d))
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(d, source=str(path))

    def validate(self, source: str = "config.json") -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"{source}: {msg}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for k in _REQUIRED_INT:
            v = getattr(self, k)
            if not is_int(v) or v <= 0:
                bad(f"{k} must be a positive integer, got {v!r}")
        for k in ("moe_intermediate_size", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                  "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "max_position_embeddings"):
            v = getattr(self, k)
            if not is_int(v) or v < 0:
                bad(f"{k} must be a non-negative integer, got {v!r}")
        if self.n_routed_experts is not None and (not is_int(self.n_routed_experts) or self.n_routed_experts < 0):
            bad(f"n_routed_experts must be null or a non-negative integer, got {self.n_routed_experts!r}")
        for k in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            v = getattr(self, k)
            if not is_num(v) or v <= 0:
                bad(f"{k} must be a positive number, got {v!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            bad(f"q_lora_rank must be null or a positive integer, got {self.q_lora_rank!r}")
        if self.num_nextn_predict_layers < 0:
            bad(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            bad(f"hidden_act {self.hidden_act!r} is not supported (DeepSeek-V3 uses silu)")
        if self.n_routed_experts:
            if self.moe_intermediate_size <= 0:
                bad("moe_intermediate_size must be > 0 when n_routed_experts is set")
            if not (0 < self.num_experts_per_tok <= self.n_routed_experts):
                bad(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..n_routed_experts="
                    f"{self.n_routed_experts}")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                bad(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if not (0 < self.topk_group <= self.n_group):
                bad(f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}")
            per_group = self.n_routed_experts // self.n_group
            if self.topk_group * per_group < self.num_experts_per_tok:
                bad(f"topk_group={self.topk_group} groups of {per_group} experts cannot hold "
                    f"num_experts_per_tok={self.num_experts_per_tok} experts")
            if self.n_group > 1 and per_group < 2:
                bad(f"group-limited routing needs >= 2 experts per group (n_routed_experts="
                    f"{self.n_routed_experts}, n_group={self.n_group})")
            if self.scoring_func != "sigmoid":
                bad(f"scoring_func {self.scoring_func!r} is not supported (DeepSeek-V3 uses sigmoid)")
        if self.moe_layer_freq <= 0:
            bad(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        rs = self.rope_scaling
        if rs is not None:
            if not isinstance(rs, dict):
                bad("rope_scaling must be an object or null")
            kind = rs.get("type", rs.get("rope_type"))
            if kind not in ("yarn", "default", None):
                bad(f"rope_scaling type {kind!r} is not supported (yarn only)")
            if kind == "yarn":
                for k in ("factor", "original_max_position_embeddings"):
                    if k not in rs:
                        bad(f"rope_scaling (yarn) is missing {k}")
        if self.tie_word_embeddings:
            bad("tie_word_embeddings=true is not a DeepSeek-V3 layout (lm_head is separate)")


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# --------------------------------------------------------------------------------------------
# Engine configs (TensorRT-LLM LLM-API names)
# --------------------------------------------------------------------------------------------

MTP_MODES = ("auto", "eagle", "vanilla")


@dataclass
class SpeculativeConfig:
    decoding_type: str = "MTP"
    num_nextn_predict_layers: int = 1          # K = max_draft_len
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    use_mtp_vanilla: bool = False
    mtp_mode: str = "auto"                     # auto | eagle | vanilla
    # how many drafts a step verifies (mtp_core/speculative/policy.py): cost = 0..K chosen per step from
    # measured step costs and each request's acceptance; fixed = K every step (before the policy)
    draft_len_policy: str = "cost"
    # explicit adaptive rules (mtp_core/speculative/adaptive.py); they bound the policy's choice
    draft_confidence_threshold: float = 0.0    # stop a chain when the product of draft probabilities < this
    draft_len_schedule: Optional[dict] = None  # {batch size: max drafts}, e.g. {1: 4, 4: 2, 16: 0}
    acceptance_window: int = 0                 # steps in a request's window (0 = off)
    acceptance_length_threshold: float = 0.0   # window AL below this: the request pauses drafting

    @property
    def max_draft_len(self) -> int:
        return self.num_nextn_predict_layers

    def resolved_mode(self, num_modules: int) -> str:
        """auto: one module -> eagle, more -> vanilla (TensorRT-LLM's rule)."""
        if self.use_mtp_vanilla:
            return "vanilla"
        if self.mtp_mode == "auto":
            return "vanilla" if num_modules > 1 else "eagle"
        return self.mtp_mode

    def validate(self) -> None:
        if str(self.decoding_type).upper() != "MTP":
            raise ValueError(f"speculative_config.decoding_type {self.decoding_type!r} is not supported; use MTP")
        if self.num_nextn_predict_layers < 1:
            raise ValueError("speculative_config.num_nextn_predict_layers must be >= 1 "
                             f"(got {self.num_nextn_predict_layers}); omit speculation for nextn=0")
        if self.relaxed_topk < 1:
            raise ValueError(f"speculative_config.relaxed_topk must be >= 1, got {self.relaxed_topk}")
        if self.relaxed_delta < 0:
            raise ValueError(f"speculative_config.relaxed_delta must be >= 0, got {self.relaxed_delta}")
        if self.mtp_mode not in MTP_MODES:
            raise ValueError(f"speculative_config.mtp_mode must be one of {', '.join(MTP_MODES)}, "
                             f"got {self.mtp_mode!r}")
        from mtp_core.speculative.adaptive import validate_adaptive
        from mtp_core.speculative.policy import POLICIES
        if self.draft_len_policy not in POLICIES:
            raise ValueError(f"speculative_config.draft_len_policy must be one of {', '.join(POLICIES)} (cost: choose "
                             f"0..K drafts per step from measured costs; fixed: K every step), got "
                             f"{self.draft_len_policy!r}")
        validate_adaptive(self)

    @property
    def adaptive(self) -> bool:
        """Any adaptive draft-length option on (the number of drafts may then differ per row and step)."""
        return bool(self.draft_confidence_threshold or self.draft_len_schedule or self.acceptance_window)


@dataclass
class KvCacheConfig:
    free_gpu_memory_fraction: float = 0.9
    tokens_per_block: int = 64
    max_tokens: Optional[int] = None
    dtype: str = "auto"
    enable_block_reuse: bool = True       # prefix caching: full KV blocks outlive their request

    def validate(self) -> None:
        if not (0.0 < self.free_gpu_memory_fraction <= 1.0):
            raise ValueError("kv_cache_config.free_gpu_memory_fraction must be in (0, 1], "
                             f"got {self.free_gpu_memory_fraction}")
        if self.tokens_per_block < 1:
            raise ValueError(f"kv_cache_config.tokens_per_block must be >= 1, got {self.tokens_per_block}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"kv_cache_config.max_tokens must be >= 1, got {self.max_tokens}")
        if self.dtype not in ("auto", "fp8", "float32", "bfloat16", "float16"):
            raise ValueError(f"kv_cache_config.dtype must be auto or fp8, got {self.dtype!r}")


@dataclass
class CudaGraphConfig:
    batch_sizes: Optional[list] = None
    max_batch_size: int = 0
    enable_padding: bool = False


@dataclass
class MoeConfig:
    backend: str = "auto"


@dataclass
class LLMConfig:
    """Everything the engine needs besides the checkpoint."""
    model_dir: str = ""
    dtype: str = "auto"                          # auto | float32 | bfloat16
    max_batch_size: int = 8
    max_num_tokens: int = 8192
    max_seq_len: Optional[int] = None            # default: the model's max_position_embeddings
    speculative_config: Optional[SpeculativeConfig] = None
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    cuda_graph_config: Optional[CudaGraphConfig] = None
    moe_config: MoeConfig = field(default_factory=MoeConfig)
    disable_overlap_scheduler: bool = False
    # The overlap scheduler hides host work behind device compute; on a CPU both share the same cores and
    # it measured slower (BENCHMARKS.md), so it runs there only when this is set (the tests set it).
    overlap_scheduler_on_cpu: bool = False
    # On a CPU with the native forward, a greedy decode step (plain, or MTP Eagle with strict acceptance) runs
    # as one native call (engine/native_step.py); False runs every step through the general path (the
    # reference the native step is tested against; env MTP_CORE_NATIVE_STEP=0 does the same)
    native_step: bool = True
    enable_chunked_prefill: bool = False
    print_iter_log: bool = False
    tensor_parallel_size: int = 1
    moe_expert_parallel_size: int = 1
    device: str = "cpu"
    keep_quantized: Optional[bool] = None        # FP8/NVFP4 stay packed; None: on a CPU with the native kernels
    num_threads: Optional[int] = None

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.speculative_config is not None:
            self.speculative_config.validate()
        self.kv_cache_config.validate()
