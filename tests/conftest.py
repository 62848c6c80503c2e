"""Shared fixtures for the speculative-decoding and engine tests.

Two tiny random DeepSeek-V3 checkpoints are written once per session with `make_tiny_checkpoint`:

  tiny1_dir   2 main layers, 1 MTP module   (Eagle's natural checkpoint)
  tiny3_dir   3 main layers, 3 MTP modules  (Vanilla's natural checkpoint; Eagle can use module 0)

A randomly initialised MTP module almost never agrees with the target (acceptance length 1.0), which
would make every losslessness test trivially pass. So both checkpoints are "sharpened" after writing:
the token embedding is scaled up (the target becomes mostly a bigram model: its next token depends mainly
on the current token, a little on the context), the final norms and the MTP `enorm`/`shared_head.norm`
weights are set to one, and the embedding half of each `eh_proj` is the identity. An MTP module then
predicts roughly the same bigram, so drafts are accepted part of the time (AL ~1.3-3 depending on K)
and rejected the rest: both branches of verification and rewind run in every test.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig
from mtp_core.engine.engine import Engine
from mtp_core.request.sequence import Sequence
from mtp_core.llm import LLM
from mtp_core.loader import load_model
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.sampling import SamplingParams
from mtp_core.tiny import make_tiny_checkpoint
from mtp_core.tokenizer import Tokenizer

torch.set_num_threads(1)

EMBED_SCALE = 5.0
EOS_ID = 2                      # <｜end▁of▁sentence｜> in the tiny tokenizer (checked when it is written)
THINK_IDS = (5, 6)              # <think>, </think> from Tokenizer.think_token_ids() (checked likewise)

# Prompts as token ids (no tokenizer round trip), lengths 1..23; ids avoid the special tokens 0..6.
PROMPTS: list[list[int]] = [
    [71],
    [46, 75],
    [300, 12, 77, 401, 89],
    [1, 379, 227, 87, 91, 486, 81, 322, 336],
    [150, 151, 152, 153, 154, 155, 156, 157, 158, 159, 160, 161, 162],
    [9, 99, 199, 299, 399, 499, 19, 29, 39, 49, 59, 69, 79, 89, 109, 119, 129, 139, 149, 169, 179, 189, 209],
    [500, 20, 480, 40, 460, 60, 440],
    [250, 251],
]


def _sharpen(path: Path, num_main: int, num_mtp: int) -> None:
    state = load_file(str(path / "model.safetensors"))
    hidden = state["model.norm.weight"].shape[0]
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * EMBED_SCALE
    state["model.norm.weight"] = torch.ones(hidden)
    for k in range(num_mtp):
        p = f"model.layers.{num_main + k}."
        state[p + "enorm.weight"] = torch.ones(hidden)
        state[p + "shared_head.norm.weight"] = torch.ones(hidden)
        eh = state[p + "eh_proj.weight"].clone()           # [H, 2H]: embedding half first
        eh[:, :hidden] = torch.eye(hidden)
        state[p + "eh_proj.weight"] = eh
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def _tiny(tmp_path_factory, name: str, num_layers: int, num_mtp: int, seed: int) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / name
    make_tiny_checkpoint(out, seed=seed, num_layers=num_layers, num_mtp=num_mtp)
    _sharpen(out, num_layers, num_mtp)
    tok = Tokenizer.from_dir(out)
    assert tok.think_token_ids() == THINK_IDS and tok.eos_token_ids[0] == EOS_ID, "tiny tokenizer ids moved"
    return out


@pytest.fixture(scope="session")
def tiny1_dir(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "tiny1", num_layers=2, num_mtp=1, seed=0)


@pytest.fixture(scope="session")
def tiny3_dir(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "tiny3", num_layers=3, num_mtp=3, seed=1)


@pytest.fixture(scope="session")
def tiny1_model(tiny1_dir) -> DeepseekV3ForCausalLM:
    return load_model(tiny1_dir, "float32", make_model=DeepseekV3ForCausalLM)[0]


@pytest.fixture(scope="session")
def tiny3_model(tiny3_dir) -> DeepseekV3ForCausalLM:
    return load_model(tiny3_dir, "float32", make_model=DeepseekV3ForCausalLM)[0]


@pytest.fixture(scope="session")
def models(tiny1_model, tiny3_model) -> dict[str, DeepseekV3ForCausalLM]:
    return {"tiny1": tiny1_model, "tiny3": tiny3_model}


# ---- configs, engines, LLMs ------------------------------------------------------------------

def llm_config(model_dir: str | Path = "", nextn: int = 0, mode: str = "auto", max_tokens_kv: int = 4096,
               tokens_per_block: int = 8, spec: Optional[dict[str, Any]] = None, kv_dtype: str = "auto",
               block_reuse: bool = True, **fields: Any) -> LLMConfig:
    """LLMConfig with a small explicit KV pool; nextn > 0 turns MTP on (mode: auto | eagle | vanilla).

    The draft-length policy is `fixed` here unless `spec` names one: most tests count drafts and steps,
    which the default `cost` policy would make depend on this machine's timings (tests/test_policy.py runs
    the cost policy, with measured and with scripted costs)."""
    spec_cfg = SpeculativeConfig(num_nextn_predict_layers=nextn, mtp_mode=mode,
                                 **{"draft_len_policy": "fixed", **(spec or {})}) if nextn else None
    fields.setdefault("overlap_scheduler_on_cpu", True)     # keep the overlap path under test on CPU
    fields.setdefault("dtype", "float32")
    return LLMConfig(model_dir=str(model_dir), speculative_config=spec_cfg,
                     kv_cache_config=KvCacheConfig(max_tokens=max_tokens_kv, tokens_per_block=tokens_per_block,
                                                   dtype=kv_dtype, enable_block_reuse=block_reuse),
                     **fields)


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., LLM]:
    """make_llm(model_dir, nextn=0, mode="auto", max_tokens_kv=..., tokens_per_block=..., **LLMConfig fields)."""
    def build(model_dir: str | Path, **kw: Any) -> LLM:
        return LLM(llm_config(model_dir, **kw))
    return build


def make_engine(model: DeepseekV3ForCausalLM, eos: tuple[int, ...] = (EOS_ID,),
                think_ids: Optional[tuple[int, int]] = THINK_IDS, drafter: Any = None, **kw: Any) -> Engine:
    """An Engine over an already loaded model (shared weights, its own KV pool)."""
    return Engine(model, llm_config(**kw), list(eos), think_ids, drafter=drafter)


def run_to_end(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               max_steps: int = 10_000) -> list[Sequence]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(p, replace(sp)) for p, sp in zip(prompts, plist)]
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished(), "engine did not finish within max_steps"
    return seqs


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


_REF_CACHE: dict[tuple, list[int]] = {}


def reference(model: DeepseekV3ForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy nextn=0, one request at a time (ignore_eos): the ground truth every test compares with."""
    key = (id(model), tuple(prompt), max_tokens)
    if key not in _REF_CACHE:
        eng = make_engine(model, max_batch_size=1)
        _REF_CACHE[key] = list(run_to_end(eng, [prompt], greedy(max_tokens))[0].output_ids)
    return _REF_CACHE[key]


class OracleDrafter:
    """Forced drafter: proposes the target's own future tokens (from a precomputed nextn=0 greedy run),
    with the first `num_right(seq, step)` drafts right and the rest deliberately wrong.

    futures[request_id] = prompt + reference output. A wrong draft is (right token + 1) mod vocab, which
    differs from the target's choice by construction. Past the end of the reference it pads with `pad`."""

    def __init__(self, num_draft_tokens: int, vocab_size: int,
                 num_right: Optional[Callable[[Sequence], int]] = None, pad: int = 7) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.vocab_size = vocab_size
        self.futures: dict[int, list[int]] = {}
        self.num_right = num_right or (lambda seq: num_draft_tokens)
        self.pad = pad
        self.calls = 0              # rows for which drafts were proposed

    def propose(self, rows: list) -> list[list[int]]:
        out: list[list[int]] = []
        for r in rows:
            if not r.needs_drafts:
                out.append([])
                continue
            self.calls += 1
            fut = self.futures[r.seq.request_id]
            n = len(r.seq.all_ids)
            right = [fut[i] if i < len(fut) else self.pad for i in range(n, n + self.num_draft_tokens)]
            k = max(0, min(self.num_right(r.seq), self.num_draft_tokens))
            out.append(right[:k] + [(t + 1) % self.vocab_size for t in right[k:]])
        return out
