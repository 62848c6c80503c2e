"""Loading safetensors weights into DeepseekV3ForCausalLM.

Every parameter and persistent buffer of the model must be present with the right shape; any other
tensor in the checkpoint is an error unless it is a known-ignorable one (the per-MTP-layer copies of the
embedding and head, which we share with the main model, and rotary caches).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open

from mtp_core.loader.checkpoint import Checkpoint, open_checkpoint
from mtp_core.model import DeepseekV3ForCausalLM

log = logging.getLogger("mtp.loader")

_IGNORABLE = (
    re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$"),  # MTP copies (shared)
    re.compile(r".*rotary_emb\.inv_freq$"),
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str = "cpu") -> torch.dtype:
    """auto -> float32 on CPU (bf16 matmuls are far slower there), bfloat16 on GPUs."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return _DTYPES[dtype]


def _is_ignorable(name: str, num_main_layers: int) -> bool:
    m = _IGNORABLE[0].match(name)
    if m:
        return int(name.split(".")[2]) >= num_main_layers
    return any(p.match(name) for p in _IGNORABLE[1:])


def load_model(model_dir: str | Path, dtype: str = "auto", device: str = "cpu",
               progress: Optional[Callable[[int, int], None]] = None) -> tuple[DeepseekV3ForCausalLM, Checkpoint]:
    ckpt = open_checkpoint(model_dir)
    torch_dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(ckpt.config)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    available = set(ckpt.shards)
    missing = sorted(set(expected) - available)
    if missing:
        name = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"tensor {name}{more} with shape {list(expected[name].shape)} is missing from the "
                         f"checkpoint in {ckpt.model_dir}")
    unexpected = sorted(n for n in available - set(expected) if not _is_ignorable(n, ckpt.config.num_hidden_layers))
    if unexpected:
        name = unexpected[0]
        raise ValueError(f"unexpected tensor {name} in {ckpt.shards[name].name}: the config does not describe it "
                         f"(check num_hidden_layers / num_nextn_predict_layers / n_routed_experts / q_lora_rank)")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(ckpt.shards[name], []).append(name)
    state: dict[str, torch.Tensor] = {}
    done, total = 0, len(expected)
    for path, names in by_file.items():
        header = ckpt.shard_tensors[path]
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                want = list(expected[name].shape)
                got = list(header[name]["shape"])
                if got != want:
                    raise ValueError(f"tensor {name} in {path.name} has shape {got}, expected {want}")
                t = f.get_tensor(name)
                keep_fp32 = name.endswith("e_score_correction_bias") or name.endswith("gate.weight")
                t = t.to(device=device, dtype=torch.float32 if keep_fp32 else torch_dtype)
                state[name] = t
                done += 1
                if progress:
                    progress(done, total)
    model.load_state_dict(state, strict=True, assign=True)
    model.rope.inv_freq = model.rope.inv_freq.to(device)
    model.eval()
    log.info("loaded %d tensors from %d file(s) in %s as %s", total, len(by_file), ckpt.model_dir,
             str(torch_dtype).replace("torch.", ""))
    return model, ckpt
