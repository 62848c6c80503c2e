"""Quantized checkpoint formats: DeepSeek FP8 block scaling and ModelOpt NVFP4.

The loader asks a `QuantFormat` which checkpoint tensors make up one linear weight, then either
dequantizes them to float32 at load (`dequantize`) or wraps them in a module that keeps them packed
and dequantizes per forward (`make_linear`). Both give bit-identical outputs.

    fmt = detect_quant_format(model_dir, config_raw)          # None for a bf16/fp32 checkpoint
    names = fmt.tensor_names("model.layers.0.mlp.down_proj.weight", available)
    weight = fmt.dequantize(name, {n: read(n) for n in names}, (hidden, intermediate))  # [N, K] f32

Whether a weight is quantized is decided per tensor by the companions present in the checkpoint
(`weight_scale_inv` for FP8, `weight_scale` for NVFP4), not by name patterns: real checkpoints leave
routers, embeddings, `lm_head` and (NVFP4) attention in bf16.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import torch


def describe(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> str:
    """'[2, 3] float32': the spelling used in every shape/dtype error."""
    return f"[{', '.join(str(int(d)) for d in shape)}] {str(dtype).removeprefix('torch.')}"


def expect_tensor(name: str, tensors: dict[str, torch.Tensor], shape: tuple[int, ...],
                  dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """Return tensors[name] after checking it is present with this shape and one of these dtypes."""
    if name not in tensors:
        raise ValueError(f"{name}: missing from the checkpoint (expected {describe(shape, dtypes[0])})")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        raise ValueError(f"{name}: expected shape {describe(shape, dtypes[0])}, "
                         f"got {describe(t.shape, t.dtype)}")
    return t


def expect_scalar(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A float32 scalar stored as shape [] or [1] (both occur in ModelOpt exports); returns shape []."""
    if name not in tensors:
        raise ValueError(f"{name}: missing from the checkpoint (expected [] float32)")
    t = tensors[name]
    if t.dtype != torch.float32 or tuple(t.shape) not in ((), (1,)):
        raise ValueError(f"{name}: expected shape [] float32, got {describe(t.shape, t.dtype)}")
    return t.reshape(())


_PACKED_DTYPES = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8}


def dense_weight(weight_name: str, tensors: dict[str, torch.Tensor], expected_shape: tuple[int, int],
                 missing_companion: str) -> torch.Tensor:
    """An unquantized weight as float32 [N, K]; a packed dtype here means its scale tensor is missing."""
    w = tensors.get(weight_name)
    if w is None:
        raise ValueError(f"{weight_name}: missing from the checkpoint")
    if w.dtype in _PACKED_DTYPES or not w.is_floating_point():
        raise ValueError(f"{missing_companion}: missing from the checkpoint, but {weight_name} is "
                         f"{describe(w.shape, w.dtype)} and cannot be used without it")
    if tuple(w.shape) != tuple(expected_shape):
        raise ValueError(f"{weight_name}: expected shape {describe(expected_shape, w.dtype)}, "
                         f"got {describe(w.shape, w.dtype)}")
    return w.to(torch.float32)


def check_expected_shape(weight_name: str, expected_shape: tuple[int, int]) -> tuple[int, int]:
    if len(expected_shape) != 2 or min(expected_shape) <= 0:
        raise ValueError(f"{weight_name}: quantized weights must be 2-D linear weights, "
                         f"got expected shape {list(expected_shape)}")
    return int(expected_shape[0]), int(expected_shape[1])


@dataclass(frozen=True)
class QuantFormat(ABC):
    """One checkpoint quantization scheme. Subclasses: Fp8BlockFormat, Nvfp4Format."""

    name: str

    @abstractmethod
    def is_quantized(self, weight_name: str, available: set[str]) -> bool:
        """True when the checkpoint holds this weight's scale tensors."""

    @abstractmethod
    def tensor_names(self, weight_name: str, available: set[str]) -> list[str]:
        """Checkpoint tensors that make up this weight. Required companions are listed even when
        absent from `available` (read those present; `dequantize` names any that are missing);
        optional ones (NVFP4 `input_scale`) only when present."""

    @abstractmethod
    def dequantize(self, weight_name: str, tensors: dict[str, torch.Tensor],
                   expected_shape: tuple[int, int]) -> torch.Tensor:
        """float32 [N, K]. Validates every tensor; ValueError names the offending tensor."""

    @abstractmethod
    def make_linear(self, weight_name: str, tensors: dict[str, torch.Tensor],
                    expected_shape: tuple[int, int], device: torch.device | str | None = None,
                    use_deep_gemm: bool | None = None) -> torch.nn.Module:
        """A bias-free linear [..., K] -> [..., N] that keeps the packed tensors and dequantizes in
        forward; output equals F.linear(x, dequantize(...).to(x.dtype)) bit for bit (except the
        optional DeepGEMM FP8 path, which quantizes activations). Its `.weight` is the dequantized
        float32 [N, K] weight (computed per access), for model code that reads weights directly.
        An unquantized weight gives a plain nn.Linear."""


# Imported after QuantFormat and the helpers above because the format modules subclass/use them.
from mtp_core.loader.quant.fp8 import Fp8BlockFormat  # noqa: E402
from mtp_core.loader.quant.nvfp4 import Nvfp4Format  # noqa: E402

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
