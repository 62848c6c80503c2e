"""Safetensors loader: sharding, dtype selection, and one-line ValueErrors for every bad checkpoint."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)

from mtp_core import kernels  # noqa: E402
from mtp_core.config import ModelConfig  # noqa: E402
from mtp_core.loader import load_model, resolve_dtype  # noqa: E402
from mtp_core.model import DeepseekV3ForCausalLM  # noqa: E402
from mtp_core.tiny import init_weights, tiny_config_dict, write_weights  # noqa: E402

VOCAB = 96


def write_ckpt(d: Path, num_shards: int = 1, seed: int = 0, **over) -> dict[str, torch.Tensor]:
    d.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config_dict(VOCAB, num_layers=2, num_mtp=1)
    cfg.update(over)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(cfg))
    init_weights(model, seed, std=0.1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    write_weights(d, state, num_shards)
    (d / "config.json").write_text(json.dumps(cfg))
    return state


def load_error(d: Path, *needles: str) -> str:
    """load_model(d) must raise a one-line ValueError naming every needle."""
    with pytest.raises(ValueError) as ei:
        load_model(d, "float32", make_model=DeepseekV3ForCausalLM)
    msg = str(ei.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def index_of(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def set_index(d: Path, idx: dict) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))


# ---- good checkpoints -----------------------------------------------------------------------------

def test_loads_every_tensor_exactly(tmp_path: Path) -> None:
    state = write_ckpt(tmp_path)
    model, ckpt = load_model(tmp_path, "float32", make_model=DeepseekV3ForCausalLM)
    got = model.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert ckpt.config.num_hidden_layers == 2 and ckpt.config.num_nextn_predict_layers == 1
    assert not model.training


def test_three_shards_load_equal_to_single_file(tmp_path: Path) -> None:
    state = write_ckpt(tmp_path / "one")
    write_ckpt(tmp_path / "three", num_shards=3)
    assert len(list((tmp_path / "three").glob("*.safetensors"))) == 3
    assert len(set(index_of(tmp_path / "three")["weight_map"].values())) == 3
    one, _ = load_model(tmp_path / "one", "float32", make_model=DeepseekV3ForCausalLM)
    three, ck3 = load_model(tmp_path / "three", "float32", make_model=DeepseekV3ForCausalLM)
    assert len(ck3.shard_tensors) == 3
    s1, s3 = one.state_dict(), three.state_dict()
    assert set(s1) == set(s3) == set(state)
    for k in s1:
        assert torch.equal(s1[k], s3[k]), k
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(one.forward_dense(ids), three.forward_dense(ids))


def test_dtype_selection(tmp_path: Path) -> None:
    state = write_ckpt(tmp_path)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    auto, _ = load_model(tmp_path, "auto", make_model=DeepseekV3ForCausalLM)
    assert {p.dtype for p in auto.parameters()} == {torch.float32}
    bf, _ = load_model(tmp_path, "bfloat16", make_model=DeepseekV3ForCausalLM)
    sd = bf.state_dict()
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert sd["model.layers.1.mlp.experts.0.up_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["lm_head.weight"], state["lm_head.weight"].to(torch.bfloat16))
    # the router stays float32, as transformers keeps it (_keep_in_fp32_modules_strict)
    assert sd["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert sd["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64")
    # a bf16-stored checkpoint under `auto` stays bf16 on a CPU with the native kernels (they read it in place
    # and compute in fp32), and is upcast to float32 without them
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    up, _ = load_model(tmp_path, "auto", make_model=DeepseekV3ForCausalLM)
    want = torch.bfloat16 if kernels.native_ops().cpu else torch.float32
    assert resolve_dtype("auto", "cpu", torch.bfloat16) == want
    assert {p.dtype for n, p in up.named_parameters() if "mlp.gate." not in n} == {want}
    assert torch.equal(up.lm_head.weight.float(), state["lm_head.weight"].to(torch.bfloat16).float())
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        a = auto.compute_logits(auto.forward_dense(ids))
        b = bf.compute_logits(bf.forward_dense(ids))
    assert b.dtype == torch.float32 and (a - b).abs().max() < 0.25 * a.abs().max()


def test_mtp_copies_of_embedding_and_head_are_ignored(tmp_path: Path) -> None:
    state = write_ckpt(tmp_path)
    st = dict(state)
    st["model.layers.2.embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    st["model.layers.2.shared_head.head.weight"] = torch.zeros(VOCAB, 64)
    (tmp_path / "model.safetensors").unlink()
    save_file(st, str(tmp_path / "model.safetensors"))
    model, _ = load_model(tmp_path, "float32", make_model=DeepseekV3ForCausalLM)
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    # ... but only at MTP layers: a main layer holding such a tensor is wrong
    st["model.layers.0.embed_tokens.weight"] = torch.zeros(VOCAB, 64)
    save_file(st, str(tmp_path / "model.safetensors"))
    load_error(tmp_path, "model.layers.0.embed_tokens.weight")


# ---- bad directories and configs ------------------------------------------------------------------

def test_missing_directory(tmp_path: Path) -> None:
    load_error(tmp_path / "nope", str(tmp_path / "nope"))


def test_missing_config_json(tmp_path: Path) -> None:
    write_ckpt(tmp_path)
    (tmp_path / "config.json").unlink()
    load_error(tmp_path, "config.json")


def test_config_not_json(tmp_path: Path) -> None:
    write_ckpt(tmp_path)
    (tmp_path / "config.json").write_text("{ not json")
    load_error(tmp_path, "config.json", "JSON")


def test_config_missing_field(tmp_path: Path) -> None:
    write_ckpt(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_error(tmp_path, "kv_lora_rank", "config.json")


@pytest.mark.parametrize("over,needle", [
    ({"n_group": 3}, "n_group"),                          # 8 experts not divisible by 3 groups
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),  # more than n_routed_experts=8
    ({"topk_group": 3}, "topk_group"),                    # more than n_group=2
    ({"hidden_size": 0}, "hidden_size"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "original_max_position_embeddings"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
])
def test_config_contradictions(tmp_path: Path, over: dict, needle: str) -> None:
    write_ckpt(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_error(tmp_path, needle)


@pytest.mark.parametrize("over,needle", [
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
    ({"n_group": None}, "n_group"),
    ({"num_nextn_predict_layers": None}, "num_nextn_predict_layers"),
    ({"first_k_dense_replace": None}, "first_k_dense_replace"),
    ({"rms_norm_eps": None}, "rms_norm_eps"),
    ({"n_routed_experts": "8"}, "n_routed_experts"),
])
def test_config_null_or_mistyped_numbers(over: dict, needle: str) -> None:
    d = tiny_config_dict(VOCAB)
    d.update(over)
    with pytest.raises(ValueError, match=re.escape(needle)):
        ModelConfig.from_dict(d)


# ---- bad weights ----------------------------------------------------------------------------------

def test_no_weights(tmp_path: Path) -> None:
    write_ckpt(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    load_error(tmp_path, "safetensors")


def test_missing_shard_named_in_index(tmp_path: Path) -> None:
    write_ckpt(tmp_path, num_shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    load_error(tmp_path, "model-00002-of-00003.safetensors", "missing")


def test_lfs_pointer_shard(tmp_path: Path) -> None:
    write_ckpt(tmp_path, num_shards=3)
    (tmp_path / "model-00003-of-00003.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 123456\n")
    load_error(tmp_path, "model-00003-of-00003.safetensors", "LFS")


@pytest.mark.parametrize("keep", [4, 200, -100], ids=["in_length", "in_header", "in_data"])
def test_truncated_safetensors(tmp_path: Path, keep: int) -> None:
    write_ckpt(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep])
    load_error(tmp_path, "model.safetensors", "truncated")


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_entry_escaping_model_dir(tmp_path: Path, how: str) -> None:
    d = tmp_path / "ckpt"
    write_ckpt(d, num_shards=3)
    victim = "model-00001-of-00003.safetensors"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((d / victim).read_bytes())              # a valid file: only containment can refuse it
    idx = index_of(d)
    if how == "dotdot":
        rel = "../outside.safetensors"
    elif how == "absolute":
        rel = str(outside)
    else:
        rel = "link.safetensors"
        os.symlink(outside, d / rel)
    idx["weight_map"] = {k: (rel if v == victim else v) for k, v in idx["weight_map"].items()}
    set_index(d, idx)
    msg = load_error(d, rel)
    assert "outside" in msg or "absolute" in msg


def test_unindexed_symlink_pointing_outside(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    write_ckpt(d)
    outside = tmp_path / "elsewhere.safetensors"
    (d / "model.safetensors").rename(outside)
    os.symlink(outside, d / "model.safetensors")
    load_error(d, "model.safetensors", "outside")


@pytest.mark.parametrize("weight_map", [[], "model.safetensors", {"model.norm.weight": None}],
                         ids=["list", "string", "null_path"])
def test_malformed_index(tmp_path: Path, weight_map) -> None:
    write_ckpt(tmp_path, num_shards=3)
    idx = index_of(tmp_path)
    if isinstance(weight_map, dict):
        idx["weight_map"].update(weight_map)
    else:
        idx["weight_map"] = weight_map
    set_index(tmp_path, idx)
    load_error(tmp_path, "model.safetensors.index.json")


@pytest.mark.parametrize("header", [[1, 2], {"x": {"dtype": "F32", "shape": [1]}}], ids=["list", "no_offsets"])
def test_malformed_safetensors_header(tmp_path: Path, header) -> None:
    write_ckpt(tmp_path)
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw)
    load_error(tmp_path, "model.safetensors")


def test_corrupt_safetensors_header_bytes(tmp_path: Path) -> None:
    write_ckpt(tmp_path)
    f = tmp_path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))
    load_error(tmp_path, "model.safetensors", "corrupt")


def test_tensor_in_two_unindexed_files(tmp_path: Path) -> None:
    write_ckpt(tmp_path)
    save_file({"model.norm.weight": torch.zeros(64)}, str(tmp_path / "zz-extra.safetensors"))
    load_error(tmp_path, "model.norm.weight", "zz-extra.safetensors", "model.safetensors")


def test_wrong_shape(tmp_path: Path) -> None:
    state = write_ckpt(tmp_path, num_shards=3)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    fname = index_of(tmp_path)["weight_map"][name]
    part = load_file(str(tmp_path / fname))
    part[name] = torch.zeros(128, 31)
    save_file(part, str(tmp_path / fname))
    msg = load_error(tmp_path, name, fname, str(list(state[name].shape)))
    assert "[128, 31]" in msg


def test_missing_tensor(tmp_path: Path) -> None:
    state = write_ckpt(tmp_path)
    name = "model.layers.2.hnorm.weight"
    del state[name]
    save_file(state, str(tmp_path / "model.safetensors"))
    load_error(tmp_path, name, "missing")


def test_unexpected_tensor(tmp_path: Path) -> None:
    state = write_ckpt(tmp_path)
    state["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)   # a 9th expert
    save_file(state, str(tmp_path / "model.safetensors"))
    load_error(tmp_path, "model.layers.1.mlp.experts.8.up_proj.weight", "unexpected")


def test_index_names_tensor_its_shard_lacks(tmp_path: Path) -> None:
    write_ckpt(tmp_path, num_shards=3)
    idx = index_of(tmp_path)
    name = "model.norm.weight"
    other = next(v for v in sorted(set(idx["weight_map"].values())) if v != idx["weight_map"][name])
    idx["weight_map"][name] = other
    set_index(tmp_path, idx)
    load_error(tmp_path, name, other)


def test_config_for_other_model_shape(tmp_path: Path) -> None:
    """The checkpoint has 1 MTP layer; a config claiming 2 must name the first missing tensor."""
    write_ckpt(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    load_error(tmp_path, "model.layers.3.", "missing")
