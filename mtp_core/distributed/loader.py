"""Loading one rank's shard of a DeepSeek-V3 checkpoint: each rank reads only its own slices.

Same checks as `mtp_core.loader.load_model` (every tensor the full model needs is present with the
right shape, nothing unexplained is left over), run against the *full* model, then only the
tensors and slices this rank holds are read, memory-mapped. Quantized weights are dequantized at
load, or with keep_quantized kept packed when the slice falls on the scale grid (see
sharded_read.py); VocabParallelEmbedding / ParallelLMHead are always dense.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

from mtp_core.distributed.layers import ParallelLMHead, Shard
from mtp_core.distributed.parallel_state import ParallelState
from mtp_core.distributed.shard import collect_shards, shard_model
from mtp_core.distributed.sharded_read import Opener, packed_full_shape, read_quant_slice, read_slice
from mtp_core.loader.checkpoint import Checkpoint, open_checkpoint
from mtp_core.loader.quant import QuantFormat, detect_quant_format
from mtp_core.loader.quant.linear import make_linear
from mtp_core.loader.weights import _linear_weight_names, check_tensor_names, resolve_dtype
from mtp_core.model import DeepseekV3ForCausalLM

log = logging.getLogger("mtp.distributed.loader")


def _check_header_shape(ckpt: Checkpoint, name: str, shape: tuple[int, ...]) -> None:
    got = tuple(ckpt.shard_tensors[ckpt.shards[name]][name]["shape"])
    if got != tuple(shape):
        raise ValueError(f"tensor {name} in {ckpt.shards[name].name} has shape {list(got)}, expected {list(shape)}")


def load_model_sharded(model_dir: str | Path, dtype: str, device: str, par: ParallelState,
                       progress: Optional[Callable[[int, int], None]] = None,
                       keep_quantized: bool = False) -> tuple[DeepseekV3ForCausalLM, Checkpoint]:
    """This rank's shard of the model in model_dir (no collective: ranks load independently)."""
    ckpt = open_checkpoint(model_dir)
    quant = detect_quant_format(ckpt.model_dir, ckpt.config.raw)
    torch_dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(ckpt.config)
    full = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    linears = _linear_weight_names(model)
    available = set(ckpt.shards)
    parts = {n: (quant.tensor_names(n, available) if quant is not None and n in linears else [n]) for n in full}
    check_tensor_names(ckpt, full, parts)
    shard_model(model, par)
    shards = collect_shards(model)
    dense_only = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, ParallelLMHead)}
    local = {n: tuple(t.shape) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    state, packed_modules = _read_local(ckpt, quant, local, full, parts, shards, linears, dense_only, torch_dtype,
                                        device, keep_quantized, progress)
    for mod_name, mod in packed_modules.items():
        parent, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent), attr, mod)
    model.load_state_dict(state, strict=False, assign=True)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not left, f"tensors left unloaded: {left[:3]}"
    model.rope.inv_freq = model.rope.inv_freq.to(device)
    model.requires_grad_(False)
    model.eval()
    log.info("rank %d/%d loaded %d tensors (%d kept packed) from %s as %s", par.rank, par.world_size, len(local),
             len(packed_modules), ckpt.model_dir, str(torch_dtype).replace("torch.", ""))
    return model, ckpt


def _read_local(ckpt: Checkpoint, quant: Optional[QuantFormat], local: dict, full: dict, parts: dict, shards: dict,
                linears: set, dense_only: set, torch_dtype: torch.dtype, device: str, keep_quantized: bool,
                progress: Optional[Callable[[int, int], None]]) -> tuple[dict[str, torch.Tensor],
                                                                         dict[str, torch.nn.Module]]:
    """This rank's tensors (`local`: name -> its shard's shape), read slice by slice: (state dict, modules kept
    packed by module name)."""
    state: dict[str, torch.Tensor] = {}
    packed_modules: dict[str, torch.nn.Module] = {}
    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def open_for(tensor: str):
            path = ckpt.shards[tensor]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            return handles[path]

        for i, (name, shape) in enumerate(sorted(local.items())):
            keep_fp32 = name.endswith("e_score_correction_bias") or name.endswith("gate.weight")
            target = torch.float32 if keep_fp32 else torch_dtype
            shard = shards.get(name)
            if quant is not None and parts[name] != [name]:
                _check_header_shape(ckpt, name, packed_full_shape(quant, full[name]))   # type: ignore[arg-type]
                module = _load_quantized(open_for, quant, name, parts[name], full[name], shard, shape, device,
                                         keep_quantized and name not in dense_only)
                if isinstance(module, torch.nn.Module):
                    packed_modules[name[: -len(".weight")]] = module
                else:
                    state[name] = module.to(device=device, dtype=target)
            else:
                _check_header_shape(ckpt, name, full[name])
                t = read_slice(open_for(name), name, shard)
                if shard is not None and shard.zero:
                    t = torch.zeros_like(t)
                if quant is not None and name in linears:   # refuses a packed weight whose scales are missing
                    t = quant.dequantize(name, {name: t}, shape)             # type: ignore[arg-type]
                state[name] = t.to(device=device, dtype=target, copy=True)   # aligned, as load_model
            if progress:
                progress(i + 1, len(local))
    return state, packed_modules


def _load_quantized(open_for: Opener, quant: QuantFormat, name: str, names: list[str], full_shape: tuple[int, int],
                    shard: Optional[Shard], local_shape: tuple[int, int], device: str,
                    keep_packed: bool) -> torch.nn.Module | torch.Tensor:
    """A packed module (keep_packed and the slice is on the scale grid) or the dequantized slice [n, k]."""
    piece = read_quant_slice(open_for, quant, name, names, full_shape, shard)
    if keep_packed and piece.aligned:
        return make_linear(quant, name, piece.tensors, piece.shape, device=device)
    w = quant.dequantize(name, piece.tensors, piece.shape)                   # [n', k'] float32
    if piece.narrow is not None:
        w = w.narrow(piece.narrow.dim, piece.narrow.lo, piece.narrow.hi - piece.narrow.lo)
    assert tuple(w.shape) == tuple(local_shape), f"{name}: sliced to {list(w.shape)}, expected {list(local_shape)}"
    return w.contiguous()
