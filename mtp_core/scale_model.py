"""Random checkpoints with the widths of real DeepSeek-V3-architecture models, written tensor by tensor.

The shipped model is 9M parameters; these are the shapes the engine must be fast on. `moonlight` has the
widths of Moonlight-16B-A3B (hidden 2048, 16 heads, no q_lora, kv_lora 512, 64 routed experts of 1408 with
top-6 and 2 shared, a dense first layer of 11264); `deepseek-v3` those of DeepSeek-V3/R1 (hidden 7168, 128
heads, q_lora 1536, 256 experts of 2048, top-8 in 8 groups). Depth is free (`num_layers`, plus MTP modules),
and `width_divisor` shrinks every width for tests while keeping the structure (no q_lora, groups, ratios).
`arch="v32"` makes it DeepSeek-V3.2 (`model_type: deepseek_v32`): every layer gains the sparse-attention
indexer (64 heads of 128, each query attending to its top 2048 keys) and the context reaches 160k tokens
through V3.2's YaRN (factor 40 over 4096).

Tensors are generated one at a time from a per-tensor seed and written in shards of at most `shard_bytes`,
so writing a 5 GB checkpoint holds one shard in memory. Hugging Face names, per-expert layout, bf16 by
default. Quantized twins come from `mtp quantize` (FP8 block, NVFP4) on the written directory.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from mtp_core.config import ModelConfig

SHAPES: dict[str, dict] = {
    "moonlight": dict(hidden_size=2048, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=11264,
                      moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                      n_group=1, topk_group=1, routed_scaling_factor=2.446, rope_theta=50000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=8192, vocab_size=32768),
    "deepseek-v3": dict(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
                        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                        n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096, vocab_size=129280),
}
ARCHS = ("v3", "v32")
# DeepSeek-V3.2 (config.json of deepseek-ai/DeepSeek-V3.2-Exp): the indexer and the long-context rope
V32_FIELDS = dict(index_n_heads=64, index_head_dim=128, index_topk=2048, max_position_embeddings=163840,
                  rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 40,
                                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                "mscale": 1.0, "mscale_all_dim": 1.0})
_WIDTHS = ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
           "intermediate_size", "moe_intermediate_size")


def scale_config_dict(shape: str, num_layers: int = 4, num_mtp: int = 1, width_divisor: int = 1,
                      vocab_size: int | None = None, n_routed_experts: int | None = None, arch: str = "v3") -> dict:
    """config.json of a `shape` model (SHAPES) at this depth; widths divided by width_divisor (tests); arch v32:
    with DeepSeek-V3.2's sparse attention (V32_FIELDS; the indexer's widths divided too)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; use one of: {', '.join(SHAPES)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; use one of: {', '.join(ARCHS)}")
    if arch == "v32" and SHAPES[shape]["q_lora_rank"] is None:
        raise ValueError(f"arch v32 needs a shape with q_lora_rank (the indexer reads the query latent); {shape} "
                         "has none: use --shape deepseek-v3")
    if num_layers < 1 or num_mtp < 0 or width_divisor < 1:
        raise ValueError("num_layers must be >= 1, num_mtp >= 0 and width_divisor >= 1")
    s = dict(SHAPES[shape])
    for k in _WIDTHS:
        if s[k] is not None:
            s[k] = max(8, s[k] // width_divisor)
    if vocab_size is not None:
        s["vocab_size"] = vocab_size
    if n_routed_experts is not None:
        s["n_routed_experts"] = n_routed_experts
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        **s, "num_key_value_heads": s["num_attention_heads"],
        "num_hidden_layers": num_layers, "num_nextn_predict_layers": num_mtp, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "hidden_act": "silu", "initializer_range": 0.02, "rope_interleave": True, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    if arch == "v32":
        cfg.update(V32_FIELDS, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32")
        cfg["rope_scaling"] = dict(V32_FIELDS["rope_scaling"])
        cfg["index_n_heads"] = max(1, V32_FIELDS["index_n_heads"] // width_divisor)
        cfg["index_head_dim"] = max(s["qk_rope_head_dim"], V32_FIELDS["index_head_dim"] // width_divisor)
    return cfg


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[torch.Size, bool]]:
    """Every checkpoint tensor of this config: name -> (shape, is_norm), from the model built on meta."""
    from mtp_core.model import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    out = {n: (p.shape, n.endswith("norm.weight")) for n, p in model.named_parameters()}
    out.update({n: (b.shape, False) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return out


def _random(name: str, shape: torch.Size, is_norm: bool, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic tensor per (seed, name): ones-ish norms, a small expert bias, N(0, 1/sqrt(fan_in))."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    g = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    if is_norm:
        return (1.0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
    if name.endswith("e_score_correction_bias"):
        return (0.05 * torch.randn(shape, generator=g)).float()
    std = 0.02 if "embed_tokens" in name else shape[-1] ** -0.5
    return (torch.randn(shape, generator=g) * std).to(dtype)


def _shards(tensors: dict[str, tuple[torch.Size, bool]], shard_bytes: int, elem: int) -> Iterator[list[str]]:
    part, size = [], 0
    for name, (shape, _) in tensors.items():
        n = shape.numel() * elem
        if part and size + n > shard_bytes:
            yield part
            part, size = [], 0
        part.append(name)
        size += n
    if part:
        yield part


def write_scale_checkpoint(out_dir: str | Path, shape: str = "moonlight", num_layers: int = 4, num_mtp: int = 1,
                           width_divisor: int = 1, vocab_size: int | None = None, seed: int = 0,
                           dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 512 << 20,
                           n_routed_experts: int | None = None, overrides: dict | None = None,
                           arch: str = "v3") -> Path:
    """Write config, tokenizer and sharded safetensors into out_dir (which must not exist or be empty);
    written into a temporary sibling and renamed at the end, so nothing half-written remains.
    overrides: config.json fields set after the shape's widths (e.g. a smaller moe_intermediate_size)."""
    from mtp_core.tokenizer_build import build_tiny_tokenizer

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; choose a new directory")
    cfg_dict = scale_config_dict(shape, num_layers, num_mtp, width_divisor, vocab_size, n_routed_experts, arch)
    unknown = sorted(set(overrides or {}) - set(cfg_dict))
    if unknown:
        raise ValueError(f"overrides: {unknown[0]!r} is not a config.json field of the {shape} shape")
    cfg_dict.update(overrides or {})
    cfg = ModelConfig.from_dict(cfg_dict)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".scale-", dir=out.parent))
    try:
        build_tiny_tokenizer(tmp, vocab_size=min(1024, cfg.vocab_size), model_max_length=cfg.max_position_embeddings)
        tensors = expected_tensors(cfg)
        elem = torch.tensor([], dtype=dtype).element_size()
        parts = list(_shards(tensors, shard_bytes, elem))
        weight_map, total = {}, 0
        for i, names in enumerate(parts):
            fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            shard = {n: _random(n, *tensors[n], seed, dtype) for n in names}
            total += sum(t.numel() * t.element_size() for t in shard.values())
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in names})
            del shard
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        cfg_dict["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                                "do_sample": False}, indent=2))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
