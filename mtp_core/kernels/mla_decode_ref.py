"""Torch reference of the absorbed-MLA decode op over a paged latent cache.

Same contract as the native kernels (csrc/cpu/mla_decode_cpu.cpp, csrc/cuda/mla_decode_fp8.cu):

* the cache holds one latent row per token, ``[c_kv (R) | k_pe (P)]``, in pages of ``page_size``
  tokens; ``block_table[b, j]`` is the cache block holding positions ``j*page_size ..`` of row b;
* ``cache_seqlens[b]`` counts the cached tokens of row b *including* the Q new ones (already
  written); query i of row b sits at position ``cache_seqlens[b] - Q + i`` and sees keys
  ``0 ..`` that position (causal);
* ``score = (q_lat . c_kv + q_pe . k_pe) * softmax_scale``; ``out = softmax(score) @ c_kv`` (the
  latent; the caller applies the value up-projection); ``lse = logsumexp(score)`` in natural log;
* an fp8 cache is dequantized with one per-tensor ``kv_scale`` (real = fp8 * kv_scale);
* a row that sees no key (``cache_seqlens[b] < Q``, e.g. a padded batch slot) gets ``out = 0`` and
  ``lse = -inf``.

Worked example (page_size 2, Q = 2, cache_seqlens = [3]): the row holds positions 0, 1, 2; the
first new token is at position 1 and sees keys 0..1, the second at position 2 sees keys 0..2.
Position 2 lives in block ``block_table[0, 1]``, slot 0.
"""
from __future__ import annotations

from typing import Optional

import torch


def gather_latents(kv_cache: torch.Tensor, block_table: torch.Tensor,
                   kv_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """Every cached row addressable by ``block_table``, in position order, as fp32.

    kv_cache [num_blocks, page_size, D], block_table int32 [B, max_blocks]
    -> [B, max_blocks * page_size, D]. Unused table entries may hold anything: they are clamped to
    a valid block and masked by the caller.
    """
    num_blocks, page_size, dim = kv_cache.shape
    positions = torch.arange(block_table.shape[1] * page_size, device=kv_cache.device)   # [L]
    blocks = block_table.long().clamp(0, num_blocks - 1)                                  # [B, max_blocks]
    slots = blocks[:, positions // page_size] * page_size + positions % page_size          # [B, L]
    rows = kv_cache.reshape(num_blocks * page_size, dim)[slots].float()                   # [B, L, D]
    if kv_scale is not None:
        rows = rows * kv_scale.float().reshape(())
    return rows


def mla_decode_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, cache_seqlens: torch.Tensor, softmax_scale: float,
                   kv_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [B, Q, H, R], q_pe [B, Q, H, P], kv_cache [num_blocks, page_size, R + P],
    block_table int32 [B, max_blocks], cache_seqlens int32 [B]
    -> (out [B, Q, H, R] in q_lat's dtype, lse float32 [B, H, Q]). Computed in fp32."""
    num_q, latent_dim = q_lat.shape[1], q_lat.shape[3]
    keys = gather_latents(kv_cache, block_table, kv_scale)                         # [B, L, R + P]
    positions = torch.arange(keys.shape[1], device=keys.device)                    # [L]
    # Slots past cache_seqlens may hold garbage, even NaN (0 * NaN = NaN in probs @ keys): zero them.
    cached = positions[None, :] < cache_seqlens.long()[:, None]                    # [B, L]
    keys = keys.masked_fill(~cached[..., None], 0.0)
    query = torch.cat([q_lat, q_pe], dim=-1).float()                               # [B, Q, H, R + P]
    scores = torch.einsum("bqhd,bld->bhql", query, keys) * softmax_scale           # [B, H, Q, L]

    last = (cache_seqlens.long()[:, None] - num_q
            + torch.arange(num_q, device=keys.device)[None, :])                    # [B, Q]
    visible = positions[None, None, :] <= last[:, :, None]                         # [B, Q, L]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))

    lse = torch.logsumexp(scores, dim=-1)                                          # [B, H, Q]
    has_keys = visible.any(dim=-1)[:, None, :, None]                               # [B, 1, Q, 1]
    probs = torch.where(has_keys, torch.exp(scores - lse.unsqueeze(-1)), 0.0)      # [B, H, Q, L]
    out = torch.einsum("bhql,blr->bqhr", probs, keys[..., :latent_dim])            # [B, Q, H, R]
    return out.to(q_lat.dtype), lse
