"""Sharded layers. Each keeps the Hugging Face parameter names of the module it replaces, holds only
its rank's slice, and lists in `shards` which slice of the checkpoint tensor that is:

    column parallel   a linear's output rows [lo, hi)   (q_b_proj / q_proj / kv_b_proj by heads,
                      gate_proj / up_proj by intermediate columns, lm_head by vocabulary rows)
    row parallel      a linear's input columns [lo, hi)  (o_proj by heads, down_proj), partial
                      outputs summed by one all-reduce in the *parent* module

The all-reduce lives in the parent (attention, MLP, MoE) rather than in the linear, so a
row-parallel linear can still be swapped for a keep-quantized FP8/NVFP4 module at load time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtp_core.config import ModelConfig
from mtp_core.distributed.parallel_state import ParallelState, split_range
from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.layers import MLP
from mtp_core.model.mla import MLAttention
from mtp_core.model.rope import RotaryEmbedding


@dataclass(frozen=True)
class Shard:
    """This rank holds checkpoint_tensor.narrow(dim, lo, hi - lo); zero=True: it holds zeros instead
    (a row-parallel bias, added once: only rank 0 keeps the real values)."""
    dim: int
    lo: int
    hi: int
    zero: bool = False


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=bias)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [lo, hi) of the vocabulary; ids outside look up zeros; one all-reduce assembles."""

    def __init__(self, vocab_size: int, hidden_size: int, par: ParallelState) -> None:
        self.lo, self.hi = split_range(vocab_size, par.tp_size, par.tp_rank)
        super().__init__(self.hi - self.lo, hidden_size)
        self.par = par
        self.shards = {"weight": Shard(0, self.lo, self.hi)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., hidden], identical on every rank."""
        local = ids - self.lo
        outside = (local < 0) | (local >= self.hi - self.lo)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.par.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Linear):
    """Vocabulary rows [lo, hi) of lm_head; logits are gathered so every rank verifies on all of them."""

    def __init__(self, hidden_size: int, vocab_size: int, par: ParallelState) -> None:
        self.lo, self.hi = split_range(vocab_size, par.tp_size, par.tp_rank)
        super().__init__(hidden_size, self.hi - self.lo, bias=False)
        self.vocab_size, self.chunk = vocab_size, -(-vocab_size // par.tp_size)
        self.par = par
        self.shards = {"weight": Shard(0, self.lo, self.hi)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> logits [N, vocab] (full vocabulary on every rank)."""
        local = F.linear(x, self.weight)
        pad = self.chunk - local.shape[-1]                 # the last rank's slice may be shorter
        if pad:
            local = F.pad(local, (0, pad), value=float("-inf"))
        return self.par.all_gather_last(local)[..., : self.vocab_size]


class TensorParallelMLA(MLAttention):
    """MLA with this rank's heads [h_lo, h_hi): q_b_proj (or q_proj) and kv_b_proj keep those heads'
    rows, o_proj those heads' input columns; q_a_proj / kv_a_proj_with_mqa and the norms are
    replicated, so every rank computes (and caches) the same full latent c_kv | k_pe."""

    def __init__(self, cfg: ModelConfig, par: ParallelState) -> None:
        super().__init__(cfg)
        self.par = par
        h_lo, h_hi = split_range(cfg.num_attention_heads, par.tp_size, par.tp_rank)
        self.num_heads = h_hi - h_lo
        qk, kvb, dv = self.qk_head_dim, self.qk_nope_head_dim + self.v_head_dim, self.v_head_dim
        q_name = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
        q_in = cfg.hidden_size if cfg.q_lora_rank is None else cfg.q_lora_rank
        setattr(self, q_name, _linear(q_in, self.num_heads * qk, False))
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.num_heads * kvb, False)
        self.o_proj = _linear(self.num_heads * dv, cfg.hidden_size, cfg.attention_bias)
        self.shards = {f"{q_name}.weight": Shard(0, h_lo * qk, h_hi * qk),
                       "kv_b_proj.weight": Shard(0, h_lo * kvb, h_hi * kvb),
                       "o_proj.weight": Shard(1, h_lo * dv, h_hi * dv)}
        if cfg.attention_bias:
            self.shards["o_proj.bias"] = Shard(0, 0, cfg.hidden_size, zero=par.tp_rank != 0)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden] (summed over ranks)."""
        return self.par.all_reduce(super().forward(x, rope, cos, sin, meta, kv_cache))

    def forward_dense(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                      absorbed: bool = False) -> torch.Tensor:
        """x [B, S, hidden] -> [B, S, hidden] (summed over ranks)."""
        return self.par.all_reduce(super().forward_dense(x, rope, cos, sin, absorbed))


class TensorParallelMLP(MLP):
    """SwiGLU over intermediate columns [lo, hi) of `parts` pieces: gate/up column parallel, down row
    parallel. reduce=False leaves the partial sum for the caller's all-reduce (MoE experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, par: ParallelState, parts: int, index: int,
                 reduce: bool) -> None:
        lo, hi = split_range(intermediate_size, parts, index)
        super().__init__(hidden_size, hi - lo)
        self.par, self.reduce = par, reduce
        self.shards = {"gate_proj.weight": Shard(0, lo, hi), "up_proj.weight": Shard(0, lo, hi),
                       "down_proj.weight": Shard(1, lo, hi)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden]: the full output if reduce, else this rank's partial."""
        y = super().forward(x)
        return self.par.all_reduce(y) if self.reduce else y
