"""Torch reference of mtp_core::decode_forward / decode_logits / mat_gemm (csrc/cpu/decode_cpu.cpp): the
oracle the native forward is tested against, in plain torch, float32 arithmetic, over the same typed
weights (mtp_core/native/native_weights.py: NativeWeights, whose Matrix.dense() gives each matrix's values),
read by their fields only (this module imports nothing above the kernels).

decode_forward_ref(weights, first_layer, num_layers, ids [T], mtp_hidden [T, H] | None, caches (one
[blocks, page, R+P] per layer, written in place), rope_cos / rope_sin [max_pos, P/2], positions [T] int64,
slot_mapping [T] int64, query_start [B+1] int32, block_tables [B, max_blocks] int32, seqlens [B] int32
(context length of each row after this call's writes), final_norm) -> hidden [T, H] float32.

Row b owns tokens query_start[b] .. query_start[b+1]-1 (consecutive positions, the last at seqlens[b]-1);
its i-th token sees keys 0 .. seqlens[b] - nq_b + i.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_core.kernels.dsa_ref import index_scores, select_topk
from mtp_core.kernels.fused_ref import rms_norm_ref, rope_ref
from mtp_core.kernels.mat import bf16_acts
from mtp_core.kv_cache.mla_cache import write_slots


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, w.float(), eps)                       # x is fp32 here: fp32 arithmetic throughout


def _lin(x: torch.Tensor, m, acts: dict) -> torch.Tensor:
    """x @ W^T + b; the matrices the AMX tiles or the bf16 dot products serve (acts: the dims' "amx" and
    "bf16_dot" switches) see bf16-rounded activations."""
    if bf16_acts(m, acts):
        x = x.bfloat16().float()
    return F.linear(x, m.dense(), m.bias)


def _mlp(x: torch.Tensor, f, acts: dict) -> torch.Tensor:
    return _lin(F.silu(_lin(x, f.gate, acts)) * _lin(x, f.up, acts), f.down, acts)


def _route(h: torch.Tensor, layer, d: dict, routed_scale: float):
    scores = _lin(h, layer.router, {}).sigmoid()
    choice = scores + layer.router_bias.float()
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
               seqlens: list[int], scale: float, dsa=None) -> torch.Tensor:
    """q [T, nh, R+P] -> [T, nh, R]. dsa: (indexer queries [T, heads, Di], head weights [T, heads], top-k): each
    query attends only to its top-k visible keys by the indexer's scores (dsa_ref.py, ties to the lower
    position)."""
    page, D = cache.shape[1], q.shape[-1]
    out = q.new_zeros(q.shape[0], q.shape[1], R)
    for b in range(len(seqlens)):
        nq, L = query_start[b + 1] - query_start[b], seqlens[b]
        pos = torch.arange(L)
        rows = cache[tables[b, pos // page].long(), pos % page].float()          # [L, R+P (+Di)]
        keys = rows[:, :D]
        for i in range(nq):
            t, vis = query_start[b] + i, L - nq + i + 1
            if vis <= 0:
                continue
            chosen = torch.arange(vis)
            if dsa is not None:
                iq, iw, topk = dsa
                s = index_scores(iq[t][None], iw[t][None], rows[:vis, D:])[0]         # [vis]
                chosen = select_topk(s, torch.ones(vis, dtype=torch.bool), topk).nonzero()[:, 0]
            p = torch.softmax((q[t] @ keys[chosen].T) * scale, dim=-1)          # [nh, chosen]
            out[t] = p @ keys[chosen, :R]
    return out


def decode_forward_ref(weights, first_layer: int, num_layers: int, ids, mtp_hidden, caches, rope_cos, rope_sin,
                       positions, slot_mapping, query_start, block_tables, seqlens, final_norm: bool) -> torch.Tensor:
    d, prm = weights.dims, weights.params
    acts = d   # the switches of the bf16-activation kernels (see _lin)
    eps, scale = prm["eps"], prm["softmax_scale"]
    H, R, P, nh, dn = d["hidden"], d["kv_lora"], d["rope"], d["heads"], d["nope"]
    qs, lens = query_start.tolist(), seqlens.tolist()
    cos, sin = rope_cos[positions], rope_sin[positions]
    inter = bool(d["interleave"])
    x = weights.embed[ids].float()
    T = x.shape[0]
    D = R + P
    for layer, cache in zip(weights.layers[first_layer:first_layer + num_layers], caches):
        if layer.eh_proj is not None:
            h = mtp_hidden.float()
            x = _lin(torch.cat([_norm(x, layer.enorm, eps), _norm(h, layer.hnorm, eps)], -1), layer.eh_proj, acts)
        h = _norm(x, layer.in_norm, eps)
        q = _lin(h, layer.q_in, acts)
        if d["q_lora"]:
            q_c = _norm(q, layer.q_a_norm, eps)
            q = _lin(q_c, layer.q_b, acts)
        kv_raw = _lin(h, layer.kv_a, acts)
        absorbed = not layer.uk
        q = q.reshape(T, nh, -1)
        q_pe = rope_ref(q[..., -P:], cos, sin, inter)
        if absorbed:
            q_lat = q[..., :R]
        else:
            q_lat = torch.stack([_lin(q[:, hh, :dn], layer.uk[hh], acts) for hh in range(nh)], 1)   # [T, nh, R]
        q = torch.cat([q_lat, q_pe], -1)
        kv = torch.cat([_norm(kv_raw[:, :R], layer.kv_norm, eps), rope_ref(kv_raw[:, R:], cos, sin, inter)], -1)
        dsa = None
        if layer.idx_k is not None:   # DeepSeek-V3.2: the index key joins the cache row; the indexer's queries
            Di, nih = d["index_dim"], d["index_heads"]
            half = lambda x: torch.cat([rope_ref(x[..., :P], cos, sin, False), x[..., P:]], -1)  # noqa: E731
            k = F.layer_norm(_lin(h, layer.idx_k, acts), (Di,), layer.idx_norm.float(), layer.idx_bias.float(),
                             prm["index_eps"])
            kv = torch.cat([kv, half(k)], -1)
            iq = half(_lin(q_c, layer.idx_q, acts).view(T, nih, Di))
            dsa = (iq, _lin(h, layer.idx_w, acts) * nih ** -0.5, d["index_topk"])
        write_slots(cache, slot_mapping, kv)
        o = _attention(q, cache, R, qs, block_tables, lens, scale, dsa)             # [T, nh, R]
        if not absorbed:
            o = torch.stack([_lin(o[:, hh], layer.uv[hh], acts) for hh in range(nh)], 1)   # [T, nh, dv]
        x = x + _lin(o.reshape(T, -1), layer.o, acts)
        h = _norm(x, layer.post_norm, eps)
        if layer.mlp is not None:
            x = x + _mlp(h, layer.mlp, acts)
        else:
            wts, idx = _route(h, layer, d, prm["routed_scale"])
            out = torch.zeros_like(h)
            for e in sorted(set(idx.flatten().tolist())):
                tok, slot = (idx == e).nonzero(as_tuple=True)
                out.index_add_(0, tok, _mlp(h[tok], layer.experts[e], acts) * wts[tok, slot, None])
            if layer.shared is not None:
                out = out + _mlp(h, layer.shared, acts)
            x = x + out
        if layer.head_norm is not None:
            x = _norm(x, layer.head_norm, eps)
    return _norm(x, weights.final_norm, eps) if final_norm else x


def decode_logits_ref(weights, hidden: torch.Tensor) -> torch.Tensor:
    return _lin(hidden.float(), weights.lm_head, weights.dims)


def mat_gemm_ref(x: torch.Tensor, m, amx: bool = False, dot: bool = False) -> torch.Tensor:
    return _lin(x.float(), m, {"amx": int(amx), "bf16_dot": int(dot)})
