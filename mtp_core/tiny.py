"""Writing tiny random DeepSeek-V3 / V3.2 checkpoints (for tests and for trying the engine offline)."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.model import DeepseekV3ForCausalLM

ARCHS = ("v3", "v32")   # DeepSeek-V3 (MLA), DeepSeek-V3.2 (MLA + sparse attention)


def tiny_config_dict(vocab_size: int, num_layers: int = 2, num_mtp: int = 1, q_lora_rank: Optional[int] = 32,
                     yarn: bool = False, n_group: int = 2, first_k_dense: int = 1, hidden_size: int = 64,
                     rope_interleave: bool = True, max_position_embeddings: int = 2048,
                     moe_layer_freq: int = 1, arch: str = "v3", index_topk: int = 8) -> dict:
    """config.json of a tiny model; arch "v32" adds DeepSeek-V3.2's sparse attention (an indexer of 4 heads of
    16 per layer, each query attending to its index_topk best keys: small, so that short prompts exercise the
    selection)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if arch == "v32" and not q_lora_rank:
        raise ValueError("a v32 (DeepSeek-V3.2) model needs q_lora_rank: its indexer reads the query latent")
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "moe_intermediate_size": hidden_size // 2,
        "num_hidden_layers": num_layers,
        "num_nextn_predict_layers": num_mtp,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": q_lora_rank,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "qk_nope_head_dim": 16,
        "topk_method": "noaux_tc",
        "n_group": n_group,
        "topk_group": 1 if n_group > 1 else 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": moe_layer_freq,
        "first_k_dense_replace": first_k_dense,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_interleave": rope_interleave,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }
    if arch == "v32":
        cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=index_topk,
                   index_head_dim=16, index_n_heads=4)
    if yarn:
        cfg["rope_scaling"] = _yarn_scaling(max_position_embeddings)
    return cfg


def _yarn_scaling(max_position_embeddings: int) -> dict:
    """YaRN rope scaling: 4x over an original context of a quarter of max_position_embeddings."""
    return {"type": "yarn", "rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": max_position_embeddings // 4,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0}


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Deterministic random init: normal(std) matrices, ones for norms, a small random expert bias."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("norm.weight") or name.endswith("layernorm.weight") or ".enorm." in name or ".hnorm." in name:
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * std)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def write_weights(out_dir: Path, state: dict[str, torch.Tensor], num_shards: int = 1) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json."""
    state = {k: v.contiguous() for k, v in state.items()}
    if num_shards <= 1:
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(state)
    weight_map = {}
    per = -(-len(names) // num_shards)
    for i in range(num_shards):
        part = names[i * per:(i + 1) * per]
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: state[k] for k in part}, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, num_layers: int = 2, num_mtp: int = 1,
                         q_lora_rank: Optional[int] = 32, yarn: bool = False, num_shards: int = 1,
                         n_group: int = 2, first_k_dense: int = 1, vocab_size: int = 512,
                         hidden_size: int = 64, rope_interleave: bool = True, overwrite: bool = False,
                         arch: str = "v3", index_topk: int = 8) -> Path:
    """Write a complete tiny checkpoint directory (config, weights, tokenizer, chat template)."""
    from mtp_core.tokenizer_build import build_tiny_tokenizer

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} exists and is not empty; choose a new directory")
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=out.parent if out.parent.exists() else None))
    try:
        tok = build_tiny_tokenizer(tmp, vocab_size=vocab_size)
        cfg_dict = tiny_config_dict(tok.get_vocab_size(), num_layers, num_mtp, q_lora_rank, yarn, n_group,
                                    first_k_dense, hidden_size, rope_interleave, arch=arch, index_topk=index_topk)
        bos, eos = tok.token_to_id("<｜begin▁of▁sentence｜>"), tok.token_to_id("<｜end▁of▁sentence｜>")
        cfg_dict["bos_token_id"], cfg_dict["eos_token_id"] = bos, eos
        model = DeepseekV3ForCausalLM(ModelConfig.from_dict(cfg_dict))
        init_weights(model, seed)
        write_weights(tmp, model.state_dict(), num_shards)
        (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
