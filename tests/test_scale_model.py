"""`mtp make-scale`: random checkpoints with real DeepSeek-V3-architecture widths, written tensor by tensor
(here at a tiny depth and width), and the engine on them in every weight format; an LLM gives its memory
back when it goes away; the loader holds one copy of the weights."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import greedy, make_engine, run_to_end
from mtp_core import kernels
from mtp_core.loader import load_model
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.scale_model import SHAPES, scale_config_dict, write_scale_checkpoint

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[20 + i, 40 + 3 * i, 70] for i in range(4)]


@pytest.fixture(scope="module")
def moon(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scale") / "moon"
    write_scale_checkpoint(out, "moonlight", num_layers=2, num_mtp=1, width_divisor=16, vocab_size=512,
                           shard_bytes=1 << 20, n_routed_experts=16)
    return out


def test_config_keeps_the_shape(moon) -> None:
    cfg = json.loads((moon / "config.json").read_text())
    full = SHAPES["moonlight"]
    assert cfg["q_lora_rank"] is None and cfg["n_group"] == 1 and cfg["n_shared_experts"] == 2
    assert cfg["num_experts_per_tok"] == full["num_experts_per_tok"] and cfg["num_attention_heads"] == 16
    assert cfg["hidden_size"] == 2048 // 16 and cfg["kv_lora_rank"] == 512 // 16
    assert cfg["num_hidden_layers"] == 2 and cfg["num_nextn_predict_layers"] == 1 and cfg["torch_dtype"] == "bfloat16"
    assert scale_config_dict("deepseek-v3")["q_lora_rank"] == 1536


def test_written_in_shards_with_per_expert_names(moon) -> None:
    index = json.loads((moon / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) > 3                                                     # shard_bytes bounds each file
    for f in shards:
        assert (moon / f).stat().st_size < (1 << 20) + (1 << 19)
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in index           # HF per-expert layout
    assert "model.layers.2.eh_proj.weight" in index                             # the MTP module
    with safe_open(str(moon / index["model.layers.0.self_attn.q_proj.weight"]), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16


def test_deterministic_per_seed(moon, tmp_path) -> None:
    again = write_scale_checkpoint(tmp_path / "again", "moonlight", num_layers=2, num_mtp=1, width_divisor=16,
                                   vocab_size=512, shard_bytes=1 << 20, n_routed_experts=16)
    name = "model.layers.1.mlp.experts.3.gate_proj.weight"
    index = json.loads((moon / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(moon / index[name]), "pt") as a, safe_open(str(again / index[name]), "pt") as b:
        assert torch.equal(a.get_tensor(name), b.get_tensor(name))
    with pytest.raises(ValueError, match="not empty"):
        write_scale_checkpoint(again, "moonlight")
    with pytest.raises(ValueError, match="unknown shape"):
        write_scale_checkpoint(tmp_path / "x", "llama")


@pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_engine_on_the_scale_shape(moon, tmp_path, fmt) -> None:
    """Direct layout (weights in place, run-time absorption, no q_lora, one group, 2 shared experts): greedy
    MTP (Eagle K=2) == greedy without it, with 2 threads, on bf16 / FP8 / NVFP4 weights."""
    from mtp_core.quantize import quantize_checkpoint
    src = moon
    if fmt != "bf16":
        src = tmp_path / fmt
        quantize_checkpoint(moon, src, fmt)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = load_model(src, make_model=DeepseekV3ForCausalLM)[0]
        assert next(model.parameters()).dtype == torch.bfloat16          # --dtype auto keeps the stored dtype
        base = make_engine(model, eos=(), max_batch_size=4)
        assert model.native is not None and model.native.weights.layout == "direct"
        assert len(model.native.weights.layers[0].uk) == 16
        want = [s.output_ids for s in run_to_end(base, PROMPTS, greedy(12))]
        eng = make_engine(model, eos=(), nextn=2, mode="eagle", max_batch_size=4)
        assert [s.output_ids for s in run_to_end(eng, PROMPTS, greedy(12))] == want
    finally:
        torch.set_num_threads(old)


def test_a_deleted_llm_gives_its_memory_back(tiny1_dir) -> None:
    """LLM freezes the GC generation of what it built (fewer re-scans per step); deleting it must still free
    the model and the engine (their reference cycles are collectable again)."""
    from mtp_core.config import LLMConfig
    from mtp_core.llm import LLM
    llm = LLM(LLMConfig(model_dir=str(tiny1_dir), max_batch_size=1))
    model, engine = weakref.ref(llm.model), weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert model() is None and engine() is None
    llm = LLM(LLMConfig(model_dir=str(tiny1_dir), max_batch_size=1))
    model = weakref.ref(llm.model)
    llm.close()
    assert model() is None


PEAK = """
import sys
import torch
from mtp_core.loader import load_model
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.loader.checkpoint import open_checkpoint
with torch.device("meta"):      # torch's one-time set-up of meta construction (~80 MB of imports), not weights
    DeepseekV3ForCausalLM(open_checkpoint(sys.argv[1]).config)
def status(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
open("/proc/self/clear_refs", "w").write("5")          # resets the peak (VmHWM) to the current RSS
before = status("VmRSS:")
model = load_model(sys.argv[1], make_model=DeepseekV3ForCausalLM)[0]
print(before, status("VmHWM:"), status("VmRSS:"))
"""


def test_loading_holds_one_copy(tmp_path) -> None:
    """Loading a ~135 MB bf16 checkpoint in 16 MB shards: resident memory after it is one copy of the weights,
    and the peak one copy plus the shard being read (its file pages are resident while it is mapped)."""
    ckpt = write_scale_checkpoint(tmp_path / "m", "moonlight", num_layers=2, num_mtp=0, width_divisor=2,
                                  vocab_size=2048, n_routed_experts=16, shard_bytes=16 << 20)
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    r = subprocess.run([sys.executable, "-c", PEAK, str(ckpt)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    before, peak, after = map(int, r.stdout.split()[-3:])
    assert size > 100e6, size
    slack = 24 << 20
    assert after - before < 1.05 * size + slack and peak - before < 1.05 * size + (17 << 20) + slack, \
        (size, peak - before, after - before)
