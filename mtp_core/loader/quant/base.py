"""What every quantized checkpoint format offers the loader (`QuantFormat`), and the checks they share.

A format names the checkpoint tensors of one linear weight (`tensor_names`), dequantizes them to float32
(`dequantize`) or hands them over still packed (`packed`), for a keep-quantized linear module
(quant/linear.py: `make_linear`). The formats themselves: fp8.py (DeepSeek FP8 block), nvfp4.py (ModelOpt
NVFP4); both subclass `QuantFormat` from here, and nothing here imports them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

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
    def packed(self, weight_name: str, tensors: dict[str, torch.Tensor],
               expected_shape: tuple[int, int]) -> tuple[torch.Tensor, ...] | None:
        """The weight's packed tensors as a keep-quantized linear holds them (quant/linear.py: make_linear),
        validated like `dequantize`; None when the checkpoint left this weight unquantized."""
