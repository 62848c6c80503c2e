"""Quantized checkpoints written by `mtp quantize` load exactly and run through the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtp_core.loader import load_model
from mtp_core.loader.quant.fp8 import dequantize_fp8_block
from mtp_core.loader.quant.nvfp4 import dequantize_nvfp4
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.quantize import quantize_checkpoint
from mtp_core.tiny import make_tiny_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("q") / "src", num_mtp=1, seed=5)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_loaded_weights_equal_reference_dequantization(src: Path, tmp_path: Path, fmt: str) -> None:
    out = tmp_path / fmt
    quantize_checkpoint(src, out, fmt)
    raw = load_file(str(out / "model.safetensors"))
    model, _ = load_model(out, keep_quantized=False, make_model=DeepseekV3ForCausalLM)
    params = dict(model.named_parameters())
    checked = 0
    for name, w in raw.items():
        if fmt == "fp8" and name.endswith(".weight") and w.dtype == torch.float8_e4m3fn:
            ref = dequantize_fp8_block(w, raw[name + "_scale_inv"])
        elif fmt == "nvfp4" and name.endswith(".weight") and w.dtype == torch.uint8:
            ref = dequantize_nvfp4(w, raw[name[:-7] + ".weight_scale"], raw[name[:-7] + ".weight_scale_2"])
        else:
            continue
        assert torch.equal(params[name], ref.float()), name
        checked += 1
    assert checked > 5
    # keep-quantized modules give the same logits bit for bit
    kept, _ = load_model(out, keep_quantized=True, make_model=DeepseekV3ForCausalLM)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2]])
    with torch.no_grad():
        a = model.compute_logits(model.forward_dense(ids)[0])
        b = kept.compute_logits(kept.forward_dense(ids)[0])
    assert torch.equal(a, b)


def test_missing_scale_names_the_tensor(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    quantize_checkpoint(src, out, "fp8")
    tensors = load_file(str(out / "model.safetensors"))
    victim = next(n for n in tensors if n.endswith("weight_scale_inv"))
    del tensors[victim]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_model(out, make_model=DeepseekV3ForCausalLM)


def test_wrong_scale_shape_names_the_tensor(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "nv"
    quantize_checkpoint(src, out, "nvfp4")
    tensors = load_file(str(out / "model.safetensors"))
    victim = next(n for n in tensors if n.endswith(".weight_scale"))
    tensors[victim] = tensors[victim][:, :1].contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        load_model(out, make_model=DeepseekV3ForCausalLM)
    assert json.loads((out / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
