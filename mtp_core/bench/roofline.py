"""Memory-bandwidth roofline of one decoding step at batch 1.

A decode step at batch 1 is memory bound: its floor is the bytes it must read divided by the memory
bandwidth. Bytes per step = main model (dense weights + the routed experts the step's tokens activate +
lm_head + the KV cache) + the MTP stage (K module passes, each reading its weights, the experts its
tokens activate, the shared lm_head and its KV cache). The embedding table is not counted (a step
gathers a handful of rows). With T tokens routed independently to top_k of n experts, the expected number
of distinct experts is n * (1 - (1 - top_k/n) ** T) (exactly top_k for T = 1).
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.")


def measure_bandwidth(mib: int = 256, repeats: int = 5, num_threads: Optional[int] = None) -> float:
    """Bytes per second of a large tensor copy (bytes read + bytes written), best of `repeats`."""
    if mib < 1 or repeats < 1:
        raise ValueError("bandwidth measurement needs mib >= 1 and repeats >= 1")
    old = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)                                    # touch the pages once
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return 2 * src.numel() * src.element_size() / best
    finally:
        torch.set_num_threads(old)


@dataclass
class WeightBytes:
    """Bytes of the loaded weights, split the way a decode step reads them."""
    main_dense: int = 0                        # main layers without routed experts, plus the final norm
    head: int = 0                              # lm_head (shared by the MTP modules)
    main_expert: dict[int, float] = field(default_factory=dict)   # MoE layer -> bytes of one routed expert
    mtp_dense: dict[int, int] = field(default_factory=dict)       # module k -> bytes without routed experts
    mtp_expert: dict[int, float] = field(default_factory=dict)    # module k -> bytes of one routed expert
    n_routed: int = 0
    top_k: int = 0


def weight_bytes(model: torch.nn.Module) -> WeightBytes:
    cfg = model.config
    L = cfg.num_hidden_layers
    wb = WeightBytes(n_routed=int(cfg.n_routed_experts or 0), top_k=int(cfg.num_experts_per_tok or 0))
    experts: dict[int, dict[int, int]] = {}
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in tensors:
        size = t.numel() * t.element_size()
        if name == "lm_head.weight" or name.startswith("lm_head."):
            wb.head += size
        elif name.startswith("model.norm."):
            wb.main_dense += size
        elif m := _LAYER.match(name):
            layer, rest = int(m.group(1)), m.group(2)
            if e := _EXPERT.match(rest):
                per = experts.setdefault(layer, {})
                per[int(e.group(1))] = per.get(int(e.group(1)), 0) + size
            elif layer < L:
                wb.main_dense += size
            else:
                wb.mtp_dense[layer - L] = wb.mtp_dense.get(layer - L, 0) + size
    for layer, per in experts.items():
        mean = sum(per.values()) / len(per)
        (wb.main_expert if layer < L else wb.mtp_expert)[layer if layer < L else layer - L] = mean
    return wb


def distinct_experts(n_routed: int, top_k: int, tokens: float) -> float:
    if n_routed <= 0 or top_k <= 0 or tokens <= 0:
        return 0.0
    return n_routed * (1.0 - (1.0 - top_k / n_routed) ** tokens)


def step_bytes(model: torch.nn.Module, wb: WeightBytes, K: int, mode: str, al: float, context_len: float) -> dict:
    """Bytes one batch-1 decoding step reads. mode: none | eagle | vanilla; al: tokens accepted per step."""
    cfg = model.config
    kv_elt = next(model.parameters()).element_size()
    kv_per_layer = context_len * cfg.kv_cache_dim * kv_elt
    if cfg.is_dsa:   # every index key, then the latents of the index_topk chosen keys only
        kv_per_layer = (context_len * cfg.index_head_dim + min(context_len, cfg.index_topk) * cfg.latent_dim) * kv_elt
    ex = lambda T: distinct_experts(wb.n_routed, wb.top_k, T)  # noqa: E731
    main = wb.main_dense + wb.head + sum(e * ex(K + 1) for e in wb.main_expert.values())
    main_kv = cfg.num_hidden_layers * kv_per_layer
    mtp = mtp_kv = 0.0
    for j in range(K if mode != "none" else 0):
        k = 0 if mode == "eagle" else j
        tokens = (al if j == 0 else 1.0) if mode == "eagle" else float(K + j)
        mtp += wb.mtp_dense.get(k, 0) + wb.head + wb.mtp_expert.get(k, 0.0) * ex(tokens)
        mtp_kv += kv_per_layer
    total = main + main_kv + mtp + mtp_kv
    return {"main_weights": main, "main_kv": main_kv, "mtp_weights": mtp, "mtp_kv": mtp_kv, "total": total}


def roofline(model: torch.nn.Module, K: int, mode: str, al: float, context_len: float, bandwidth: float,
             measured_step_s: Optional[float]) -> dict:
    """Floor step time next to the measured one (measured = decode-phase AL / tokens per second)."""
    b = step_bytes(model, weight_bytes(model), K, mode, al, context_len)
    floor = b["total"] / bandwidth
    return {
        "bandwidth_gb_s": bandwidth / 1e9, "step_bytes": b["total"], "bytes": b, "context_len": context_len,
        "floor_step_ms": floor * 1e3,
        "measured_step_ms": None if measured_step_s is None else measured_step_s * 1e3,
        "floor_over_measured": None if not measured_step_s else floor / measured_step_s,
        "floor_tokens_per_s": al / floor if floor > 0 else None,
    }
