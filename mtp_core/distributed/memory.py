"""How many bytes one rank holds for a DeepSeek-V3 config under a given parallel layout.

Mirrors `shard_model`: heads, the dense intermediate, the shared experts' intermediate and the
vocabulary split over tp_size; routed experts over ep_size, each expert's intermediate over
moe_tp_size = max(tp, ep) // ep; the router, norms, q_a_proj, kv_a_proj_with_mqa and the MTP
eh_proj are replicated, and so is the latent KV cache (every rank caches c_kv | k_pe of every
token for its heads: MLA's latent is shared by all heads).

Weight formats, as the loader keeps them (`keep_quantized`) and as `mtp quantize` writes them:
    bf16 / fp32   every tensor at 2 / 4 bytes
    fp8           quantizable linears 1 byte per weight + one float32 scale per 128x128 block of the
                  local slice; everything else bf16
    nvfp4         quantizable linears (attention excluded) 1/2 byte per weight + one e4m3 byte per
                  16 weights + two float32 scalars; everything else bf16
Never quantized: embed_tokens, lm_head, the router (float32 at run time), MTP eh_proj, norms.
Assumes slices fall on the scale grid (true for DeepSeek-V3 at tp 8); otherwise the loader
dequantizes that slice and it costs dense bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from mtp_core.config import ModelConfig
from mtp_core.distributed.parallel_state import check_parallel_sizes

_DENSE_BYTES = {"bf16": 2, "fp32": 4, "fp8": 2, "nvfp4": 2}


@dataclass
class RankMemory:
    """Bytes held by one rank, by part of the model (MTP layers included in attention / MoE)."""
    embedding: int
    lm_head: int
    attention: int
    dense_mlp: int
    routed_experts: int
    shared_experts: int
    router: int
    other: int                     # layer norms, final norm, MTP enorm / hnorm / eh_proj / shared_head.norm
    kv_cache_per_token: int        # latent cache bytes per cached token, all layers (main + MTP)

    @property
    def weights(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self) if f.name != "kv_cache_per_token")


def linear_bytes(n: int, k: int, fmt: str, quantized: bool) -> int:
    """Bytes of an [n, k] linear weight slice."""
    if not quantized or fmt in ("bf16", "fp32"):
        return n * k * _DENSE_BYTES[fmt]
    if fmt == "fp8":
        return n * k + math.ceil(n / 128) * math.ceil(k / 128) * 4
    return n * k // 2 + n * k // 16 + 8


def rank_memory(cfg: ModelConfig, tp_size: int, ep_size: int, weight_format: str = "bf16",
                kv_cache_bytes: int = 2) -> RankMemory:
    """Per-rank bytes for world = max(tp_size, ep_size) ranks (see ParallelState for the layout)."""
    if weight_format not in _DENSE_BYTES:
        raise ValueError(f"weight_format must be one of {', '.join(_DENSE_BYTES)}, got {weight_format!r}")
    world = max(tp_size, ep_size)
    check_parallel_sizes(world, tp_size, ep_size)
    moe_tp = world // ep_size
    fmt, dense = weight_format, _DENSE_BYTES[weight_format]
    h, tp = cfg.hidden_size, tp_size
    heads = cfg.num_attention_heads // tp
    attn_q = fmt != "nvfp4"                                   # NVFP4 checkpoints keep attention dense

    def lin(n: int, k: int, quantized: bool = True) -> int:
        return linear_bytes(n, k, fmt, quantized)

    attn = lin(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, attn_q) + cfg.kv_lora_rank * dense
    attn += lin(heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, attn_q)
    attn += lin(h, heads * cfg.v_head_dim, attn_q)
    if cfg.q_lora_rank is None:
        attn += lin(heads * cfg.qk_head_dim, h, attn_q)
    else:
        attn += lin(cfg.q_lora_rank, h, attn_q) + cfg.q_lora_rank * dense
        attn += lin(heads * cfg.qk_head_dim, cfg.q_lora_rank, attn_q)
    if cfg.attention_bias:
        attn += ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank + cfg.qk_rope_head_dim + h) * dense

    def mlp(inter: int) -> int:
        return 2 * lin(inter, h) + lin(h, inter)

    num_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    num_moe = sum(cfg.is_moe_layer(i) for i in range(num_layers))
    e = int(cfg.n_routed_experts or 0)
    vocab_rows = -(-cfg.vocab_size // tp)
    other = (2 * num_layers + 1) * h * dense
    other += cfg.num_nextn_predict_layers * (3 * h * dense + lin(h, 2 * h, False))
    return RankMemory(
        embedding=vocab_rows * h * dense,
        lm_head=vocab_rows * h * dense,
        attention=num_layers * attn,
        dense_mlp=(num_layers - num_moe) * mlp(cfg.intermediate_size // tp),
        routed_experts=num_moe * (e // ep_size) * mlp(cfg.moe_intermediate_size // moe_tp),
        shared_experts=num_moe * (mlp(cfg.moe_intermediate_size * cfg.n_shared_experts // tp)
                                  if cfg.n_shared_experts else 0),
        router=num_moe * (e * h + e) * 4,
        other=other,
        kv_cache_per_token=cfg.kv_cache_dim * num_layers * kv_cache_bytes,
    )


def deepseek_v3_671b_config() -> ModelConfig:
    """DeepSeek-V3 / R1 (671B) shapes, as in its config.json."""
    return ModelConfig.from_dict({
        "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "first_k_dense_replace": 3, "vocab_size": 129280, "num_nextn_predict_layers": 1,
        "routed_scaling_factor": 2.5, "max_position_embeddings": 163840,
    }, source="DeepSeek-V3 671B shapes")
