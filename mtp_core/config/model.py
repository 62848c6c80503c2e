"""`ModelConfig`: a DeepSeek-V3 `config.json` (Hugging Face field names), checked when it is read.

The engine's own settings (LLMConfig and its sections) are in engine.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

_DSA_DEFAULTS = {"index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
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
    # DeepSeek-V3.2's sparse attention (DSA): set on a `deepseek_v32` checkpoint, None on DeepSeek-V3
    index_topk: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_n_heads: Optional[int] = None
    raw: dict = field(default_factory=dict, repr=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_dsa(self) -> bool:
        """DeepSeek Sparse Attention (DeepSeek-V3.2): every layer has a lightning indexer that picks the
        index_topk keys each query attends to (model/dsa.py)."""
        return self.index_topk is not None

    @property
    def latent_dim(self) -> int:
        """The MLA latent row: c_kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Numbers cached per token per layer: the latent c_kv plus the shared rope key, then (DSA) the
        indexer's key, in one row so that paging, rewind, prefix caching and block copies cover both."""
        return self.latent_dim + (self.index_head_dim if self.is_dsa else 0)

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
        if d.get("model_type") == "deepseek_v32" or any(k in d for k in _DSA_DEFAULTS):
            for k, v in _DSA_DEFAULTS.items():    # transformers' DeepseekV32Config defaults
                kwargs.setdefault(k, v)
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
        """Raises ValueError("{source}: ...") naming the first field out of range, in the order checked below."""
        def bad(msg: str) -> None:
            raise ValueError(f"{source}: {msg}")

        self._check_types(bad)
        if self.num_nextn_predict_layers < 0:
            bad(f"num_nextn_predict_layers must be >= 0, got {self.num_nextn_predict_layers}")
        if self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            bad(f"hidden_act {self.hidden_act!r} is not supported (DeepSeek-V3 uses silu)")
        if self.n_routed_experts:
            self._check_routing(bad)
        if self.moe_layer_freq <= 0:
            bad(f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        self._check_rope_scaling(bad)
        if self.is_dsa:
            self._check_dsa(bad)
        mlp_types = self.raw.get("mlp_layer_types")
        if mlp_types is not None:
            want = ["sparse" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]
            if list(mlp_types) != want:
                bad(f"mlp_layer_types {list(mlp_types)} disagrees with first_k_dense_replace="
                    f"{self.first_k_dense_replace} / moe_layer_freq={self.moe_layer_freq} ({want}); only that "
                    "pattern is supported")
        if self.tie_word_embeddings:
            bad("tie_word_embeddings=true is not a DeepSeek-V3 layout (lm_head is separate)")

    def _check_types(self, bad: Callable[[str], None]) -> None:
        """Every size a positive (or non-negative) integer, every scale a positive number."""
        for k in _REQUIRED_INT:
            v = getattr(self, k)
            if not _is_int(v) or v <= 0:
                bad(f"{k} must be a positive integer, got {v!r}")
        for k in ("moe_intermediate_size", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                  "first_k_dense_replace", "moe_layer_freq", "num_nextn_predict_layers", "max_position_embeddings"):
            v = getattr(self, k)
            if not _is_int(v) or v < 0:
                bad(f"{k} must be a non-negative integer, got {v!r}")
        if self.n_routed_experts is not None and (not _is_int(self.n_routed_experts) or self.n_routed_experts < 0):
            bad(f"n_routed_experts must be null or a non-negative integer, got {self.n_routed_experts!r}")
        for k in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            v = getattr(self, k)
            if not _is_num(v) or v <= 0:
                bad(f"{k} must be a positive number, got {v!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            bad(f"q_lora_rank must be null or a positive integer, got {self.q_lora_rank!r}")

    def _check_routing(self, bad: Callable[[str], None]) -> None:
        """The MoE router's groups and top-k fit the routed experts (DeepSeek-V3's sigmoid scoring)."""
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

    def _check_rope_scaling(self, bad: Callable[[str], None]) -> None:
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

    def _check_dsa(self, bad: Callable[[str], None]) -> None:
        """DeepSeek-V3.2's indexer: positive sizes, a query latent to read, rope dims it can hold."""
        for k in _DSA_DEFAULTS:
            v = getattr(self, k)
            if not _is_int(v) or v <= 0:
                bad(f"{k} must be a positive integer, got {v!r}")
        if self.q_lora_rank is None:
            bad("a deepseek_v32 (sparse attention) model needs q_lora_rank: its indexer reads the query latent")
        if self.index_head_dim < self.qk_rope_head_dim or self.index_head_dim % 2:
            bad(f"index_head_dim={self.index_head_dim} must be even and at least qk_rope_head_dim="
                f"{self.qk_rope_head_dim} (the indexer ropes its first qk_rope_head_dim dims)")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
