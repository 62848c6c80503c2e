"""Multi-head Latent Attention (DeepSeek-V2/V3), Hugging Face parameter names.

Per token only the latent `c_kv` (kv_lora_rank) and the shared rope key `k_pe` (qk_rope_head_dim) are
cached. Two equivalent ways to attend over them:

  naive     expand the cached latents with kv_b_proj into per-head keys/values, then plain attention;
            cheap when many queries share the keys (prefill).
  absorbed  fold kv_b_proj's key half into the query (q_nope @ W_UK -> latent space) and its value half
            into the output, so scores and the weighted sum run directly on the latent cache; cheap
            when a few queries face a long cache (decode, verification of 1+K tokens).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtp_core import kernels
from mtp_core.config import ModelConfig
from mtp_core.kernels.dsa_ref import index_scores, select_topk
from mtp_core.kv_cache.mla_cache import write_slots
from mtp_core.model.attention_metadata import AttentionMetadata
from mtp_core.model.dsa import Indexer
from mtp_core.model.layers import RMSNorm
from mtp_core.model.rope import RotaryEmbedding


def kv_scale_of(kv_cache: torch.Tensor) -> torch.Tensor | None:
    """The per-tensor dequantization scale of an e4m3 latent cache (1: see kv_cache/mla_cache.py), else None."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        return None
    return torch.ones(1, dtype=torch.float32, device=kv_cache.device)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.qk_nope_head_dim = cfg.qk_nope_head_dim
        self.qk_rope_head_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_lora_rank = cfg.q_lora_rank
        self.softmax_scale = cfg.softmax_scale
        h, bias = cfg.hidden_size, cfg.attention_bias
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(self.num_heads * cfg.v_head_dim, h, bias=bias)
        # DeepSeek-V3.2: the lightning indexer choosing the keys each query attends to (model/dsa.py)
        self.indexer = Indexer(cfg) if cfg.is_dsa else None
        self.decode_weights: tuple | None = None   # set by fuse_for_decode()

    # ---- serving-time weight fusion --------------------------------------------------------
    @torch.no_grad()
    def fuse_for_decode(self) -> bool:
        """Pre-absorbs kv_b_proj into the query and output projections for the decode path:

            W_qa  = [q_a_proj | kv_a_proj_with_mqa]           one matmul for both down-projections
            W_q   = per head [W_UK^T @ W_q_nope | W_q_rope]    q_c -> (q_latent, q_rope) directly
            W_o   = per head o_proj[:, head] @ W_UV            latent output -> hidden directly

        so a decode layer runs 3 matmuls instead of 4 plus two per-head einsums. Composed in float64 and
        cast once. Skipped (returns False) when a projection is not a plain nn.Linear (quantized weights)
        or when the absorbed weights would be more than twice the bytes they replace (large models such
        as DeepSeek-V3, where absorbing at run time is cheaper)."""
        linears = [self.kv_a_proj_with_mqa, self.kv_b_proj, self.o_proj,
                   *([self.q_a_proj, self.q_b_proj] if self.q_lora_rank is not None else [self.q_proj])]
        if any(type(m) is not nn.Linear for m in linears) or self.o_proj.bias is not None or self.indexer is not None:
            return False   # (sparse attention reads the latents of its own selection: no fused dense decode)
        nh, dn, dr, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q_w = self.q_proj.weight if self.q_lora_rank is None else self.q_b_proj.weight   # [nh*(dn+dr), q_in]
        absorbed = nh * (r + dr) * q_w.shape[1] + self.o_proj.weight.shape[0] * nh * r
        replaced = q_w.numel() + self.o_proj.weight.numel() + self.kv_b_proj.weight.numel()
        if absorbed > 2 * replaced:
            return False
        dtype = q_w.dtype
        w_uk, w_uv = (w.double() for w in self._w_kv_b())                    # [nh, dn, r], [nh, dv, r]
        q = q_w.double().view(nh, dn + dr, -1)
        w_q = torch.cat([torch.einsum("hdr,hdi->hri", w_uk, q[:, :dn]), q[:, dn:]], dim=1)   # [nh, r+dr, q_in]
        w_o = torch.einsum("ohv,hvr->ohr", self.o_proj.weight.double().view(-1, nh, self.v_head_dim), w_uv)
        if self.q_lora_rank is not None:
            w_a = torch.cat([self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight])
            b_a = (torch.cat([self.q_a_proj.bias, self.kv_a_proj_with_mqa.bias])
                   if self.kv_a_proj_with_mqa.bias is not None else None)
        else:   # no query down-projection: the absorbed query weight reads x itself
            w_a = torch.cat([w_q.reshape(-1, w_q.shape[-1]).to(dtype), self.kv_a_proj_with_mqa.weight])
            b_a = self.kv_a_proj_with_mqa.bias
            if b_a is not None:
                b_a = torch.cat([b_a.new_zeros(w_q.shape[0] * w_q.shape[1]), b_a])
        self.decode_weights = (w_a.contiguous(), b_a, w_q.reshape(-1, w_q.shape[-1]).to(dtype).contiguous(),
                               w_o.reshape(w_o.shape[0], -1).to(dtype).contiguous())
        return True

    # ---- projections ---------------------------------------------------------------------
    def _project(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                 q_latent: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., T, hidden] -> q_nope [..., T, H, dn], q_pe [..., T, H, dr] (roped), kv [..., T, r+dr];
        q_latent (a list): receives q_a_layernorm(q_a_proj(x)) [..., T, q_lora_rank], the indexer's input."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_c = self.q_a_layernorm(self.q_a_proj(x))
            if q_latent is not None:
                q_latent.append(q_c)
            q = self.q_b_proj(q_c)
        q = q.view(*x.shape[:-1], self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = rope.apply(q_pe, cos, sin, has_heads=True)
        return q_nope, q_pe, self.project_kv(x, rope, cos, sin)

    def project_kv(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
                   ) -> torch.Tensor:
        """x [..., T, hidden] -> the cached latent [..., T, r+dr] (normed c_kv | roped k_pe)."""
        ckv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(ckv), rope.apply(k_pe, cos, sin, has_heads=False)], dim=-1)

    def cache_row(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor
                  ) -> torch.Tensor:
        """x [..., T, hidden] -> what the paged cache holds per token [..., T, r+dr (+ Di)]: the latent, then
        (DSA) the indexer's key."""
        kv = self.project_kv(x, rope, cos, sin)
        if self.indexer is None:
            return kv
        return torch.cat([kv, self.indexer.keys(x, rope, cos, sin).to(kv.dtype)], dim=-1)

    def _w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj split per head: W_UK [H, dn, r], W_UV [H, dv, r]."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:]

    # ---- attention over latents ----------------------------------------------------------
    def attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor,
               absorbed: bool) -> torch.Tensor:
        """q_nope [B, Q, H, dn], q_pe [B, Q, H, dr], kv [B, L, r+dr], mask [B, Q, L] bool (True = visible)
        -> [B, Q, H, dv]."""
        ckv, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        w_uk, w_uv = self._w_kv_b()
        hidden = ~mask.unsqueeze(1)                                           # [B, 1, Q, L]
        if absorbed:
            q_lat = torch.einsum("bqhd,hdr->bhqr", q_nope, w_uk)              # [B, H, Q, r]
            scores = torch.matmul(q_lat, ckv.unsqueeze(1).transpose(-1, -2))
            scores = scores + torch.matmul(q_pe.transpose(1, 2), k_pe.unsqueeze(1).transpose(-1, -2))
            scores = (scores * self.softmax_scale).masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
            o_lat = torch.matmul(probs, ckv.unsqueeze(1))                    # [B, H, Q, r]
            return torch.einsum("bhqr,hvr->bqhv", o_lat, w_uv)
        kvb = self.kv_b_proj(ckv).view(*ckv.shape[:2], self.num_heads, -1)  # [B, L, H, dn+dv]
        k_nope, v = kvb.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        scores = torch.matmul(q_nope.transpose(1, 2), k_nope.permute(0, 2, 3, 1))   # [B, H, Q, L]
        scores = scores + torch.matmul(q_pe.transpose(1, 2), k_pe.unsqueeze(1).transpose(-1, -2))
        scores = (scores * self.softmax_scale).masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2)        # [B, Q, H, dv]

    # ---- entry points --------------------------------------------------------------------
    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Serving path. x [T, hidden]; kv_cache [num_blocks, tokens_per_block, r+dr (+ Di: DSA)] (written in
        place)."""
        if self.indexer is not None:
            return self._forward_sparse(x, rope, cos, sin, meta, kv_cache)
        if self.decode_weights is not None and meta.use_absorbed and meta.uniform_q:
            return self._forward_decode_fused(x, rope, cos, sin, meta, kv_cache)
        q_nope, q_pe, kv = self._project(x, rope, cos, sin)
        flat_cache = kv_cache.view(-1, kv_cache.shape[-1])
        write_slots(kv_cache, meta.slot_mapping, kv)
        if meta.use_absorbed and meta.uniform_q:
            # decode / verification rows (Q tokens each, row after row): the paged MLA decode op (native when
            # built) reads the cache in place
            B = meta.num_rows
            w_uk, w_uv = self._w_kv_b()
            q_lat = torch.einsum("tnd,ndr->tnr", q_nope, w_uk)                  # [T, H, r]
            o_lat, _ = kernels.mla_decode(q_lat.reshape(B, -1, *q_lat.shape[1:]).contiguous(),
                                          q_pe.reshape(B, -1, *q_pe.shape[1:]).contiguous(), kv_cache,
                                          meta.block_tables_i32, meta.seqlens_i32, self.softmax_scale,
                                          kv_scale_of(kv_cache))
            out = torch.einsum("tnr,nvr->tnv", o_lat.to(x.dtype).flatten(0, 1), w_uv)   # [T, H, dv]
        else:
            pad_q = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])])[meta.q_index]  # noqa: E731
            keys = flat_cache[meta.kv_slots].to(x.dtype)                      # [B, L, r+dr]
            out = self.attend(pad_q(q_nope), pad_q(q_pe), keys, meta.visible(), meta.use_absorbed)  # [B, Q, H, dv]
            out = out[meta.q_valid]                                           # [T, H, dv]
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _forward_sparse(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                        meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3.2 over the paged cache, any rows (prefill chunks, decode / verification / draft rows):
        each token's cache row is [c_kv | k_pe | index key]; each query scores its row's visible keys with the
        indexer and attends to the index_topk best (model/dsa.py). The torch reference of the native forward."""
        q_lat: list[torch.Tensor] = []
        q_nope, q_pe, kv = self._project(x, rope, cos, sin, q_lat)
        idx = self.indexer
        write_slots(kv_cache, meta.slot_mapping, torch.cat([kv, idx.keys(x, rope, cos, sin).to(kv.dtype)], dim=-1))
        # (the same row as cache_row(x): the projections above are reused, not recomputed)
        pad_q = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])])[meta.q_index]  # noqa: E731
        rows = kv_cache.view(-1, kv_cache.shape[-1])[meta.kv_slots].to(x.dtype)   # [B, L, r+dr+Di]
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        visible = meta.visible()                                               # [B, Q, L]
        scores = index_scores(pad_q(idx.queries(q_lat[0], rope, cos, sin)), pad_q(idx.head_weights(x)),
                              rows[..., latent:])                              # [B, Q, L]
        chosen = select_topk(scores, visible, idx.topk)
        out = self.attend(pad_q(q_nope), pad_q(q_pe), rows[..., :latent], chosen, meta.use_absorbed)
        out = out[meta.q_valid]                                                # [T, H, dv]
        return self.o_proj(out.reshape(out.shape[0], -1))

    def _forward_decode_fused(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                              meta: AttentionMetadata, kv_cache: torch.Tensor) -> torch.Tensor:
        """Decode / verification rows (every row feeds Q tokens, laid out row after row) with the weights
        of fuse_for_decode(): no padding, no per-head einsum."""
        w_a, b_a, w_q, w_o = self.decode_weights
        nh, r, dr = self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        a = F.linear(x, w_a, b_a)
        if self.q_lora_rank is None:
            q, kv = a.split([nh * (r + dr), r + dr], dim=-1)
        else:
            q_c, kv = a.split([self.q_lora_rank, r + dr], dim=-1)
            q = F.linear(self.q_a_layernorm(q_c), w_q)
        q_lat, q_pe = q.view(-1, nh, r + dr).split([r, dr], dim=-1)
        ckv, k_pe = kv.split([r, dr], dim=-1)
        kv = torch.cat([self.kv_a_layernorm(ckv), rope.apply(k_pe, cos, sin, has_heads=False)], dim=-1)
        write_slots(kv_cache, meta.slot_mapping, kv)
        B = meta.num_rows
        q_pe = rope.apply(q_pe, cos, sin, has_heads=True)
        o_lat, _ = kernels.mla_decode(q_lat.reshape(B, -1, nh, r), q_pe.reshape(B, -1, nh, dr), kv_cache,
                                      meta.block_tables_i32, meta.seqlens_i32, self.softmax_scale,
                                      kv_scale_of(kv_cache))
        return F.linear(o_lat.to(x.dtype).reshape(x.shape[0], nh * r), w_o)

    def forward_dense(self, x: torch.Tensor, rope: RotaryEmbedding, cos: torch.Tensor, sin: torch.Tensor,
                      absorbed: bool = False) -> torch.Tensor:
        """Training / reference path without a cache: x [B, S, hidden], causal within each row."""
        q_lat: list[torch.Tensor] = []
        q_nope, q_pe, kv = self._project(x, rope, cos, sin, q_lat)
        if self.indexer is not None:   # DSA: causal, then each query's index_topk best keys
            S, idx = x.shape[1], self.indexer
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril().expand(x.shape[0], S, S)
            scores = index_scores(idx.queries(q_lat[0], rope, cos, sin), idx.head_weights(x),
                                  idx.keys(x, rope, cos, sin))
            out = self.attend(q_nope, q_pe, kv, select_topk(scores, causal, idx.topk), absorbed)
        elif absorbed:
            S = x.shape[1]
            mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril().expand(x.shape[0], S, S)
            out = self.attend(q_nope, q_pe, kv, mask, True)
        else:
            out = self._dense_sdpa(q_nope, q_pe, kv)
        return self.o_proj(out.reshape(*x.shape[:2], -1))

    def _dense_sdpa(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Naive causal attention through SDPA (fast path for training)."""
        ckv, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kvb = self.kv_b_proj(ckv).view(*ckv.shape[:2], self.num_heads, -1)
        k_nope, v = kvb.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)                # [B, H, S, dq]
        k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.num_heads, -1)], dim=-1).transpose(1, 2)
        dv = v.shape[-1]
        if dv < q.shape[-1]:
            # zero columns make v as wide as q/k: the output's first dv columns are unchanged, and PyTorch's
            # CPU flash kernel (causal blocks skipped, no S x S matrix) only takes equal head dims
            v = F.pad(v, (0, q.shape[-1] - dv))
        out = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, scale=self.softmax_scale)
        return out[..., :dv].transpose(1, 2)                                  # [B, S, H, dv]
