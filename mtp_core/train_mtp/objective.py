"""Training objective for the MTP modules, with the attention context arranged as at inference.

At inference a draft step of depth d (d = 1..K) queries position p = V-2+d (V = valid length) with
input (token x_{p+1}, hidden g^{d-1}_{p-1}) — g^0 = the main hidden h — and attends to
  * the true entries (x_{q+1}, h_q) at positions q <= p-d+1, and
  * the chain entries of depths e = 2..d-1 at positions q = p-d+e, written from (x_{q+1}, g^{e-1}_{q-1}),
predicting x_{p+2}. Training reproduces exactly that with teacher forcing, for every p at once: the keys
of depth d are the concatenated latents of all input forms e = 1..d and a structured mask picks, for
query p, the e=1 keys at q <= p-d+1 and the e>=2 keys at q = p-d+e.

Vanilla runs depth d through module d (DeepSeek-V3's sequential modules, each one token further);
Eagle runs every depth through module 1 (trained on its own outputs, so that it holds up when reused).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.model.mtp import MTPModule


def depth_mask(num_pos: int, depth: int, device: torch.device) -> torch.Tensor:
    """[S, depth*S] bool: query p sees form-1 keys q <= p-depth+1 and form-e keys q == p-depth+e."""
    p = torch.arange(num_pos, device=device)[:, None]
    q = torch.arange(num_pos, device=device)[None, :]
    blocks = [q <= p - depth + 1] + [q == p - depth + e for e in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


def depth_attention(attn, q_nope: torch.Tensor, q_pe: torch.Tensor, kvs: list[torch.Tensor]) -> torch.Tensor:
    """What `attn.attend(q, cat(kvs), depth_mask(...))` computes, without materialising the masked keys:
    the form-1 keys are a causal block shifted by depth-1 (a [S, S] score matrix), and each form e >= 2
    contributes one key per query (q = p-depth+e), scored elementwise; one softmax over both.
    q_nope [B, S, H, dn], q_pe [B, S, H, dr], kvs[e-1] [B, S, r+dr] -> [B, S, H, dv]."""
    depth, (B, S, H, _) = len(kvs), q_nope.shape

    def split(kv: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if shift:   # key q = p - shift seen from query p (zeros where q < 0; masked below)
            kv = torch.cat([kv.new_zeros(B, shift, kv.shape[-1]), kv[:, :S - shift]], dim=1)
        ckv, k_pe = kv.split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        k_nope, v = attn.kv_b_proj(ckv).view(B, S, H, -1).split([attn.qk_nope_head_dim, attn.v_head_dim], dim=-1)
        return k_nope, k_pe, v

    k_nope, k_pe, v1 = split(kvs[0], 0)
    scores = torch.matmul(q_nope.transpose(1, 2), k_nope.permute(0, 2, 3, 1))         # [B, H, S, S]
    scores = scores + torch.matmul(q_pe.transpose(1, 2), k_pe.unsqueeze(1).transpose(-1, -2))
    p = torch.arange(S, device=q_nope.device)
    hidden = [p[None, :] > p[:, None] - depth + 1]                                      # form 1: q <= p-depth+1
    extra_v = []
    for e in range(2, depth + 1):
        shift = depth - e
        k_nope_e, k_pe_e, v_e = split(kvs[e - 1], shift)
        s_e = (q_nope * k_nope_e).sum(-1) + (q_pe * k_pe_e.unsqueeze(2)).sum(-1)        # [B, S, H]
        scores = torch.cat([scores, s_e.transpose(1, 2).unsqueeze(-1).to(scores.dtype)], dim=-1)
        hidden.append((p < shift)[:, None])
        extra_v.append(v_e)
    scores = (scores * attn.softmax_scale).masked_fill_(torch.cat(hidden, dim=1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)        # [B, H, S, S+depth-1]
    out = torch.matmul(probs[..., :S], v1.transpose(1, 2)).transpose(1, 2)             # [B, S, H, dv]
    for i, v_e in enumerate(extra_v):
        out = out + probs[..., S + i].transpose(1, 2).unsqueeze(-1) * v_e
    return out


def mtp_depth_forward(model: DeepseekV3ForCausalLM, module: MTPModule, emb: torch.Tensor,
                      hiddens: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """emb [B, S, H] (embeddings of x_{p+1}); hiddens[e-1] [B, S, H] the hidden of input form e.
    Returns g^d [B, S, H] for d = len(hiddens)."""
    xs = [module.eh_proj(torch.cat([module.enorm(emb), module.hnorm(h)], dim=-1)) for h in hiddens]
    normed = [module.input_layernorm(x) for x in xs]
    attn = module.self_attn
    q_nope, q_pe, kv_last = attn._project(normed[-1], model.rope, cos, sin)
    kvs = [attn.project_kv(n, model.rope, cos, sin) for n in normed[:-1]] + [kv_last]
    out = depth_attention(attn, q_nope, q_pe, kvs)                               # [B, S, Hd, dv]
    x = xs[-1] + attn.o_proj(out.reshape(*emb.shape[:2], -1))
    x = x + module.mlp(module.post_attention_layernorm(x))
    return module.shared_head.norm(x)


def shift_hidden(g: torch.Tensor) -> torch.Tensor:
    """g^{d-1}_{p-1} at position p (zeros at p = 0, which no loss position uses)."""
    return torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)


def mtp_losses(model: DeepseekV3ForCausalLM, ids: torch.Tensor, h: torch.Tensor, depth: int,
               eagle_depth: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float], list[float]]:
    """ids [B, S], h [B, S, H] (main hidden after the final norm).
    Returns (vanilla losses per depth, eagle losses for depths 2.., top-1 accuracies of both)."""
    S1 = ids.shape[1] - 1
    emb = model.model.embed_tokens(ids[:, 1:])                                 # x_{p+1}, p = 0..S-2
    pos = torch.arange(S1, device=ids.device)
    cos, sin = model.rope.cos_sin(pos)
    base = h[:, :-1]

    def loss_at(g: torch.Tensor, d: int) -> tuple[torch.Tensor, float]:
        logits = model.lm_head(g[:, d - 1:S1 - 1]).float()                   # positions p = d-1 .. S-3
        target = ids[:, d + 1:]                                              # x_{p+2}
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        acc = (logits.argmax(-1) == target).float().mean().item()
        return loss, acc

    v_losses, v_acc, e_losses, e_acc = [], [], [], []
    g1 = base    # replaced by the Vanilla chain's depth-1 output, which the Eagle chain then reuses
    for chain, n_depth, module_of in (("vanilla", depth, lambda d: d - 1), ("eagle", eagle_depth, lambda d: 0)):
        hiddens = [base]
        for d in range(1, n_depth + 1):
            if chain == "eagle" and d == 1:
                g = g1      # depth 1 is shared with the Vanilla chain (same module, same inputs)
            else:
                g = mtp_depth_forward(model, model.mtp_module(module_of(d)), emb, hiddens, cos, sin)
            if chain == "vanilla" and d == 1:
                g1 = g
            if not (chain == "eagle" and d == 1):
                loss, acc = loss_at(g, d)
                (v_losses if chain == "vanilla" else e_losses).append(loss)
                (v_acc if chain == "vanilla" else e_acc).append(acc)
            hiddens = hiddens + [shift_hidden(g)]
    return v_losses, e_losses, v_acc, e_acc
