"""Reference parity with Hugging Face transformers' DeepSeek-V3, and the MTP module layout.

Every tiny checkpoint is written by mtp_core.tiny with std=0.1 weights: at the default std=0.02 attention
is nearly uniform and YaRN / rope layout changes move logits by ~1e-3 only, so a broken rope could pass
a 1e-4 check; at 0.1 they move logits by > 1.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from mtp_core.config import ModelConfig  # noqa: E402
from mtp_core.loader import load_model  # noqa: E402
from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM  # noqa: E402
from mtp_core.tiny import init_weights, make_tiny_checkpoint, tiny_config_dict, write_weights  # noqa: E402

VOCAB = 160                     # distinct from every other dimension of the tiny model
STD = 0.1
TOL = 1e-4


def write_ckpt(d: Path, seed: int = 0, **cfg_kw) -> Path:
    overrides = cfg_kw.pop("overrides", {})
    cfg = tiny_config_dict(VOCAB, **cfg_kw)
    cfg.update(overrides)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(cfg))
    init_weights(model, seed, std=STD)
    write_weights(d, model.state_dict())
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def load_hf(d: Path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True, torch_dtype=torch.float32).eval()


@torch.no_grad()
def paged_greedy(model: DeepseekV3ForCausalLM, prompt: list[int], steps: int, tokens_per_block: int = 4
                 ) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Prefill the prompt (naive MLA), then `steps` greedy decode steps (absorbed MLA), one token each,
    on a shuffled block table. -> prompt logits [P, V], per-step logits [V] x steps, generated ids."""
    cfg = model.config
    n_blocks = (len(prompt) + steps) // tokens_per_block + 2
    table = list(range(n_blocks))[::-1]                     # non-contiguous, reversed block order
    caches = [torch.full((n_blocks, tokens_per_block, cfg.kv_cache_dim), float("nan"))
              for _ in range(len(model.model.layers))]      # NaN: reading an unwritten slot would show
    meta = AttentionMetadata.build([list(range(len(prompt)))], [table], tokens_per_block, use_absorbed=False)
    prompt_logits = model.compute_logits(model(torch.tensor(prompt), meta, caches))     # [P, V]
    step_logits, out = [prompt_logits[-1]], [int(prompt_logits[-1].argmax())]
    for i in range(steps - 1):
        pos = len(prompt) + i
        meta = AttentionMetadata.build([[pos]], [table], tokens_per_block, use_absorbed=True)
        logits = model.compute_logits(model(torch.tensor([out[-1]]), meta, caches))[0]  # [V]
        step_logits.append(logits)
        out.append(int(logits.argmax()))
    return prompt_logits, step_logits, out


CASES = {
    "qlora_rope_interleave": dict(q_lora_rank=32, yarn=False, rope_interleave=True, n_group=2),
    "noqlora_yarn_nointerleave": dict(q_lora_rank=None, yarn=True, rope_interleave=False, n_group=2),
    "qlora_yarn_interleave_4groups": dict(q_lora_rank=32, yarn=True, rope_interleave=True, n_group=4,
                                          overrides={"topk_group": 2, "num_experts_per_tok": 3}),
    "noqlora_rope_nointerleave_1group": dict(q_lora_rank=None, yarn=False, rope_interleave=False, n_group=1,
                                             num_layers=3, first_k_dense=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_decode_match_transformers(tmp_path: Path, case: str) -> None:
    d = write_ckpt(tmp_path, seed=len(case), **dict(CASES[case]))
    ours, _ = load_model(d, "float32", make_model=DeepseekV3ForCausalLM)
    hf = load_hf(d)
    prompt = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(7))
    steps = 6
    with torch.no_grad():
        ref_prompt = hf(prompt).logits[0]                                           # [P, V]
        gen = hf.generate(prompt, max_new_tokens=steps, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    assert ref_prompt.abs().max() > 1.0                     # weights large enough for rope to matter
    dense = ours.compute_logits(ours.forward_dense(prompt))[0]
    assert (dense - ref_prompt).abs().max() <= TOL
    p_logits, s_logits, ids = paged_greedy(ours, prompt[0].tolist(), steps)
    assert (p_logits - ref_prompt).abs().max() <= TOL
    ref_ids = gen.sequences[0, prompt.shape[1]:].tolist()
    assert ids == ref_ids
    for ours_step, hf_step in zip(s_logits, gen.logits):
        assert (ours_step - hf_step[0]).abs().max() <= TOL


def test_llm_greedy_text_matches_transformers(tmp_path: Path) -> None:
    """End to end through mtp_core.llm.LLM (tokenizer, scheduler, paged cache) vs HF generate."""
    from mtp_core.config import KvCacheConfig, LLMConfig
    from mtp_core.llm import LLM
    from mtp_core.sampling import SamplingParams
    from tokenizers import Tokenizer as HFTokenizer

    d = make_tiny_checkpoint(tmp_path / "ck", seed=3, yarn=True)
    cfg = ModelConfig.from_file(d / "config.json")
    model = DeepseekV3ForCausalLM(cfg)
    init_weights(model, 3, std=STD)                         # larger weights than the default checkpoint
    (d / "model.safetensors").unlink()
    write_weights(d, model.state_dict())
    llm = LLM(LLMConfig(model_dir=str(d), kv_cache_config=KvCacheConfig(max_tokens=256, tokens_per_block=4)))
    out = llm.generate(["the cat sat on the mat and"], SamplingParams(max_tokens=10, temperature=0.0))[0]
    hf = load_hf(d)
    with torch.no_grad():
        seq = hf.generate(torch.tensor([out.prompt_token_ids]), max_new_tokens=10, do_sample=False,
                          pad_token_id=cfg.eos_token_id)[0, len(out.prompt_token_ids):].tolist()
    if cfg.eos_token_id in seq:                             # HF keeps the eos token; stop there too
        seq = seq[:seq.index(cfg.eos_token_id) + 1]
    assert out.token_ids == seq
    hf_tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
    assert out.text == hf_tok.decode(seq, skip_special_tokens=True)


# ---- a directory written by transformers itself ---------------------------------------------------

def _hf_saved_dir(tmp_path: Path, rope_parameters: dict) -> tuple[Path, object]:
    from transformers import DeepseekV3Config
    from transformers import DeepseekV3ForCausalLM as HFModel
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=2, topk_group=1,
        num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256, num_mtp_layers=0,
        rope_parameters=rope_parameters, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    hf = HFModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else STD * noise)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    hf.save_pretrained(str(tmp_path))
    return tmp_path, hf


def _check_hf_saved(d: Path, hf) -> None:
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # transformers 5.x reverts its fused experts to the per-expert checkpoint names when saving
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    ours, _ = load_model(d, "float32", make_model=DeepseekV3ForCausalLM)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours.compute_logits(ours.forward_dense(ids))
    assert (got - ref).abs().max() <= TOL


def test_loads_transformers_save_pretrained_default_rope(tmp_path: Path) -> None:
    d, hf = _hf_saved_dir(tmp_path, {"rope_type": "default", "rope_theta": 10000.0})
    _check_hf_saved(d, hf)


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 500.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
     "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0},
], ids=["theta500", "yarn"])
def test_loads_transformers_save_pretrained_rope_parameters(tmp_path: Path, rope: dict) -> None:
    d, hf = _hf_saved_dir(tmp_path, rope)
    _check_hf_saved(d, hf)


# ---- MTP modules -----------------------------------------------------------------------------------

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _hf_decoder_layer(d: Path, layer, layer_idx: int):
    """transformers' DeepseekV3DecoderLayer holding the weights of our `layer` (an independent reference)."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer
    hcfg = AutoConfig.from_pretrained(str(d), local_files_only=True)
    hcfg._attn_implementation = "eager"
    ref = DeepseekV3DecoderLayer(hcfg, layer_idx).eval()
    sd = {k: v for k, v in layer.state_dict().items() if not k.startswith("mlp.experts.")}
    experts = layer.mlp.experts
    sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts])
    sd["mlp.experts.down_proj"] = torch.stack([e.down_proj.weight for e in experts])
    ref_sd = ref.state_dict()
    assert set(ref_sd) <= set(sd)
    ref.load_state_dict({k: sd[k] for k in ref_sd}, strict=True)
    return ref, hcfg


def test_mtp_module_layout_and_sharing(tmp_path: Path) -> None:
    d = write_ckpt(tmp_path, num_layers=2, num_mtp=2)
    L = 2
    # checkpoint copies of the shared embedding / head at the MTP layers are accepted and ignored
    from safetensors.torch import load_file, save_file
    st = load_file(str(d / "model.safetensors"))
    for k in range(2):
        st[f"model.layers.{L + k}.embed_tokens.weight"] = torch.randn(VOCAB, 64)
        st[f"model.layers.{L + k}.shared_head.head.weight"] = torch.randn(VOCAB, 64)
    save_file(st, str(d / "model.safetensors"))
    model, _ = load_model(d, "float32", make_model=DeepseekV3ForCausalLM)
    assert model.num_mtp_modules == 2
    for k in range(2):
        mtp = model.mtp_module(k)
        assert mtp is model.model.layers[L + k]
        names = {n for n, _ in mtp.named_parameters()}
        assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"} <= names
        assert not any("embed_tokens" in n or "shared_head.head" in n for n in names), names
        assert not any(p.shape[0] == VOCAB for p in mtp.parameters())    # no vocab-sized copy
        assert mtp.eh_proj.weight.shape == (64, 128)
        assert torch.equal(mtp.enorm.weight, st[f"model.layers.{L + k}.enorm.weight"])
        assert torch.equal(mtp.eh_proj.weight, st[f"model.layers.{L + k}.eh_proj.weight"])
        assert torch.equal(mtp.shared_head.norm.weight, st[f"model.layers.{L + k}.shared_head.norm.weight"])
    # one embedding and one head in memory, the checkpoint's main copies
    vocab_sized = [n for n, p in model.named_parameters(remove_duplicate=False) if p.shape[0] == VOCAB]
    assert sorted(vocab_sized) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, st["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, st["lm_head.weight"])


def test_mtp_forward_dense_matches_formula(tmp_path: Path) -> None:
    d = write_ckpt(tmp_path, num_layers=2, num_mtp=1, yarn=True)
    model, _ = load_model(d, "float32", make_model=DeepseekV3ForCausalLM)
    L = 2
    mtp = model.mtp_module(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    h = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5))          # [B, S, hidden]
    with torch.no_grad():
        got = model.mtp_forward_dense(0, ids, h)
        emb = model.model.embed_tokens.weight[ids]
        x = torch.cat([_rms(emb, mtp.enorm.weight), _rms(h, mtp.hnorm.weight)], -1) @ mtp.eh_proj.weight.T
        ref_layer, hcfg = _hf_decoder_layer(d, mtp, L)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
        pos = torch.arange(9)[None]
        cos_sin = DeepseekV3RotaryEmbedding(hcfg)(x, pos)
        mask = torch.full((9, 9), float("-inf")).triu(1)[None, None]                   # [1, 1, S, S]
        x = ref_layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        want = _rms(x, mtp.shared_head.norm.weight)
    assert got.shape == (2, 9, 64)
    assert (got - want).abs().max() <= 1e-5
    # the head is the main lm_head
    assert torch.allclose(model.compute_logits(got), F.linear(want, model.lm_head.weight), atol=1e-4)
