"""Torch reference of mtp_core::decode_forward and mtp_core::linear_bi (csrc/cpu/decode_cpu.cpp): the
oracle the native decode forward is tested against, in plain torch, float32 arithmetic.

decode_forward(ids [T], embed [V, H], mtp_hidden [T, H] | None, weights (20 per layer, WEIGHT_SLOTS,
an empty tensor = absent), dims (DIMS), fparams (FPARAMS), caches (one [blocks, page, R+P] per layer,
written in place), rope_cos / rope_sin [max_pos, P/2], positions [T] int64, slot_mapping [T] int64,
query_start [B+1] int32, block_tables [B, max_blocks] int32, seqlens [B] int32 (context length of each
row after this call's writes), final_norm [H] | None) -> hidden [T, H] in embed's dtype.

Projection weights come packed in 64-row panels (pack_weight: W [N, K] -> [ceil(N/64), K, 64], rows past N
zero; stacked experts [E, ceil(N/64), K, 64]); norms, biases and the router bias are plain vectors.

Row b owns tokens query_start[b] .. query_start[b+1]-1 (consecutive positions, the last at seqlens[b]-1);
its i-th token sees keys 0 .. seqlens[b] - nq_b + i. Weights are the decode-fused ones
(MLAttention.fuse_for_decode): W_a = [q_a_proj | kv_a_proj_with_mqa], W_q absorbed per head into
[latent | rope], W_o absorbed; MoE experts stacked as [E, 2I, H] (gate | up) and [E, H, I].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_core.kernels.fused_ref import rms_norm_ref, rope_ref

WEIGHT_SLOTS = ("in_norm", "w_a", "b_a", "q_a_norm", "w_q", "kv_norm", "w_o", "post_norm",
                "mlp_w13", "mlp_w2", "gate", "gate_bias", "exp_w13", "exp_w2", "sh_w13", "sh_w2",
                "enorm", "hnorm", "eh_proj", "head_norm")
DIMS = ("hidden", "q_lora", "kv_lora", "rope", "heads", "experts", "top_k", "groups", "topk_groups",
        "norm_topk", "interleave")
FPARAMS = ("eps", "softmax_scale", "routed_scale")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """W [..., N, K] -> [..., ceil(N/64), K, 64]: 64 output rows per panel, k-major inside it."""
    *lead, n, k = w.shape
    padded = torch.zeros(*lead, -(-n // 64) * 64, k, dtype=w.dtype)
    padded[..., :n, :] = w
    return padded.view(*lead, -1, 64, k).transpose(-1, -2).contiguous()


def unpack_weight(wp: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_weight: [..., P, K, 64] -> [..., n, K]."""
    *lead, p, k, _ = wp.shape
    return wp.transpose(-1, -2).reshape(*lead, p * 64, k)[..., :n, :]


def _has(t: torch.Tensor | None) -> bool:
    return t is not None and t.numel() > 0


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, w.float(), eps)                       # x is fp32 here: fp32 arithmetic throughout


def _mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    g, u = F.linear(x, w13.float()).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w2.float())


def _route(h: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, d: dict, routed_scale: float):
    scores = F.linear(h, gate.float()).sigmoid()
    choice = scores + bias.float()
    T, E = scores.shape
    if d["groups"] > 1:
        grouped = choice.view(T, d["groups"], -1)
        gs = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(d["topk_groups"], dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    idx = choice.topk(d["top_k"], dim=-1).indices
    w = scores.gather(1, idx)
    if d["norm_topk"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scale, idx


def _attention(q: torch.Tensor, cache: torch.Tensor, R: int, query_start: list[int], tables: torch.Tensor,
               seqlens: list[int], scale: float) -> torch.Tensor:
    """q [T, nh, R+P] -> [T, nh, R]."""
    page = cache.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], R)
    for b in range(len(seqlens)):
        nq, L = query_start[b + 1] - query_start[b], seqlens[b]
        pos = torch.arange(L)
        keys = cache[tables[b, pos // page].long(), pos % page].float()          # [L, R+P]
        for i in range(nq):
            t, vis = query_start[b] + i, L - nq + i + 1
            if vis <= 0:
                continue
            p = torch.softmax((q[t] @ keys[:vis].T) * scale, dim=-1)            # [nh, vis]
            out[t] = p @ keys[:vis, :R]
    return out


def decode_forward_ref(ids, embed, mtp_hidden, weights, dims, fparams, caches, rope_cos, rope_sin, positions,
                       slot_mapping, query_start, block_tables, seqlens, final_norm) -> torch.Tensor:
    d = dict(zip(DIMS, dims))
    eps, scale, routed_scale = fparams
    H, R, P, nh = d["hidden"], d["kv_lora"], d["rope"], d["heads"]
    qs, lens = query_start.tolist(), seqlens.tolist()
    cos, sin = rope_cos[positions], rope_sin[positions]
    x = embed[ids].float()
    T = x.shape[0]
    D = R + P
    for layer, cache in enumerate(caches):
        w = dict(zip(WEIGHT_SLOTS, weights[layer * len(WEIGHT_SLOTS):(layer + 1) * len(WEIGHT_SLOTS)]))
        n_of = {"w_a": (d["q_lora"] or nh * D) + D, "w_q": nh * D, "w_o": H, "mlp_w2": H, "exp_w2": H, "sh_w2": H,
                "eh_proj": H, "gate": d["experts"]}
        for a, b in (("mlp_w13", "mlp_w2"), ("exp_w13", "exp_w2"), ("sh_w13", "sh_w2")):
            if _has(w[b]):
                n_of[a] = 2 * w[b].shape[-2]
        w = {k: unpack_weight(v, n_of[k]) if k in n_of and _has(v) else v for k, v in w.items()}
        if _has(w["eh_proj"]):
            h = mtp_hidden.float()
            x = F.linear(torch.cat([_norm(x, w["enorm"], eps), _norm(h, w["hnorm"], eps)], -1), w["eh_proj"].float())
        h = _norm(x, w["in_norm"], eps)
        a = F.linear(h, w["w_a"].float(), w["b_a"].float() if _has(w["b_a"]) else None)
        kv_raw = a[:, -(R + P):]
        if d["q_lora"]:
            q = F.linear(_norm(a[:, :d["q_lora"]], w["q_a_norm"], eps), w["w_q"].float())
        else:
            q = a[:, :nh * (R + P)]
        q = q.reshape(T, nh, R + P)
        q = torch.cat([q[..., :R], rope_ref(q[..., R:], cos, sin, bool(d["interleave"]))], -1)
        kv = torch.cat([_norm(kv_raw[:, :R], w["kv_norm"], eps), rope_ref(kv_raw[:, R:], cos, sin, bool(d["interleave"]))], -1)
        cache.view(-1, R + P).index_copy_(0, slot_mapping, kv.to(cache.dtype))
        o = _attention(q, cache, R, qs, block_tables, lens, scale)
        x = x + F.linear(o.reshape(T, nh * R), w["w_o"].float())
        h = _norm(x, w["post_norm"], eps)
        if _has(w["mlp_w13"]):
            x = x + _mlp(h, w["mlp_w13"], w["mlp_w2"])
        else:
            wts, idx = _route(h, w["gate"], w["gate_bias"], d, routed_scale)
            out = torch.zeros_like(h)
            for e in sorted(set(idx.flatten().tolist())):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, _mlp(h[tok], w["exp_w13"][e], w["exp_w2"][e]) * wts[tok, slot, None])
            if _has(w["sh_w13"]):
                out = out + _mlp(h, w["sh_w13"], w["sh_w2"])
            x = x + out
        if _has(w["head_norm"]):
            x = _norm(x, w["head_norm"], eps)
    if final_norm is not None:
        x = _norm(x, final_norm, eps)
    return x.to(embed.dtype)


def linear_bi_ref(x: torch.Tensor, w_packed: torch.Tensor, n: int) -> torch.Tensor:
    return F.linear(x.float(), unpack_weight(w_packed, n).float())
