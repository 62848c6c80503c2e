"""Latent KV cache tensors: one [num_blocks, tokens_per_block, kv_lora_rank + qk_rope_head_dim] per layer
(main layers first, then one per MTP module), sized from free memory or an explicit token count."""
from __future__ import annotations

import logging
import os

import torch

from mtp_core.config import KvCacheConfig, ModelConfig

log = logging.getLogger("mtp.kv_cache")


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
