"""Latent KV cache tensors: one [num_blocks, tokens_per_block, kv_lora_rank + qk_rope_head_dim] per layer
(main layers first, then one per MTP module), sized from free memory or an explicit token count.

In the model's dtype, or e4m3 (`kv_cache_config.dtype: fp8`, `--kv_cache_dtype fp8`, every device): half the
bytes of bf16, so twice the tokens in the same memory. One per-tensor scale, 1: the cached latents are
RMS-normed (|c_kv| about the norm weight) and the rope keys a projection of a normed input, both well inside
e4m3's range (2^-9 .. 448), where its relative precision (3 mantissa bits) is the same at any magnitude, so a
per-token or per-block scale would buy no precision and cost a scale read per key; the GPU's FP8 MLA kernel
takes the same per-tensor scale, so one cache format serves every device. Values are rounded to nearest even
and saturate at +-448 (torch's float8_e4m3fn conversion, also in the native forward)."""
from __future__ import annotations

import logging
import os

import torch

from mtp_core.config import KvCacheConfig, ModelConfig

log = logging.getLogger("mtp.kv_cache")


def copy_block(caches: list[torch.Tensor], src: int, dst: int) -> None:
    """Prefix cache copy-on-write: block src's slots, every layer, into block dst."""
    for c in caches:
        c[dst].copy_(c[src])


def write_slots(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor) -> None:
    """cache [blocks, page, D] (any dtype), slots [T] int64, kv [T, D]: kv rounded to the cache's dtype into its
    slots (an e4m3 cache through a byte view: torch's CPU index_copy has no float8 kernel)."""
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == torch.float8_e4m3fn:
        flat.view(torch.uint8).index_copy_(0, slots, kv.to(cache.dtype).view(torch.uint8))
    else:
        flat.index_copy_(0, slots, kv.to(cache.dtype))


def free_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info.get("MemFree", 0))
    except OSError:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def bytes_per_token(cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> int:
    return cfg.kv_cache_dim * num_layers * torch.empty((), dtype=dtype).element_size()


def plan_num_blocks(cfg: ModelConfig, kv_cfg: KvCacheConfig, num_layers: int, dtype: torch.dtype,
                    device: str, max_useful_tokens: int) -> int:
    """Blocks to allocate: max_tokens if given, else fraction x free memory, capped at what the
    engine can ever use (max_batch_size x max_seq_len) so a CPU run does not grab all RAM."""
    per_token = bytes_per_token(cfg, num_layers, dtype)
    if kv_cfg.max_tokens is not None:
        tokens = kv_cfg.max_tokens
    else:
        tokens = int(free_memory_bytes(device) * kv_cfg.free_gpu_memory_fraction) // per_token
        tokens = min(tokens, max_useful_tokens)
        return -(-tokens // kv_cfg.tokens_per_block)
    return max(tokens // kv_cfg.tokens_per_block, 0)


def allocate_caches(cfg: ModelConfig, num_layers: int, num_blocks: int, tokens_per_block: int,
                    dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    caches = [torch.zeros(num_blocks, tokens_per_block, cfg.kv_cache_dim, dtype=dtype, device=device)
              for _ in range(num_layers)]
    total = num_blocks * tokens_per_block
    log.info("KV cache: %d blocks x %d tokens = %d tokens fit (%d layers, %.1f MiB)", num_blocks,
             tokens_per_block, total, num_layers,
             bytes_per_token(cfg, num_layers, dtype) * total / 2**20)
    return caches
