"""Finding and opening a Hugging Face checkpoint directory safely.

Only safetensors are read (never pickle); nothing from the directory is executed; every shard path named
by `model.safetensors.index.json` must stay inside the model directory (no `..`, no absolute path, no
symlink pointing out).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from mtp_core.config import ModelConfig

_LFS_MAGIC = b"version https://git-lfs"


@dataclass
class Checkpoint:
    model_dir: Path
    config: ModelConfig
    shards: dict[str, Path]           # tensor name -> shard file
    shard_tensors: dict[Path, dict]   # shard file -> {name: {"dtype", "shape"}} from its header


def resolve_model_dir(model_dir: str | Path) -> Path:
    d = Path(model_dir).expanduser()
    if not d.exists():
        raise ValueError(f"model directory {d} does not exist; pass --model_dir pointing at a checkpoint folder")
    if not d.is_dir():
        raise ValueError(f"--model_dir {d} is a file, not a directory")
    if not (d / "config.json").is_file():
        raise ValueError(f"{d} has no config.json; is this a Hugging Face checkpoint directory?")
    return d


def _contained(model_dir: Path, rel: str, what: str) -> Path:
    if Path(rel).is_absolute():
        raise ValueError(f"{what}: shard path {rel!r} is absolute; shard paths must be relative to the model directory")
    root = model_dir.resolve()
    p = (model_dir / rel).resolve()
    if not p.is_relative_to(root):
        raise ValueError(f"{what}: shard path {rel!r} points outside the model directory {model_dir}")
    return p


def read_safetensors_header(path: Path) -> dict:
    """Parse a safetensors header, with clear errors for LFS pointers and truncated files."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if head.startswith(_LFS_MAGIC[:8]) and (head + f.read(len(_LFS_MAGIC) - 8)).startswith(_LFS_MAGIC):
                raise ValueError(f"{path} is a Git LFS pointer, not the weights; run `git lfs pull` in the model directory")
            if len(head) < 8:
                raise ValueError(f"{path} is truncated ({size} bytes): not a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100_000_000:
                raise ValueError(f"{path} is truncated or not a safetensors file (header length {n} > file size {size})")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ValueError(f"{path} has a corrupt safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    for name, v in header.items():
        if not (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
                and isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
                and all(isinstance(o, int) for o in v["data_offsets"])):
            raise ValueError(f"{path} has a corrupt safetensors header entry for {name!r}")
    data_len = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + data_len > size:
        raise ValueError(f"{path} is truncated: its header needs {8 + n + data_len} bytes, the file has {size}")
    return header


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    d = resolve_model_dir(model_dir)
    config = ModelConfig.from_file(d / "config.json")
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"{index} is not a valid index (needs a 'weight_map' object)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names (strings)")
        shards = {name: _contained(d, rel, str(index)) for name, rel in weight_map.items()}
        for name, p in shards.items():
            if not p.is_file():
                raise ValueError(f"shard {p.name} named in {index.name} (for tensor {name}) is missing from {d}")
    else:
        files = sorted(p for p in d.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{d} has no *.safetensors weights (and no model.safetensors.index.json); "
                             "only safetensors checkpoints are supported")
        shards = {}
        for f in files:
            _contained(d, f.name, str(d))
    shard_tensors: dict[Path, dict] = {}
    for f in sorted(set(shards.values())) if shards else files:
        shard_tensors[f] = read_safetensors_header(f)
    if not shards:
        for f, hdr in shard_tensors.items():
            for name in hdr:
                if name in shards:
                    raise ValueError(f"tensor {name} is in both {shards[name].name} and {f.name}; "
                                     "remove one file or add a model.safetensors.index.json")
                shards[name] = f
    else:
        for name, f in shards.items():
            if name not in shard_tensors[f]:
                raise ValueError(f"tensor {name} is listed in the index under {f.name} but that file does not hold it")
    return Checkpoint(model_dir=d, config=config, shards=shards, shard_tensors=shard_tensors)
