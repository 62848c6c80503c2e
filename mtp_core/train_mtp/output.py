"""`mtp train-mtp` output: the destination checkpoint in Hugging Face layout, main tensors byte for byte.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.train_mtp.inputs import FinetuneOptions


MTP_SHARD = "model-mtp.safetensors"
_PACKED = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8}


def layer_of(name: str) -> Optional[int]:
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _out_dtype(name: str, src_dtypes: dict[str, str], cfg_dtype: str, L: int) -> torch.dtype:
    """The dtype an MTP tensor is written in: its source dtype when that was a plain float, else the dtype of
    the same tensor in the last main layer when plain, else the config's torch_dtype (bf16 by default)."""
    st = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    if name in src_dtypes and src_dtypes[name] in st:
        return st[src_dtypes[name]]
    parts = name.split(".")
    twin = ".".join(parts[:2] + [str(L - 1)] + parts[3:])
    if twin in src_dtypes and src_dtypes[twin] in st:
        return st[src_dtypes[twin]]
    if src_dtypes.get(name) in ("F8_E4M3", "F8_E5M2", "U8", "I8") or src_dtypes.get(twin) in ("F8_E4M3", "F8_E5M2", "U8", "I8"):
        return torch.bfloat16
    return {"float32": torch.float32, "float16": torch.float16}.get(cfg_dtype, torch.bfloat16)


def _link_or_copy(src: Path, dst: Path, link: bool) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def write_output(o: FinetuneOptions, ckpt, model: DeepseekV3ForCausalLM, config_raw: dict, dest: Path,
                 trained: list[int]) -> dict:
    """Writes the checkpoint into `dest` (an empty temporary directory). Returns a summary."""
    src = ckpt.model_dir
    weight_map, linked, rewritten = _write_main_shards(o, ckpt, dest)
    mtp_tensors = _mtp_tensors(ckpt, model, config_raw, trained)
    save_file(mtp_tensors, str(dest / MTP_SHARD), metadata={"format": "pt"})
    for n in mtp_tensors:
        weight_map[n] = MTP_SHARD
    total = 0
    for rel in set(weight_map.values()):
        total += (dest / rel).stat().st_size
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (dest / "config.json").write_text(json.dumps(config_raw, indent=2) + "\n")
    _copy_other_files(src, dest)
    # NVFP4 (ModelOpt): the bf16 MTP linears are excluded from quantization
    hf_q = src / "hf_quant_config.json"
    if hf_q.is_file():
        q = json.loads(hf_q.read_text())
        sec = q.get("quantization", q)
        written_linears = sorted({n[: -len(".weight")] for n in mtp_tensors
                                  if n.endswith(".weight") and mtp_tensors[n].dim() == 2
                                  and mtp_tensors[n].dtype not in _PACKED and "embed_tokens" not in n
                                  and not n.endswith("mlp.gate.weight")})
        sec["exclude_modules"] = sorted(set(sec.get("exclude_modules") or []) | set(written_linears))
        (dest / "hf_quant_config.json").write_text(json.dumps(q, indent=4) + "\n")
    return {"linked_or_copied_shards": linked, "rewritten_shards": rewritten, "mtp_shard": MTP_SHARD,
            "num_mtp_tensors": len(mtp_tensors)}


def _write_main_shards(o: FinetuneOptions, ckpt, dest: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """Every main tensor byte for byte: a shard holding only main tensors linked (or copied), one that also held
    MTP tensors rewritten without them. Returns (tensor -> shard, linked shards, rewritten shards)."""
    src = ckpt.model_dir
    L = ckpt.config.num_hidden_layers
    index_path = src / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    linked, rewritten = [], []
    by_file: dict[Path, list[str]] = {}
    for name, f in ckpt.shards.items():
        by_file.setdefault(f, []).append(name)
    for f, names in sorted(by_file.items()):
        rel = f.relative_to(src.resolve()) if f.is_relative_to(src.resolve()) else Path(f.name)
        if not index_path.is_file() and rel.name == "model.safetensors":
            rel = Path("model-main.safetensors")
        main = [n for n in names if (layer_of(n) is None or layer_of(n) < L)]
        if not main:
            continue
        whole = set(ckpt.shard_tensors[f]) == set(main)
        if whole:
            _link_or_copy(f, dest / rel, o.link)
            linked.append(str(rel))
        else:
            with safe_open(str(f), framework="pt") as h:
                meta = h.metadata() or {"format": "pt"}
                tensors = {n: h.get_tensor(n) for n in main}
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(dest / rel), metadata=meta)
            rewritten.append(str(rel))
        for n in main:
            weight_map[n] = str(rel)
    return weight_map, linked, rewritten


def _mtp_tensors(ckpt, model: DeepseekV3ForCausalLM, config_raw: dict, trained: list[int]) -> dict[str, torch.Tensor]:
    """The MTP shard's tensors: trained modules from the model (in _out_dtype), the others' source tensors as they
    were, and each module's copies of the embedding and the head."""
    L = ckpt.config.num_hidden_layers
    src_dtypes = {n: hdr[n]["dtype"] for f, hdr in ckpt.shard_tensors.items() for n in hdr if ckpt.shards.get(n) == f}
    mtp_tensors: dict[str, torch.Tensor] = {}
    cfg_dtype = str(config_raw.get("torch_dtype") or "bfloat16")
    raw_src: dict[str, torch.Tensor] = {}
    need_raw = [n for n in ckpt.shards if (layer_of(n) or -1) >= L and layer_of(n) - L not in trained]
    need_raw += ["model.embed_tokens.weight", "lm_head.weight"]
    for n in need_raw:
        if n in ckpt.shards:
            with safe_open(str(ckpt.shards[n]), framework="pt") as h:
                raw_src[n] = h.get_tensor(n)
    state = model.state_dict()
    for k in range(model.num_mtp_modules):
        prefix = f"model.layers.{L + k}."
        if k in trained:
            for n, t in state.items():
                if n.startswith(prefix):
                    mtp_tensors[n] = t.detach().to(_out_dtype(n, src_dtypes, cfg_dtype, L)).contiguous()
        else:
            for n, t in raw_src.items():
                if n.startswith(prefix):
                    mtp_tensors[n] = t.contiguous()
        for copy_name, main_name in (("embed_tokens.weight", "model.embed_tokens.weight"),
                                     ("shared_head.head.weight", "lm_head.weight")):
            if prefix + copy_name not in mtp_tensors and main_name in raw_src:
                mtp_tensors[prefix + copy_name] = raw_src[main_name].clone()
    return mtp_tensors


def _copy_other_files(src: Path, dest: Path) -> None:
    """The tokenizer and the other small files (not the weights, config or index), then the shards made readable
    like the copies."""
    for p in sorted(src.iterdir()):
        if p.name in ("config.json", "model.safetensors.index.json") or p.suffix == ".safetensors" or p.is_symlink():
            continue
        if p.is_file():
            shutil.copy2(p, dest / p.name)
        elif p.is_dir() and not any(q.suffix == ".safetensors" for q in p.rglob("*")):
            shutil.copytree(p, dest / p.name, symlinks=False)
    umask = os.umask(0)
    os.umask(umask)
    for p in dest.rglob("*.safetensors"):   # safetensors writes 0600; make them readable like the copies
        if p.stat().st_nlink == 1:
            os.chmod(p, 0o666 & ~umask)


# ---- evaluation -----------------------------------------------------------------------------------------

