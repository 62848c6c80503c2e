"""Multi-head Latent Attention: a hand-written reference, absorbed == naive, paged == dense."""
from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

from mtp_core.config import ModelConfig  # noqa: E402
from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM  # noqa: E402
from mtp_core.model.mla import MLAttention  # noqa: E402
from mtp_core.model.rope import RotaryEmbedding  # noqa: E402
from mtp_core.tiny import init_weights, tiny_config_dict  # noqa: E402

TOL = 1e-5


def make_cfg(**kw) -> ModelConfig:
    return ModelConfig.from_dict(tiny_config_dict(96, **kw))


def make_attn(cfg: ModelConfig, seed: int = 0) -> MLAttention:
    attn = MLAttention(cfg)
    init_weights(attn, seed, std=0.1)
    return attn.eval()


# ---- an independent reference ---------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_ref(x: torch.Tensor, pos: torch.Tensor, base: float, interleave: bool) -> torch.Tensor:
    """x [S, ..., d] rotated as complex pairs: (2i, 2i+1) interleaved, else (i, i + d/2). Same layout out."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)              # [d/2]
    ang = pos.double()[:, None] * theta                                              # [S, d/2]
    ang = ang.view(ang.shape[0], *([1] * (x.dim() - 2)), -1)
    a, b = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., : d // 2], x[..., d // 2:])
    z = torch.complex(a.double(), b.double()) * torch.polar(torch.ones_like(ang), ang)
    out = torch.empty_like(x, dtype=torch.float64)
    if interleave:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2:] = z.real, z.imag
    return out.to(x.dtype)


def mla_reference(attn: MLAttention, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """x [S, hidden] -> [S, hidden], causal, positions 0..S-1, head by head, no latent tricks."""
    S, H = x.shape[0], cfg.num_attention_heads
    dn, dr, dv, r, eps = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.rms_norm_eps
    if cfg.q_lora_rank is None:
        q = x @ attn.q_proj.weight.T
    else:
        q = _rms(x @ attn.q_a_proj.weight.T, attn.q_a_layernorm.weight, eps) @ attn.q_b_proj.weight.T
    q = q.view(S, H, dn + dr)
    kva = x @ attn.kv_a_proj_with_mqa.weight.T
    c = _rms(kva[:, :r], attn.kv_a_layernorm.weight, eps)                            # [S, r]
    pos = torch.arange(S)
    q_pe = _rope_ref(q[..., dn:], pos, cfg.rope_theta, cfg.rope_interleave)         # [S, H, dr]
    k_pe = _rope_ref(kva[:, r:], pos, cfg.rope_theta, cfg.rope_interleave)          # [S, dr]
    kvb = (c @ attn.kv_b_proj.weight.T).view(S, H, dn + dv)
    causal = torch.full((S, S), float("-inf")).triu(1)
    heads = []
    for h in range(H):
        s = q[:, h, :dn] @ kvb[:, h, :dn].T + q_pe[:, h] @ k_pe.T
        p = torch.softmax(s * (dn + dr) ** -0.5 + causal, dim=-1)
        heads.append(p @ kvb[:, h, dn:])
    return torch.cat(heads, dim=-1) @ attn.o_proj.weight.T


@pytest.mark.parametrize("q_lora_rank", [None, 32])
@pytest.mark.parametrize("interleave", [True, False])
def test_forward_dense_matches_reference(q_lora_rank, interleave) -> None:
    cfg = make_cfg(q_lora_rank=q_lora_rank, rope_interleave=interleave)
    attn, rope = make_attn(cfg, seed=1), RotaryEmbedding(cfg)
    x = torch.randn(2, 10, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    cos, sin = rope.cos_sin(torch.arange(10))
    with torch.no_grad():
        want = torch.stack([mla_reference(attn, cfg, x[b]) for b in range(2)])
        for absorbed in (False, True):
            got = attn.forward_dense(x, rope, cos, sin, absorbed=absorbed)
            assert (got - want).abs().max() <= TOL, absorbed


def test_attend_absorbed_equals_naive() -> None:
    cfg = make_cfg(q_lora_rank=None)
    attn = make_attn(cfg, seed=2)
    g = torch.Generator().manual_seed(0)
    B, Q, L, H = 3, 4, 9, cfg.num_attention_heads
    q_nope = torch.randn(B, Q, H, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(B, Q, H, cfg.qk_rope_head_dim, generator=g)
    kv = torch.randn(B, L, cfg.kv_cache_dim, generator=g)
    mask = torch.rand(B, Q, L, generator=g) < 0.6
    mask[..., 0] = True                                        # every query sees at least one key
    with torch.no_grad():
        naive = attn.attend(q_nope, q_pe, kv, mask, absorbed=False)
        absorbed = attn.attend(q_nope, q_pe, kv, mask, absorbed=True)
        assert naive.shape == (B, Q, H, cfg.v_head_dim)
        assert (naive - absorbed).abs().max() <= TOL
        # masked keys really are ignored: changing them changes nothing
        kv2 = torch.where(mask.any(1)[..., None], kv, torch.randn(kv.shape, generator=g))
        assert (attn.attend(q_nope, q_pe, kv2, mask, absorbed=True) - absorbed).abs().max() <= TOL
        assert (attn.attend(q_nope, q_pe, kv, ~mask | (mask.cumsum(-1) == 1), absorbed=True)
                - absorbed).abs().max() > 1e-3


# ---- paged serving path ---------------------------------------------------------------------------

def make_model(seed: int = 0, **kw) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM(make_cfg(**kw))
    init_weights(model, seed, std=0.1)
    return model.eval()


def new_caches(model: DeepseekV3ForCausalLM, num_blocks: int, bs: int) -> list[torch.Tensor]:
    """Large finite garbage: a read of an unwritten slot that is not masked out shows in the result.
    (Not NaN: padded key slots point at slot 0, masked by an additive -inf, and 0 * NaN is NaN.)"""
    g = torch.Generator().manual_seed(99)
    return [100 * torch.randn(num_blocks, bs, model.config.kv_cache_dim, generator=g)
            for _ in range(len(model.model.layers))]


def run_schedule(model: DeepseekV3ForCausalLM, seqs: list[list[int]], chunks: list[list[int]],
                 tables: list[list[int]], bs: int, caches: list[torch.Tensor],
                 use_absorbed: bool | None) -> list[torch.Tensor]:
    """chunks[step][row] = how many tokens row feeds at that step (0 = row idle). -> per row [S, hidden]."""
    done = [0] * len(seqs)
    outs: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in chunks:
        rows = [b for b, n in enumerate(step) if n]
        positions = [list(range(done[b], done[b] + step[b])) for b in rows]
        meta = AttentionMetadata.build(positions, [tables[b] for b in rows], bs, use_absorbed=use_absorbed)
        ids = torch.tensor([seqs[b][p] for b, ps in zip(rows, positions) for p in ps])
        hidden = model(ids, meta, caches)                                            # [T, hidden]
        for b, h in zip(rows, hidden.split([step[b] for b in rows])):
            outs[b].append(h)
            done[b] += step[b]
    return [torch.cat(o) for o in outs]


@pytest.mark.parametrize("kw", [dict(q_lora_rank=32, yarn=True), dict(q_lora_rank=None, rope_interleave=False)],
                         ids=["qlora_yarn", "noqlora_nointerleave"])
def test_paged_prefill_and_decode_equal_forward_dense(kw) -> None:
    """Two rows sharing one batch: chunked prefill, a 1+K verification-shaped step, single-token decode."""
    model = make_model(seed=4, **kw)
    bs = 4
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (14,), generator=g).tolist(), torch.randint(0, 96, (9,), generator=g).tolist()]
    chunks = [[6, 0], [5, 5], [3, 1], [0, 3]]              # row 0: 6+5 prefill, then 3 (1+K); row 1: 5, 1, 3
    tables = [[7, 2, 5, 0], [6, 1, 3]]                     # disjoint, shuffled blocks
    with torch.no_grad():
        want = [model.forward_dense(torch.tensor([s]))[0] for s in seqs]
        for use_absorbed in (None, False, True):
            caches = new_caches(model, 8, bs)
            got = run_schedule(model, seqs, chunks, tables, bs, caches, use_absorbed)
            for b in range(2):
                assert (got[b] - want[b]).abs().max() <= TOL, (use_absorbed, b)


def test_paged_absorbed_equals_naive_single_forward() -> None:
    model = make_model(seed=6, q_lora_rank=None, yarn=True)
    attn = model.model.layers[0].self_attn
    bs = 4
    positions, tables = [[5, 6, 7], [0, 1, 2, 3, 4]], [[3, 0], [1, 2]]
    meta_n = AttentionMetadata.build(positions, tables, bs, use_absorbed=False)
    meta_a = AttentionMetadata.build(positions, tables, bs, use_absorbed=True)
    g = torch.Generator().manual_seed(7)
    cache = torch.randn(4, bs, model.config.kv_cache_dim, generator=g)              # history of row 0
    x = torch.randn(8, model.config.hidden_size, generator=g)                       # [T, hidden]
    cos, sin = model.rope.cos_sin(meta_n.positions)
    with torch.no_grad():
        c1, c2 = cache.clone(), cache.clone()
        naive = attn(x, model.rope, cos, sin, meta_n, c1)
        absorbed = attn(x, model.rope, cos, sin, meta_a, c2)
    assert naive.shape == (8, model.config.hidden_size)
    assert (naive - absorbed).abs().max() <= TOL
    assert torch.equal(c1, c2)
    # the writes landed exactly at slot_mapping, nothing else changed
    written = torch.zeros(4 * bs, dtype=torch.bool)
    written[meta_n.slot_mapping] = True
    assert torch.equal(c1.view(-1, c1.shape[-1])[~written], cache.view(-1, cache.shape[-1])[~written])
    assert not torch.equal(c1.view(-1, c1.shape[-1])[written], cache.view(-1, cache.shape[-1])[written])


def test_rows_in_one_batch_do_not_see_each_other() -> None:
    model = make_model(seed=8)
    bs = 4
    seqs = [[5, 9, 2, 7, 1, 3], [8, 8, 4, 6, 2]]
    tables = [[0, 3], [1, 2]]
    with torch.no_grad():
        together = run_schedule(model, seqs, [[6, 5]], tables, bs, new_caches(model, 4, bs), None)
        for b in range(2):
            alone = run_schedule(model, [seqs[b]], [[len(seqs[b])]], [tables[b]], bs,
                                 new_caches(model, 4, bs), None)
            assert (together[b] - alone[0]).abs().max() <= TOL


def test_metadata_worked_example() -> None:
    """The docstring example of AttentionMetadata, by hand."""
    meta = AttentionMetadata.build([[5, 6], [0, 1, 2]], [[3, 8], [1]], 4)
    assert meta.positions.tolist() == [5, 6, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [33, 34, 4, 5, 6]
    assert meta.query_start == [0, 2, 5] and meta.context_lens == [7, 3]
    assert meta.q_index.tolist() == [[0, 1, 5], [2, 3, 4]]
    assert meta.kv_slots[0].tolist() == [12, 13, 14, 15, 32, 33, 34]
    assert meta.kv_slots[1, :3].tolist() == [4, 5, 6]
    assert meta.q_valid.tolist() == [[True, True, False], [True, True, True]]


@pytest.mark.parametrize("kw", [dict(q_lora_rank=32, yarn=True), dict(q_lora_rank=None, rope_interleave=False)],
                         ids=["qlora_yarn", "noqlora_nointerleave"])
def test_fused_decode_weights_match_forward_dense(kw) -> None:
    """fuse_for_decode(): pre-absorbed query/output weights, stacked experts and gate|up, used by the
    uniform (decode / verification) steps; the result still equals the dense reference."""
    model = make_model(seed=4, **kw)
    bs = 4
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 96, (14,), generator=g).tolist(), torch.randint(0, 96, (12,), generator=g).tolist()]
    chunks = [[6, 5], [4, 4], [1, 1], [3, 0], [0, 2]]      # prefill, then uniform rows of 4 and 1 tokens
    tables = [[7, 2, 5, 0], [6, 1, 3]]
    with torch.no_grad():
        want = [model.forward_dense(torch.tensor([s]))[0] for s in seqs]
        fused = model.fuse_for_decode()
        assert fused["attention"] == len(model.model.layers) and fused["moe"] >= 1
        assert all(layer.self_attn.decode_weights is not None for layer in model.model.layers)
        got = run_schedule(model, seqs, chunks, tables, bs, new_caches(model, 8, bs), True)
        for b in range(2):
            assert (got[b] - want[b]).abs().max() <= TOL, b
        # the fused path really ran: dropping the absorbed weights changes nothing but the route taken
        for layer in model.model.layers:
            layer.self_attn.decode_weights = None
        again = run_schedule(model, seqs, chunks, tables, bs, new_caches(model, 8, bs), True)
        for b in range(2):
            assert (again[b] - got[b]).abs().max() <= TOL


def test_absorption_skipped_when_it_would_bloat_the_weights() -> None:
    """DeepSeek-V3's shapes (128 heads, r=512, q_lora 1536) would grow the attention weights ~3x:
    fuse_for_decode() keeps them unabsorbed; the tiny shapes are absorbed."""
    d = tiny_config_dict(96, q_lora_rank=64)
    d.update(num_attention_heads=16, kv_lora_rank=256, qk_nope_head_dim=16, v_head_dim=16)
    big = MLAttention(ModelConfig.from_dict(d))
    assert not big.fuse_for_decode() and big.decode_weights is None
    small = MLAttention(make_cfg())
    assert small.fuse_for_decode() and small.decode_weights is not None
