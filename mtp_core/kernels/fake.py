"""Fake (meta) implementations of the native ops, for torch.compile / FakeTensor tracing.

Registered once, right after mtp_core._C has defined the schemas (see native.py).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.cache
def register_fakes() -> None:
    @torch.library.register_fake("mtp_core::mla_decode")
    def _mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, cache_seqlens: torch.Tensor, softmax_scale: float,
                    kv_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_q, num_heads, latent_dim = q_lat.shape
        out = q_lat.new_empty((batch, num_q, num_heads, latent_dim))                    # [B, Q, H, R]
        lse = q_lat.new_empty((batch, num_heads, num_q), dtype=torch.float32)          # [B, H, Q]
        return out, lse

    @torch.library.register_fake("mtp_core::nvfp4_gemm")
    def _nvfp4_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    weight_scale_2: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))                               # [M, N]

    @torch.library.register_fake("mtp_core::rms_norm")
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("mtp_core::rope")
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("mtp_core::mat_gemm")
    def _mat_gemm(x, data, scale, gscale, bias, layout, fmt, n, k, scale_r0, gscale2, amx=False, dot=False) -> torch.Tensor:
        return x.new_empty((x.shape[0], n), dtype=torch.float32)                       # [T, n]

    @torch.library.register_fake("mtp_core::nvfp4_quantize")
    def _nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, cols = x.shape
        packed = x.new_empty((rows, cols // 2), dtype=torch.uint8)                      # [M, K/2]
        scale = x.new_empty((rows, cols // 16), dtype=torch.float8_e4m3fn)              # [M, K/16]
        return packed, scale
