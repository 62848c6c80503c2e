"""Reading one rank's slice of a checkpoint tensor, memory-mapped (`safe_open(...).get_slice`), for
plain, DeepSeek FP8-block and NVFP4 weights.

A quantized weight is sliced together with its scales. When the slice boundaries fall on the
scale grid (FP8: multiples of the 128-row / 128-column block; NVFP4: any row, or columns on
multiples of the 16-wide group) the packed slice plus its scale slice is itself a valid quantized
tensor: it can stay packed. Otherwise the reader widens the slice to the enclosing grid cells,
reads those, and the caller dequantizes and narrows (the result is the same numbers as slicing the
fully dequantized weight, since dequantization is elementwise).

Worked example, FP8 [300, 256] weight, scales [3, 2], rows [100, 200): the enclosing blocks are
rows [0, 256) -> packed rows 0..255 and scale rows 0..1 are read; after dequantizing, rows
100..199 of that [256, 256] piece are kept. Rows [128, 256) would be read as-is and stay packed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mtp_core.distributed.layers import Shard
from mtp_core.loader.quant import Fp8BlockFormat, Nvfp4Format, QuantFormat

Opener = Callable[[str], Any]      # checkpoint tensor name -> an open safe_open handle holding it


def read_slice(f: Any, name: str, shard: Optional[Shard]) -> torch.Tensor:
    """The whole tensor, or rows / columns [lo, hi) of it, read from an open safetensors handle."""
    if shard is None:
        return f.get_tensor(name)
    s = f.get_slice(name)
    if shard.dim == 0:
        return s[shard.lo:shard.hi]
    if shard.dim == 1:
        return s[:, shard.lo:shard.hi].contiguous()
    raise ValueError(f"{name}: only row (dim 0) or column (dim 1) slices are supported, got dim {shard.dim}")


@dataclass
class QuantSlice:
    tensors: dict[str, torch.Tensor]   # checkpoint name -> the enclosing-grid slice of that tensor
    shape: tuple[int, int]             # the dequantized shape of `tensors`
    narrow: Optional[Shard]            # what to keep of the dequantized piece; None = exactly the slice

    @property
    def aligned(self) -> bool:
        return self.narrow is None


def _grid(lo: int, hi: int, cell: int, size: int) -> tuple[int, int]:
    """[lo, hi) widened to whole cells of `cell`, clipped to size."""
    return lo - lo % cell, min(-(-hi // cell) * cell, size)


def read_quant_slice(open_for: Opener, fmt: QuantFormat, name: str, names: list[str],
                     full_shape: tuple[int, int], shard: Optional[Shard]) -> QuantSlice:
    """Slice of a quantized linear weight `name` ([N, K] when dequantized) and its companion tensors
    `names` (fmt.tensor_names). Scalars (NVFP4 weight_scale_2 / input_scale) are read whole."""
    n, k = full_shape
    if shard is None:
        return QuantSlice({t: open_for(t).get_tensor(t) for t in names}, (n, k), None)
    if isinstance(fmt, Fp8BlockFormat):
        bn, bk = fmt.block_size
        cell, pack, scale_cell = (bn, 1, bn) if shard.dim == 0 else (bk, 1, bk)
        scale_name = fmt.scale_name(name)
    elif isinstance(fmt, Nvfp4Format):
        g = fmt.group_size
        cell, pack, scale_cell = (1, 1, 1) if shard.dim == 0 else (g, 2, g)
        scale_name = fmt.companion_names(name)[0]
    else:
        raise ValueError(f"{name}: sharded reading of {fmt.name} checkpoints is not supported")
    size = n if shard.dim == 0 else k
    lo, hi = _grid(shard.lo, shard.hi, cell, size)
    tensors: dict[str, torch.Tensor] = {}
    for t in names:
        f = open_for(t)
        if t == name:
            tensors[t] = read_slice(f, t, Shard(shard.dim, lo // pack, -(-hi // pack)))
        elif t == scale_name:
            tensors[t] = read_slice(f, t, Shard(shard.dim, lo // scale_cell, -(-hi // scale_cell)))
        else:
            tensors[t] = f.get_tensor(t)
    shape = (hi - lo, k) if shard.dim == 0 else (n, hi - lo)
    narrow = None if (lo, hi) == (shard.lo, shard.hi) else Shard(shard.dim, shard.lo - lo, shard.hi - lo)
    return QuantSlice(tensors, shape, narrow)


def packed_full_shape(fmt: QuantFormat, full_shape: tuple[int, int]) -> tuple[int, int]:
    """Shape the checkpoint stores for a quantized weight of dequantized shape [N, K]."""
    if isinstance(fmt, Nvfp4Format):
        return full_shape[0], full_shape[1] // 2
    return full_shape
