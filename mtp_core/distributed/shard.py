"""Turning a DeepSeek-V3 model built on the meta device into one rank's shard.

`shard_model` swaps modules in place (nothing is allocated: the model and the new modules live on
the meta device) and `collect_shards` lists, per parameter name, which slice of the checkpoint
tensor this rank must read. Parameter names never change, so the loader matches checkpoint names
directly; a name absent from the sharded model (another rank's expert) is simply not read.

    layer part                     tp_size > 1                      tp_size == 1
    embed_tokens / lm_head         vocabulary rows split            replicated
    self_attn (main and MTP)       heads split (TensorParallelMLA)  replicated
    dense mlp                      intermediate split               replicated
    MoE routed experts             ep_size groups x moe_tp_size intermediate slices
    MoE shared experts             intermediate split               replicated
    router, norms, MTP eh_proj     replicated                       replicated
"""
from __future__ import annotations

import torch
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.distributed.layers import (ParallelLMHead, Shard, TensorParallelMLA, TensorParallelMLP,
                                         VocabParallelEmbedding)
from mtp_core.distributed.moe import ExpertParallelMoE
from mtp_core.distributed.parallel_state import ParallelState
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.model.moe import MoE


def check_model_shardable(cfg: ModelConfig, par: ParallelState) -> None:
    """ValueError naming the config field that does not split evenly over these ranks."""
    def need(value: int, parts: int, what: str, flag: str) -> None:
        if parts > 1 and value % parts:
            raise ValueError(f"{what} = {value} is not divisible by {flag} = {parts}; choose a size that divides it")

    if cfg.is_dsa and par.world_size > 1:
        raise ValueError("DeepSeek-V3.2 sparse attention (model_type deepseek_v32) runs in one process for now; "
                         "drop --tp_size / --moe_ep_size (torchrun with one process)")
    need(cfg.num_attention_heads, par.tp_size, "num_attention_heads", "--tp_size")
    need(cfg.intermediate_size, par.tp_size, "intermediate_size", "--tp_size")
    if cfg.n_routed_experts:
        need(int(cfg.n_routed_experts), par.ep_size, "n_routed_experts", "--moe_ep_size")
        need(cfg.moe_intermediate_size, par.moe_tp_size, "moe_intermediate_size",
             "processes / --moe_ep_size (the expert tensor-parallel size)")
        need(cfg.moe_intermediate_size * cfg.n_shared_experts, par.tp_size,
             "moe_intermediate_size x n_shared_experts", "--tp_size")


def shard_model(model: DeepseekV3ForCausalLM, par: ParallelState) -> DeepseekV3ForCausalLM:
    """Replace model's modules by this rank's sharded ones, in place; returns the model.
    The model must be on the meta device (weights are loaded afterwards, slice by slice)."""
    if par.world_size == 1:
        return model
    if any(not p.is_meta for p in model.parameters()):
        raise ValueError("shard_model needs a model built on the meta device (build it under "
                         "`with torch.device('meta')`), then load the weights with load_model_sharded")
    cfg = model.config
    check_model_shardable(cfg, par)
    with torch.device("meta"):
        if par.tp_size > 1:
            model.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par)
            model.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, par)
        for layer in model.model.layers:
            if par.tp_size > 1:
                layer.self_attn = TensorParallelMLA(cfg, par)
            if isinstance(layer.mlp, MoE):
                layer.mlp = ExpertParallelMoE(cfg, par)
            elif par.tp_size > 1:
                layer.mlp = TensorParallelMLP(cfg.hidden_size, cfg.intermediate_size, par, par.tp_size, par.tp_rank,
                                              reduce=True)
    return model


def collect_shards(model: nn.Module) -> dict[str, Shard]:
    """{parameter or buffer name: Shard} for every tensor this rank holds only a slice of."""
    out: dict[str, Shard] = {}
    for prefix, module in model.named_modules():
        for suffix, shard in getattr(module, "shards", {}).items():
            out[f"{prefix}.{suffix}" if prefix else suffix] = shard
    return out
