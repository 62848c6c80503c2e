"""Loading safetensors weights into a model that the caller builds (`make_model`: a config -> an nn.Module on
the meta device, DeepseekV3ForCausalLM in this project; the loader never imports the model package).

Every parameter and persistent buffer of the model must be present with the right shape; any other
tensor in the checkpoint is an error unless it is a known-ignorable one (the per-MTP-layer copies of the
embedding and head, which we share with the main model, and rotary caches).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import torch
from safetensors import safe_open

from mtp_core.config import ModelConfig
from mtp_core.loader.checkpoint import Checkpoint, open_checkpoint
from mtp_core.loader.quant import detect_quant_format, ignorable_tensor
from mtp_core.loader.quant.linear import make_linear

log = logging.getLogger("mtp.loader")

M = TypeVar("M", bound=torch.nn.Module)

_IGNORABLE = (
    re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$"),  # MTP copies (shared)
    re.compile(r".*rotary_emb\.inv_freq$"),
)

# the router, and DeepSeek-V3.2's indexer head weights and key norm (transformers' _keep_in_fp32_modules,
# DeepSeek's own inference code): small, and they decide selections
_KEEP_FP32 = ("e_score_correction_bias", "gate.weight", "indexer.weights_proj.weight", "indexer.k_norm.weight",
              "indexer.k_norm.bias")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_HEADER_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def native_cpu() -> bool:
    """The native CPU kernels are loaded (they read bf16 and packed FP8 / NVFP4 weights in place)."""
    from mtp_core import kernels
    return kernels.native_ops().cpu


def checkpoint_dtype(ckpt: Checkpoint) -> Optional[torch.dtype]:
    """The dtype the checkpoint stores its unquantized weights in (that of the token embedding)."""
    name = "model.embed_tokens.weight"
    if name not in ckpt.shards:
        return None
    return _HEADER_DTYPES.get(ckpt.shard_tensors[ckpt.shards[name]][name]["dtype"])


def resolve_dtype(dtype: str, device: str = "cpu", stored: Optional[torch.dtype] = None) -> torch.dtype:
    """auto -> on CPU the checkpoint's own dtype when the native kernels can read it (bf16 weights stay bf16:
    half the bytes, computed in fp32), else float32 (torch's bf16 matmuls are slow there); bfloat16 on GPUs."""
    if dtype == "auto":
        if device != "cpu":
            return torch.bfloat16
        return stored if stored in (torch.float32, torch.bfloat16) and native_cpu() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPES[dtype]


def resolve_keep_quantized(keep_quantized: Optional[bool], device: str = "cpu") -> bool:
    """None (auto) -> FP8 / NVFP4 weights stay packed on a CPU with the native kernels (they dequantize in
    registers) and on a GPU (where each weight a GPU GEMM serves stays packed, see _served_packed), and
    are dequantized at load on a CPU without the native kernels."""
    if keep_quantized is not None:
        return keep_quantized
    return native_cpu() if device == "cpu" else torch.device(device).type == "cuda"


def _served_packed(quant, name: str, shape: tuple[int, int], available: set[str], device: str,
                   dtype: torch.dtype) -> bool:
    """On a GPU in auto mode: whether a GPU GEMM (choose_linear_kernel, the one decision) serves this packed
    weight; a weight that would only be dequantized per forward is dequantized once at load instead."""
    from mtp_core.kernels.dispatch import choose_linear_kernel, linear_target
    kw = {}
    if quant.name == "nvfp4":
        kw["has_input_scale"] = quant.companion_names(name)[2] in available
    else:
        kw["block_size"] = tuple(quant.block_size)
    kernel, _ = choose_linear_kernel(quant.name, shape[0], shape[1], dtype, linear_target(torch.device(device)), **kw)
    return kernel != "dequant"


def _is_ignorable(name: str, num_main_layers: int) -> bool:
    m = _IGNORABLE[0].match(name)
    if m:
        return int(name.split(".")[2]) >= num_main_layers
    return any(p.match(name) for p in _IGNORABLE[1:])


def _linear_weight_names(model: torch.nn.Module) -> set[str]:
    return {f"{name}.weight" for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}


def check_tensor_names(ckpt: Checkpoint, expected: dict[str, tuple[int, ...]], parts: dict[str, list[str]]) -> None:
    """Every tensor the model needs (parts[param] = its checkpoint tensors, scales included) must be in the
    checkpoint, and every checkpoint tensor must be needed or known-ignorable."""
    available = set(ckpt.shards)
    needed = {t for names in parts.values() for t in names}
    missing = sorted(needed - available)
    if missing:
        name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        shape = f" with shape {list(expected[name])}" if name in expected else ""
        raise ValueError(f"tensor {name}{more}{shape} is missing from the checkpoint in {ckpt.model_dir}")
    unexpected = sorted(n for n in available - needed
                        if not _is_ignorable(n, ckpt.config.num_hidden_layers) and not ignorable_tensor(n))
    if unexpected:
        name = unexpected[0]
        raise ValueError(f"unexpected tensor {name} in {ckpt.shards[name].name}: the config does not describe it "
                         f"(check num_hidden_layers / num_nextn_predict_layers / n_routed_experts / q_lora_rank)")


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "cpu",
               progress: Optional[Callable[[int, int], None]] = None,
               keep_quantized: Optional[bool] = None, *,
               make_model: Callable[[ModelConfig], M]) -> tuple[M, Checkpoint]:
    """Build the model (make_model(config), e.g. DeepseekV3ForCausalLM) on the meta device and fill it from the
    checkpoint's safetensors, one tensor at a time (each read, converted and placed before the next: the peak
    is the model plus one tensor).

    Quantized checkpoints (DeepSeek FP8 block, ModelOpt NVFP4) are kept packed in modules that the native
    CPU kernels read in place (keep_quantized None = auto: on a CPU with them), or dequantized exactly at
    load (keep_quantized False)."""
    ckpt = open_checkpoint(model_dir)
    quant = detect_quant_format(ckpt.model_dir, ckpt.config.raw)
    torch_dtype = resolve_dtype(dtype, device, checkpoint_dtype(ckpt))
    auto_gpu = keep_quantized is None and device != "cpu"
    keep_quantized = resolve_keep_quantized(keep_quantized, device)
    with torch.device("meta"):
        model = make_model(ckpt.config)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    available = set(ckpt.shards)
    linears = _linear_weight_names(model)
    parts = {n: (quant.tensor_names(n, available) if quant is not None and n in linears else [n]) for n in expected}
    check_tensor_names(ckpt, {n: tuple(t.shape) for n, t in expected.items()}, parts)
    state: dict[str, torch.Tensor] = {}
    quantized_modules: dict[str, torch.nn.Module] = {}
    shapes = {n: list(expected[n].shape) for n in expected if parts[n] == [n]}
    num_tensors = 0
    for name, tensors in _stream_tensors(ckpt, parts, shapes, progress):
        names = parts[name]
        num_tensors += len(names)
        shape = tuple(expected[name].shape)
        keep_fp32 = name.endswith(_KEEP_FP32)
        target = torch.float32 if keep_fp32 else torch_dtype
        if quant is not None and name in linears:
            sub = {t: tensors[t] for t in names}   # dequantize() also refuses an FP8/FP4 weight without scales
            if keep_quantized and quant.is_quantized(name, available) and (
                    not auto_gpu or _served_packed(quant, name, shape, available, device, torch_dtype)):
                sub = {t: v.clone() for t, v in sub.items()}   # aligned copies that do not pin the file mapping
                quantized_modules[name[: -len(".weight")]] = make_linear(quant, name, sub, shape, device=device)
                continue
            state[name] = quant.dequantize(name, sub, shape).to(device=device, dtype=target)
        else:
            # always a fresh, allocator-aligned copy: a tensor read from the file can sit at any byte offset,
            # and BLAS picks its kernel (and so the rounding) by alignment, which would make two loads of the
            # same weights disagree in the last bit
            state[name] = tensors[name].to(device=device, dtype=target, copy=True)
    for mod_name, mod in quantized_modules.items():
        parent_name, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, mod)
    model.load_state_dict(state, strict=not quantized_modules, assign=True)
    model.rope.inv_freq = model.rope.inv_freq.to(device)
    model.eval()
    log.info("loaded %d tensors from %d file(s) in %s as %s%s", num_tensors, len(ckpt.shard_tensors),
             ckpt.model_dir, str(torch_dtype).replace("torch.", ""),
             f" ({quant.name}, {'kept quantized' if keep_quantized else 'dequantized'})" if quant else "")
    return model, ckpt


def _stream_tensors(ckpt: Checkpoint, parts: dict[str, list[str]], shapes: dict[str, list[int]],
                    progress: Optional[Callable[[int, int], None]]) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(parameter, {checkpoint tensor: tensor}) for every parameter as soon as all its tensors are read, file
    by file (each file is mapped only while it is read, and a tensor is dropped once every parameter using it
    has been handed out); plain tensors are shape-checked against the model."""
    owners: dict[str, list[str]] = {}
    for param, names in parts.items():
        for n in names:
            owners.setdefault(n, []).append(param)
    by_file: dict[Path, list[str]] = {}
    for n in sorted(owners):
        by_file.setdefault(ckpt.shards[n], []).append(n)
    missing = {param: set(names) for param, names in parts.items()}
    pending: dict[str, torch.Tensor] = {}
    done, total = 0, len(owners)
    for path, file_names in by_file.items():
        header = ckpt.shard_tensors[path]
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for n in file_names:
                got = list(header[n]["shape"])
                if n in shapes and got != shapes[n]:
                    raise ValueError(f"tensor {n} in {path.name} has shape {got}, expected {shapes[n]}")
                pending[n] = f.get_tensor(n)
                done += 1
                if progress:
                    progress(done, total)
                for param in owners[n]:
                    missing[param].discard(n)
                    if not missing[param]:
                        yield param, {t: pending[t] for t in parts[param]}
                        for t in parts[param]:
                            if t in pending and all(not missing[p] for p in owners[t]):
                                del pending[t]
