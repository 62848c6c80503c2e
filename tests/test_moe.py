"""DeepSeek MoE: the noaux_tc router against a hand-written reference, sparse expert dispatch, layer types."""
from __future__ import annotations

import math

import pytest
import torch

torch.set_num_threads(1)

from mtp_core.config import ModelConfig  # noqa: E402
from mtp_core.model import DeepseekV3ForCausalLM  # noqa: E402
from mtp_core.model.layers import MLP  # noqa: E402
from mtp_core.model.moe import MoE  # noqa: E402
from mtp_core.tiny import init_weights, tiny_config_dict  # noqa: E402

HIDDEN = 64


def make_cfg(**over) -> ModelConfig:
    d = tiny_config_dict(96, hidden_size=HIDDEN, n_group=over.pop("n_group", 2))
    d.update(over)
    return ModelConfig.from_dict(d)


def sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def ref_route(logits: list[float], bias: list[float], n_group: int, topk_group: int, top_k: int,
              norm: bool, scale: float) -> dict[int, float]:
    """One token, by hand: {expert: weight}. Biased scores choose groups (sum of each group's top 2) and
    experts; the weights are the unbiased sigmoid scores."""
    s = [sig(v) for v in logits]
    c = [a + b for a, b in zip(s, bias)]
    per = len(s) // n_group
    group_score = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
    groups = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
    cand = [e for g in groups for e in range(g * per, (g + 1) * per)]
    chosen = sorted(cand, key=lambda e: -c[e])[:top_k]
    total = sum(s[e] for e in chosen) if norm else 1.0
    return {e: s[e] / total * scale for e in chosen}


def as_dict(w: torch.Tensor, idx: torch.Tensor) -> dict[int, float]:
    return {int(e): float(v) for e, v in zip(idx.detach(), w.detach())}


def set_logits(moe: MoE, logits: list[float], bias: list[float]) -> torch.Tensor:
    """Gate weight = identity on the first E dims, so x = [logits, 0...] gives exactly these logits."""
    E = len(logits)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[:, :E] = torch.eye(E)
        moe.gate.e_score_correction_bias.copy_(torch.tensor(bias))
    x = torch.zeros(1, HIDDEN)
    x[0, :E] = torch.tensor(logits)
    return x                                                                      # [1, hidden]


def test_bias_changes_selection_not_weights() -> None:
    moe = MoE(make_cfg(n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=2.5))
    logits = [2.0, 1.0, 0.5, 0.0, -1.0, -1.0, -1.0, -1.0]
    bias = [0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]
    with torch.no_grad():
        w, idx = moe.gate(set_logits(moe, logits, bias))
    s0, s3 = sig(2.0), 0.5                           # without the bias experts 0 and 1 would win
    want = {0: 2.5 * s0 / (s0 + s3), 3: 2.5 * s3 / (s0 + s3)}
    got = as_dict(w[0], idx[0])
    assert got.keys() == want.keys()
    for e in want:
        assert got[e] == pytest.approx(want[e], abs=1e-6)
    assert w.dtype == torch.float32 and idx.shape == (1, 2)


def test_group_limit_drops_the_best_expert_of_a_weak_group() -> None:
    """4 groups of 2, 2 groups kept: expert 0 has the top score but its partner is poor."""
    moe = MoE(make_cfg(n_group=4, topk_group=2, num_experts_per_tok=2, routed_scaling_factor=1.0))
    logits = [3.0, -4.0, 1.0, 0.9, 0.8, 0.7, 0.2, 0.1]
    w, idx = moe.gate(set_logits(moe, logits, [0.0] * 8))
    s2, s3 = sig(1.0), sig(0.9)
    got = as_dict(w[0], idx[0])
    assert got.keys() == {2, 3}
    assert got[2] == pytest.approx(s2 / (s2 + s3), abs=1e-6)


def test_groups_ranked_by_sum_of_top_two() -> None:
    """2 groups of 4, 1 kept. Group 1 has the max and the larger total; group 0 the larger top-2 sum."""
    moe = MoE(make_cfg(n_group=2, topk_group=1, num_experts_per_tok=2, norm_topk_prob=False,
                       routed_scaling_factor=1.5))
    logits = [0.9, 0.9, -5.0, -5.0, 1.0, 0.0, 0.0, 0.0]
    w, idx = moe.gate(set_logits(moe, logits, [0.0] * 8))
    got = as_dict(w[0], idx[0])
    assert got.keys() == {0, 1}
    assert got[0] == pytest.approx(1.5 * sig(0.9), abs=1e-6)          # no normalisation


@pytest.mark.parametrize("n_group,topk_group,top_k,norm,scale", [
    (1, 1, 2, True, 2.5), (2, 1, 3, True, 1.0), (4, 2, 3, False, 2.0), (4, 3, 4, True, 0.5), (2, 2, 5, True, 1.0),
])
def test_gate_matches_reference_on_random_tokens(n_group, topk_group, top_k, norm, scale) -> None:
    moe = MoE(make_cfg(n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k, norm_topk_prob=norm,
                       routed_scaling_factor=scale))
    g = torch.Generator().manual_seed(n_group * 10 + top_k)
    with torch.no_grad():
        moe.gate.weight.copy_(torch.randn(8, HIDDEN, generator=g) * 0.3)
        moe.gate.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    x = torch.randn(40, HIDDEN, generator=g)                                       # [T, hidden]
    with torch.no_grad():
        w, idx = moe.gate(x)
    logits = (x.double() @ moe.gate.weight.double().T).tolist()
    bias = moe.gate.e_score_correction_bias.tolist()
    by_bias = by_group = 0
    for t in range(40):
        want = ref_route(logits[t], bias, n_group, topk_group, top_k, norm, scale)
        got = as_dict(w[t], idx[t])
        assert got.keys() == want.keys(), t
        for e in want:
            assert got[e] == pytest.approx(want[e], abs=1e-5)
        by_bias += want.keys() != ref_route(logits[t], [0.0] * 8, n_group, topk_group, top_k, norm, scale).keys()
        by_group += want.keys() != ref_route(logits[t], bias, 1, 1, top_k, norm, scale).keys()
    assert by_bias > 0                                  # the bias mattered for some tokens
    assert (by_group > 0) == (topk_group < n_group)     # and so did the group limit, where there is one


def _silu(v: torch.Tensor) -> torch.Tensor:
    return v / (1 + torch.exp(-v))


def _mlp_ref(m: MLP, x: torch.Tensor) -> torch.Tensor:
    return (_silu(x @ m.gate_proj.weight.T) * (x @ m.up_proj.weight.T)) @ m.down_proj.weight.T


def test_experts_run_only_on_their_tokens_and_output_matches_reference() -> None:
    cfg = make_cfg(n_group=2, topk_group=1, num_experts_per_tok=2)
    moe = MoE(cfg)
    init_weights(moe, 3, std=0.1)
    T = 13
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(1))
    seen: dict[int, list[torch.Tensor]] = {}
    for e, expert in enumerate(moe.experts):
        def wrapped(inp: torch.Tensor, _e: int = e, _f=expert.forward) -> torch.Tensor:
            seen.setdefault(_e, []).append(inp.detach().clone())
            return _f(inp)
        expert.forward = wrapped
    with torch.no_grad():
        w, idx = moe.gate(x)
        out = moe(x.view(1, T, HIDDEN))                                             # [..., hidden] kept
    assert out.shape == (1, T, HIDDEN)
    assert sum(r.shape[0] for rows in seen.values() for r in rows) == T * cfg.num_experts_per_tok
    for e in range(8):
        mine = sorted(t for t in range(T) if e in idx[t].tolist())
        rows = torch.cat(seen[e]) if e in seen else torch.zeros(0, HIDDEN)
        assert rows.shape[0] == len(mine), e
        if mine:
            assert torch.equal(rows[rows[:, 0].argsort()], x[mine][x[mine][:, 0].argsort()])
    with torch.no_grad():
        want = _mlp_ref(moe.shared_experts, x)
        for t in range(T):
            for k in range(cfg.num_experts_per_tok):
                want[t] += w[t, k] * _mlp_ref(moe.experts[int(idx[t, k])], x[t:t + 1])[0]
    assert (out[0] - want).abs().max() <= 1e-5
    assert moe.shared_experts.gate_proj.weight.shape == (cfg.moe_intermediate_size * cfg.n_shared_experts, HIDDEN)


def test_single_token_runs_exactly_top_k_experts() -> None:
    moe = MoE(make_cfg(num_experts_per_tok=2))
    init_weights(moe, 0, std=0.1)
    calls: list[int] = []
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda mod, inp, out, _e=e: calls.append(_e))
    with torch.no_grad():
        _, idx = moe.gate(torch.ones(1, HIDDEN))
        moe(torch.ones(1, HIDDEN))
    assert sorted(calls) == sorted(idx[0].tolist())


def test_dense_mlp_layers_and_moe_layer_freq() -> None:
    d = tiny_config_dict(96, num_layers=6, num_mtp=0, first_k_dense=2, moe_layer_freq=2)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(d))
    kinds = ["moe" if isinstance(layer.mlp, MoE) else "dense" for layer in model.model.layers]
    assert kinds == ["dense", "dense", "moe", "dense", "moe", "dense"]
    dense = model.model.layers[0].mlp
    assert type(dense) is MLP and dense.gate_proj.weight.shape == (d["intermediate_size"], 64)
    init_weights(dense, 1, std=0.1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (dense(x) - _mlp_ref(dense, x)).abs().max() <= 1e-6


def test_mtp_layer_is_moe_and_first_k_dense() -> None:
    d = tiny_config_dict(96, num_layers=3, num_mtp=1, first_k_dense=1)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(d))
    kinds = [isinstance(layer.mlp, MoE) for layer in model.model.layers]
    assert kinds == [False, True, True, True]
    names = set(model.state_dict())
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names


@pytest.mark.parametrize("n_shared", [1, 0])
def test_fused_dense_small_batch_matches_routed(n_shared) -> None:
    """fuse_for_decode(): every expert on every token, mixed by the router weights (0 when unchosen),
    equals the per-expert routed loop; the experts' weights become views of the stacked copy."""
    moe = MoE(make_cfg(n_shared_experts=n_shared, num_experts_per_tok=2)).eval()
    init_weights(moe, 5, std=0.1)
    g = torch.Generator().manual_seed(2)
    xs = {T: torch.randn(T, HIDDEN, generator=g) for T in (1, 4, 16, 40)}
    with torch.no_grad():
        want = {T: moe(x) for T, x in xs.items()}
        assert moe.fuse_for_decode()
        w13, w2 = moe.stacked
        assert w13.shape == ((8 + n_shared) * 2 * moe.experts[0].gate_proj.weight.shape[0], HIDDEN)
        assert moe.experts[3].down_proj.weight.data_ptr() == w2[3].data_ptr()      # a view, not a copy
        for T, x in xs.items():
            w, idx = moe.gate(x)
            assert (moe.dense(x, w, idx) - want[T]).abs().max() <= 1e-5, T
            assert (moe(x) - want[T]).abs().max() <= 1e-5, T                      # whichever path it picks
        # the dense path is taken only for small batches that pick enough experts
        used: list[int] = []
        orig = moe.dense
        moe.dense = lambda x, w, i: used.append(x.shape[0]) or orig(x, w, i)
        for x in xs.values():
            moe(x)
    assert used == [4, 16]


def test_the_static_step_takes_the_dense_path_at_every_batch_size() -> None:
    """The captured (CUDA-graph) step needs fixed shapes: its metadata (AttentionMetadata.uniform, static_shapes)
    sends every MoE through the dense path, at a batch the eager forward would route; same values."""
    moe = MoE(make_cfg(n_shared_experts=1, num_experts_per_tok=2)).eval()
    init_weights(moe, 5, std=0.1)
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(4))     # > DENSE_MAX_TOKENS
    with torch.no_grad():
        assert moe.fuse_for_decode()
        used: list[int] = []
        orig = moe.dense
        moe.dense = lambda x, w, i: used.append(x.shape[0]) or orig(x, w, i)
        routed = moe(x)
        assert used == []
        assert (moe.forward_static(x) - routed).abs().max() <= 1e-5 and used == [40]


def test_fusion_leaves_training_on_the_routed_path() -> None:
    moe = MoE(make_cfg())
    init_weights(moe, 1, std=0.1)
    assert moe.fuse_for_decode()
    moe.train()
    x = torch.randn(4, HIDDEN, requires_grad=True)
    moe(x).sum().backward()
    assert x.grad is not None and moe.load_counts.sum() == 4 * moe.gate.top_k


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_training_path_matches_the_routed_loop_with_its_gradients(tokens: int) -> None:
    """MoE.grouped (training: batched matmuls over a capacity-padded layout) computes what routed() does,
    forward and backward, with unequal expert loads and idle experts."""
    results = []
    for path in ("grouped", "routed"):
        torch.manual_seed(tokens)
        moe = MoE(make_cfg())
        init_weights(moe, 3, std=0.1)
        moe.train()
        x = torch.randn(tokens, HIDDEN).requires_grad_(True)
        weights, idx = moe.gate(x)
        if tokens > 1:
            assert torch.bincount(idx.flatten(), minlength=len(moe.experts)).unique().numel() > 1
        out = getattr(moe, path)(x, weights, idx)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = [x.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in moe.parameters()]
        results.append((out.detach(), grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for g1, g2 in zip(ga, gb):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in ga[1:])


def test_training_forward_takes_the_grouped_path() -> None:
    moe = MoE(make_cfg())
    init_weights(moe, 1, std=0.1)
    moe.train()
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        ref = moe.routed(x.reshape(-1, HIDDEN), *moe.gate(x.reshape(-1, HIDDEN))) + moe.shared_experts(x.reshape(-1, HIDDEN))
    calls = []
    orig = MoE.grouped
    MoE.grouped = lambda self, *a: calls.append(1) or orig(self, *a)
    try:
        out = moe(x)
    finally:
        MoE.grouped = orig
    assert calls == [1]
    torch.testing.assert_close(out.reshape(-1, HIDDEN), ref, rtol=1e-5, atol=1e-6)
