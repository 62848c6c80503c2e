"""`mtp train`: the objective's context layout, determinism, resume, export (CI never trains for real)."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mtp_core.config import ModelConfig
from mtp_core.loader import load_model
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.tiny import init_weights, tiny_config_dict
from mtp_core.train_mtp.objective import depth_mask, mtp_depth_forward, shift_hidden
from mtp_factory.data import FAMILIES
from mtp_factory.recipes import RECIPES
from mtp_factory.trainer import batch_for_step, train

torch.set_num_threads(1)


def test_depth_mask_table() -> None:
    # depth 1: plain causal. depth 3, query p=4: true keys q <= 2, chain keys of depth 2 at q=3, depth 3 at q=4
    assert torch.equal(depth_mask(3, 1, torch.device("cpu")), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    m = depth_mask(5, 3, torch.device("cpu"))
    assert m.shape == (5, 15)
    row = m[4].view(3, 5).int().tolist()
    assert row == [[1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]


def test_depth_one_equals_the_plain_mtp_forward() -> None:
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(tiny_config_dict(200, num_mtp=2)))
    init_weights(model, 3)
    ids = torch.randint(0, 200, (2, 9))
    with torch.no_grad():
        h = model.forward_dense(ids)
        emb = model.model.embed_tokens(ids[:, 1:])
        cos, sin = model.rope.cos_sin(torch.arange(8))
        g = mtp_depth_forward(model, model.mtp_module(1), emb, [h[:, :-1]], cos, sin)
        ref = model.mtp_forward_dense(1, ids[:, 1:], h[:, :-1])
    assert torch.allclose(g, ref, atol=1e-5)


def test_depth_two_matches_a_drafter_style_recompute() -> None:
    """Depth 2 at position p = context of true entries q <= p-1 plus one chain entry at p built from
    (x_{p+1}, g1_{p-1}): recompute it with the dense path on a hand-assembled sequence."""
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(tiny_config_dict(200, num_mtp=1)))
    init_weights(model, 4)
    ids = torch.randint(0, 200, (1, 10))
    with torch.no_grad():
        h = model.forward_dense(ids)
        emb = model.model.embed_tokens(ids[:, 1:])
        cos, sin = model.rope.cos_sin(torch.arange(9))
        g1 = mtp_depth_forward(model, model.mtp_module(0), emb, [h[:, :-1]], cos, sin)
        g2 = mtp_depth_forward(model, model.mtp_module(0), emb, [h[:, :-1], shift_hidden(g1)], cos, sin)
        p = 6
        hid = torch.cat([h[:, :p], g1[:, p - 1:p]], dim=1)       # true hidden at q < p, chain hidden at p
        ref = model.mtp_forward_dense(0, ids[:, 1:p + 2], hid)
    assert torch.allclose(g2[0, p], ref[0, p], atol=1e-5)


def test_smoke_training_is_deterministic_resumable_and_loads(tmp_path: Path) -> None:
    recipe = replace(RECIPES["smoke"], steps=3, save_every=1)
    a = tmp_path / "a"
    train(recipe, a, max_steps=2, echo=lambda s: None)              # stop after 2 steps ...
    train(recipe, a, echo=lambda s: None)                           # ... and resume to the end
    b = tmp_path / "b"
    b.mkdir()
    shutil.copytree(a / "tokenizer", b / "tokenizer")               # same vocabulary, fresh run
    train(recipe, b, echo=lambda s: None)
    ha = json.loads((a / "state" / "state.json").read_text())["history"]
    hb = json.loads((b / "state" / "state.json").read_text())["history"]
    assert [round(x["loss"], 5) for x in ha] == [round(x["loss"], 5) for x in hb]
    assert len(ha) == 3 and all(len(x["mtp_loss"]) == 3 and len(x["eagle_loss"]) == 2 for x in ha)
    model, ckpt = load_model(a / "model", make_model=DeepseekV3ForCausalLM)
    assert ckpt.config.num_nextn_predict_layers == 3 and model.num_mtp_modules == 3
    assert (a / "model" / "tokenizer.json").is_file() and (a / "model" / "generation_config.json").is_file()


def test_family_mix_segments_change_the_batches_from_their_start_step() -> None:
    """mix_segments: from its start step a segment's family shares decide the generated examples."""
    from mtp_factory.data.dataset import training_texts

    only_add = list(training_texts(seed=3, num_examples=40, general_fraction=0.0,
                                   family_weights={f: 0.0 for f in FAMILIES if f != "add"}))
    assert all(("+" in t or " add" in t.lower() or "plus" in t or "sum" in t) for t in only_add)
    with pytest.raises(ValueError, match="unknown task families"):
        next(training_texts(seed=3, num_examples=1, family_weights={"division": 1.0}))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(__file__).resolve().parent.parent / "mtp_core/assets/tiny-r1/tokenizer.json"))
    base = replace(RECIPES["smoke"], mix_segments=())
    mixed = replace(base, mix_segments=((2, (("add", 1.0), ("sub", 0.0), ("mul", 0.0))),))
    assert torch.equal(batch_for_step(tok, base, 1), batch_for_step(tok, mixed, 1))       # before the start
    assert not torch.equal(batch_for_step(tok, base, 2), batch_for_step(tok, mixed, 2))   # from it on


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_depth_attention_equals_the_masked_full_attention(depth: int) -> None:
    """The training objective's attention (causal block + one diagonal key per chain form) computes what
    attending over all forms' keys with depth_mask does."""
    from mtp_core.train_mtp.objective import depth_attention

    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(tiny_config_dict(200, num_mtp=1)))
    init_weights(model, 5)
    attn = model.mtp_module(0).self_attn
    S = 11
    cos, sin = model.rope.cos_sin(torch.arange(S))
    g = torch.Generator().manual_seed(depth)
    xs = [torch.randn(2, S, model.config.hidden_size, generator=g) for _ in range(depth)]
    with torch.no_grad():
        q_nope, q_pe, _ = attn._project(xs[-1], model.rope, cos, sin)
        kvs = [attn.project_kv(x, model.rope, cos, sin) for x in xs]
        ref = attn.attend(q_nope, q_pe, torch.cat(kvs, dim=1), depth_mask(S, depth, torch.device("cpu")).expand(2, -1, -1),
                          absorbed=False)
        out = depth_attention(attn, q_nope, q_pe, kvs)
    assert out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5)


def test_init_from_starts_at_the_given_weights_and_rejects_a_misfit(tmp_path: Path) -> None:
    """Recipe.init_from: step 0 starts from a checkpoint's weights (not the random init); a checkpoint of
    another shape, or a directory without weights, is a one-line error."""
    from safetensors.torch import load_file

    base = replace(RECIPES["smoke"], steps=1, save_every=1)
    train(base, tmp_path / "src", echo=lambda s: None)
    src = tmp_path / "src" / "model"
    out = tmp_path / "cont"
    train(replace(base, name="smoke-cont", init_from=str(src), lr=0.0, lr_segments=((1, "constant", 0.0),)), out,
          echo=lambda s: None)
    a, b = load_file(str(src / "model.safetensors")), load_file(str(out / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a if "correction_bias" not in k)
    with pytest.raises(ValueError, match="does not fit"):
        train(replace(base, name="misfit", hidden_size=48, init_from=str(src)), tmp_path / "misfit", echo=lambda s: None)
    with pytest.raises(ValueError, match="no model.safetensors"):
        train(replace(base, name="nowhere", init_from=str(tmp_path / "nowhere")), tmp_path / "x", echo=lambda s: None)


def test_copy_probe_script_reads_a_run_and_rejects_a_directory_without_state(tmp_path: Path) -> None:
    """scripts/probe_copy.py: question vs reasoning digit loss from a run's saved state, one JSON line appended."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo)}      # this checkout's packages, not an installed copy
    train(replace(RECIPES["smoke"], steps=1, save_every=1), tmp_path / "run", echo=lambda s: None)
    cmd = [sys.executable, str(repo / "scripts" / "probe_copy.py"), "--per_family", "1"]
    r = subprocess.run(cmd + [str(tmp_path / "run")], capture_output=True, text=True, cwd=repo, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["step"] == 1 and res["question_digit_nll"] > 0 and res["reasoning_digit_nll"] > 0
    assert set(res["reasoning_digit_nll_per_family"]) == set(FAMILIES)
    assert (tmp_path / "run" / "copy_probe.jsonl").read_text().count("\n") == 1
    bad = subprocess.run(cmd + [str(tmp_path)], capture_output=True, text=True, cwd=repo, timeout=300, env=env)
    assert bad.returncode != 0 and "no saved training state" in bad.stderr


def test_moe_window_experts_counts_distinct_experts(tiny3_dir, tmp_path) -> None:
    """scripts/moe_window_experts.py: one token picks exactly top_k experts; a window never more than
    min(n, W * top_k) nor fewer than top_k; the counts agree with a direct count of the gates' choices."""
    import importlib.util

    import torch

    from mtp_core.loader import load_model
    from mtp_core.model.moe import Gate

    repo = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("mwe", repo / "scripts" / "moe_window_experts.py")
    mwe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mwe)
    model, _ = load_model(tiny3_dir, make_model=DeepseekV3ForCausalLM)
    n, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    ids = [[1, 5, 9, 13, 40, 41, 42, 60, 7, 8, 3, 4]]
    got = mwe.window_experts(model, ids, [1, 2, 4])
    assert got[1] == k and k <= got[2] <= min(n, 2 * k) and got[2] <= got[4] <= min(n, 4 * k)
    # direct count: the gates' expert ids for the same forward, windows of 4
    gates = [m for name, m in model.named_modules()
             if isinstance(m, Gate) and int(name.split(".")[2]) < model.config.num_hidden_layers]
    seen = []
    hs = [g.register_forward_hook(lambda _m, _i, out: seen.append(out[1])) for g in gates]
    with torch.no_grad():
        model.forward_dense(torch.tensor(ids))
    for h in hs:
        h.remove()
    direct = [len(set(idx[s:s + 4].flatten().tolist())) for idx in seen for s in range(idx.shape[0] - 3)]
    assert seen and abs(got[4] - sum(direct) / len(direct)) < 1e-12
    # hooks are removed afterwards
    assert all(not g._forward_hooks for g in gates)
