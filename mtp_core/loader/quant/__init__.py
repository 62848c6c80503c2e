"""Quantized checkpoint formats: DeepSeek FP8 block scaling and ModelOpt NVFP4.

The loader asks a `QuantFormat` which checkpoint tensors make up one linear weight, then either
dequantizes them to float32 at load (`dequantize`) or wraps them in a module that keeps them packed
and dequantizes per forward (`linear.make_linear`). Both give bit-identical outputs.

    fmt = detect_quant_format(model_dir, config_raw)          # None for a bf16/fp32 checkpoint
    names = fmt.tensor_names("model.layers.0.mlp.down_proj.weight", available)
    weight = fmt.dequantize(name, {n: read(n) for n in names}, (hidden, intermediate))  # [N, K] f32

Whether a weight is quantized is decided per tensor by the companions present in the checkpoint
(`weight_scale_inv` for FP8, `weight_scale` for NVFP4), not by name patterns: real checkpoints leave
routers, embeddings, `lm_head` and (NVFP4) attention in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtp_core.loader.quant.base import (QuantFormat, check_expected_shape, dense_weight, describe, expect_scalar,
                                        expect_tensor)
from mtp_core.loader.quant.fp8 import Fp8BlockFormat
from mtp_core.loader.quant.nvfp4 import Nvfp4Format

# Scales of quantized KV caches / attention outputs: the loader does not use them.
_IGNORABLE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale",
                       ".output_scale")


def ignorable_tensor(name: str) -> bool:
    """Checkpoint tensors that the loader may skip (KV-cache and attention-probability scales)."""
    return name.endswith(_IGNORABLE_SUFFIXES)


def _modelopt_format(cfg: dict, source: str) -> Nvfp4Format:
    section = cfg.get("quantization", cfg)
    if not isinstance(section, dict):
        raise ValueError(f"{source}: 'quantization' must be an object")
    algo = str(section.get("quant_algo") or "").upper()
    if algo != "NVFP4":
        raise ValueError(f"{source}: ModelOpt quant_algo {algo or 'None'!r} is not supported "
                         f"(supported: NVFP4); use an NVFP4 or DeepSeek FP8 checkpoint")
    return Nvfp4Format.from_modelopt_section(section, source)


def detect_quant_format(model_dir: Path, config_raw: dict) -> QuantFormat | None:
    """The format of the checkpoint in model_dir, from config.json's quantization_config and/or
    hf_quant_config.json; None when unquantized. ValueError for unsupported methods."""
    hf_path = Path(model_dir) / "hf_quant_config.json"
    qc = config_raw.get("quantization_config")
    found: QuantFormat | None = None
    if hf_path.is_file():
        try:
            hf_cfg = json.loads(hf_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{hf_path}: not valid JSON ({e})") from None
        found = _modelopt_format(hf_cfg, str(hf_path))
    if qc is None:
        return found
    if not isinstance(qc, dict):
        raise ValueError("config.json: quantization_config must be an object")
    method = str(qc.get("quant_method") or "").lower()
    if method == "fp8":
        if found is not None:
            raise ValueError(f"config.json says fp8 but {hf_path} says NVFP4; remove one of them")
        return Fp8BlockFormat.from_quantization_config(qc)
    if method.startswith("modelopt"):
        return found if found is not None else _modelopt_format(qc, "config.json quantization_config")
    raise ValueError(f"config.json: quantization_config.quant_method {qc.get('quant_method')!r} is "
                     f"not supported (supported: fp8 with weight_block_size, modelopt NVFP4)")


__all__ = ["QuantFormat", "Fp8BlockFormat", "Nvfp4Format", "detect_quant_format",
           "ignorable_tensor", "describe", "expect_tensor", "expect_scalar", "dense_weight",
           "check_expected_shape"]
