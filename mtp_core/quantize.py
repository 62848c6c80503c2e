"""Write DeepSeek FP8 (128x128 block) or ModelOpt NVFP4 checkpoints from a bf16/fp32 checkpoint.

Output layouts match what other engines read:
  fp8:   `x.weight` float8_e4m3fn [N, K] + `x.weight_scale_inv` float32 [ceil(N/128), ceil(K/128)];
         config.json gains quantization_config {activation_scheme, fmt, quant_method, weight_block_size}.
  nvfp4: `x.weight` uint8 [N, K/2] + `x.weight_scale` float8_e4m3fn [N, K/16] + `x.weight_scale_2`
         float32 [] + `x.input_scale` float32 []; hf_quant_config.json names the excluded modules.
Only 2-D `*.weight` tensors are candidates. Never quantized: embeddings, `lm_head`, the MoE router
(`mlp.gate`), the MTP `eh_proj` and `shared_head.head`, and DeepSeek-V3.2's indexer head weights
(`self_attn.indexer.weights_proj`): DeepSeek keeps them bf16 (its V3.2 FP8 release stores the indexer's `wq_b` and
`wk` as FP8 blocks with `weight_scale_inv`, as here, and `weights_proj` in bf16); NVFP4 also keeps attention
(`*self_attn*`, the indexer included; ModelOpt's default) and any weight whose in_features is not a multiple
of 16. `quantize_attention` (NVFP4) quantizes the attention projections too (q / q_a / q_b, kv_a, o_proj), as
llama.cpp's 4-bit types do, and keeps `kv_b_proj` (absorbed into the queries and outputs at run time, read
whole every step) and the indexer in the source precision.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtp_core.loader.quant.fp8 import Fp8BlockFormat, quantize_fp8_block
from mtp_core.loader.quant.nvfp4 import E2M1_MAX, FP8_E4M3_MAX, matches_any, quantize_nvfp4

FORMATS = {"fp8": "fp8_block", "fp8_block": "fp8_block", "nvfp4": "nvfp4"}
ALWAYS_EXCLUDED = ("*embed_tokens", "lm_head", "*.mlp.gate", "*.eh_proj", "*.shared_head.head",
                   "*.indexer.weights_proj")
NVFP4_EXCLUDED = ("*self_attn*",)
NVFP4_ATTENTION_KEPT = ("*self_attn.kv_b_proj", "*self_attn.indexer*")   # with quantize_attention
NVFP4_GROUP = 16
DEFAULT_INPUT_SCALE = 1.0  # NVFP4 input_scale when no activation amax is supplied (uncalibrated)
_NEVER_LISTED = ("*embed_tokens", "*.mlp.gate")  # readers never treat these as quantizable linears
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} not found; pass a checkpoint directory with config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _source_shards(src: Path) -> tuple[list[str], bool]:
    """Shard file names in src and whether they come from a model.safetensors.index.json."""
    index = src / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: weight_map is missing or empty")
        return list(dict.fromkeys(weight_map.values())), True
    if (src / "model.safetensors").is_file():
        return ["model.safetensors"], False
    raise ValueError(f"{src}: no model.safetensors or model.safetensors.index.json")


def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new output directory")


def _classify(name: str, t: torch.Tensor, fmt: str, patterns: tuple[str, ...],
              num_hidden_layers: int, quantize_mtp: bool) -> str:
    """'quantize', 'keep' (a 2-D linear weight left in high precision) or 'other'."""
    if not name.endswith(".weight") or t.dim() != 2 or not t.is_floating_point():
        return "other"
    module = name.removesuffix(".weight")
    if matches_any(module, patterns):
        return "keep"
    layer = _LAYER_RE.match(name)
    if layer and int(layer.group(1)) >= num_hidden_layers and not quantize_mtp:
        return "keep"
    if fmt == "nvfp4" and t.shape[1] % NVFP4_GROUP:
        return "keep"
    return "quantize"


def _quantize_tensor(name: str, t: torch.Tensor, fmt: str, block: tuple[int, int],
                     input_amax: Mapping[str, float]) -> dict[str, torch.Tensor]:
    if fmt == "fp8_block":
        q, scale_inv = quantize_fp8_block(t, block)
        return {name: q, name + "_scale_inv": scale_inv}
    module = name.removesuffix(".weight")
    packed, scale, scale_2 = quantize_nvfp4(t, NVFP4_GROUP)
    amax = input_amax.get(module)
    input_scale = DEFAULT_INPUT_SCALE if amax is None else float(amax) / (FP8_E4M3_MAX * E2M1_MAX)
    return {name: packed, name + "_scale": scale, name + "_scale_2": scale_2,
            module + ".input_scale": torch.tensor(input_scale, dtype=torch.float32)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def quantize_checkpoint(src_dir: str | Path, out_dir: str | Path, fmt: str,
                        quantize_mtp: bool = True, exclude: list[str] | None = None,
                        input_amax: Mapping[str, float] | None = None, quantize_attention: bool = False) -> dict:
    """Write a quantized copy of the checkpoint in src_dir to out_dir (which must not exist or be
    empty); returns a summary. `exclude`: extra fnmatch patterns on module names to keep unquantized.
    `quantize_mtp=False` keeps MTP layers (model.layers.{>= num_hidden_layers}) unquantized.
    `input_amax` (NVFP4): calibrated max |activation| per module name; others get input_scale 1.0.
    `quantize_attention` (NVFP4): the attention projections too, but kv_b_proj and the indexer.
    Written to a temporary sibling directory and renamed at the end: nothing half-written remains."""
    src, out = Path(src_dir), Path(out_dir)
    fmt, config, num_layers = _check_source(src, fmt)
    shards, indexed = _source_shards(src)
    _check_out_dir(out)
    if quantize_attention and fmt != "nvfp4":
        raise ValueError("quantize_attention applies to --format nvfp4 (fp8 quantizes attention already)")
    kept = NVFP4_ATTENTION_KEPT if quantize_attention else NVFP4_EXCLUDED
    patterns = ALWAYS_EXCLUDED + (kept if fmt == "nvfp4" else ()) + tuple(exclude or ())
    fp8_format = Fp8BlockFormat()
    summary = {"format": fmt, "out_dir": str(out), "num_tensors_in": 0, "num_tensors_out": 0,
               "num_quantized": 0, "num_kept": 0, "bytes_before": 0, "bytes_after": 0,
               "num_uncalibrated_input_scales": 0, "kept_modules": []}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        weight_map: dict[str, str] = {}
        for shard in shards:
            written = _quantize_shard(src / shard, fmt, patterns, num_layers, quantize_mtp, fp8_format.block_size,
                                      input_amax or {}, summary)
            save_file(written, str(tmp / shard), metadata={"format": "pt"})
            for name, t in written.items():
                weight_map[name] = shard
                summary["num_tensors_out"] += 1
                summary["bytes_after"] += _nbytes(t)
        _write_metadata(src, tmp, config, fmt, fp8_format, weight_map, indexed, summary)
        if out.exists():
            out.rmdir()  # checked empty above
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _check_source(src: Path, fmt: str) -> tuple[str, dict, int]:
    """(format name, config, num_hidden_layers) of a checkpoint that can be quantized to `fmt`, else ValueError."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not supported; use one of: fp8, nvfp4")
    fmt = FORMATS[fmt]
    config = _read_json(src / "config.json")
    if "quantization_config" in config or (src / "hf_quant_config.json").exists():
        raise ValueError(f"{src} is already quantized; quantize a bf16/fp32 checkpoint")
    num_layers = config.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"{src / 'config.json'}: num_hidden_layers must be a positive integer")
    return fmt, config, num_layers


def _quantize_shard(path: Path, fmt: str, patterns: tuple[str, ...], num_layers: int, quantize_mtp: bool,
                    block_size: int, input_amax: Mapping[str, float], summary: dict) -> dict[str, torch.Tensor]:
    """The tensors one output shard holds: each source tensor quantized, kept or passed through (counted in
    `summary`)."""
    written: dict[str, torch.Tensor] = {}
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as e:  # missing or corrupt shard
        raise ValueError(f"{path}: cannot read safetensors ({e})") from None
    with handle as f:
        for name in f.keys():
            t = f.get_tensor(name)
            summary["num_tensors_in"] += 1
            summary["bytes_before"] += _nbytes(t)
            kind = _classify(name, t, fmt, patterns, num_layers, quantize_mtp)
            if kind == "quantize":
                written.update(_quantize_tensor(name, t, fmt, block_size, input_amax))
                summary["num_quantized"] += 1
                if fmt == "nvfp4" and name.removesuffix(".weight") not in input_amax:
                    summary["num_uncalibrated_input_scales"] += 1
                continue
            if kind == "keep":
                summary["num_kept"] += 1
                summary["kept_modules"].append(name.removesuffix(".weight"))
            written[name] = t
    return written


def _write_metadata(src: Path, tmp: Path, config: dict, fmt: str, fp8_format: Fp8BlockFormat,
                    weight_map: dict[str, str], indexed: bool, summary: dict) -> None:
    """config.json, hf_quant_config.json (nvfp4), the shard index, and every other top-level file
    (tokenizer, generation config, chat template) copied unchanged."""
    if fmt == "fp8_block":
        config = {**config, "quantization_config": fp8_format.to_quantization_config()}
    else:
        listed = sorted(m for m in summary["kept_modules"] if not matches_any(m, _NEVER_LISTED))
        hf_quant = {"producer": {"name": "modelopt", "version": "0.0.0"},
                    "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None,
                                     "group_size": NVFP4_GROUP, "exclude_modules": listed}}
        (tmp / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=4) + "\n")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if indexed:
        index = {"metadata": {"total_size": summary["bytes_after"]}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    skip = {"config.json", "model.safetensors.index.json", "hf_quant_config.json"}
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in skip and path.suffix != ".safetensors":
            shutil.copy2(path, tmp / path.name)
