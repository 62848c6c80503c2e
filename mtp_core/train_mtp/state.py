"""What a training loop keeps across a restart, and the expert-balancing step every MoE training step ends
with. Shared by `mtp train-mtp` (the MTP modules only) and the factory's trainer (the whole model).

A training state is a directory holding the weights (`model.safetensors`), the AdamW moments
(`optimizer.safetensors`, `<param>.exp_avg` / `.exp_avg_sq` / `.step`) and `state.json` (the step and the
per-step history). It is written to a temporary sibling and renamed, so a stop mid-save leaves the last
complete state.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtp_core.model.moe import MoE


def save_state(state_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, step: int,
               history: list) -> None:
    tmp = state_dir.with_name(state_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for p, st in opt.state.items():
        n = names[id(p)]
        moments[f"{n}.exp_avg"] = st["exp_avg"].contiguous()
        moments[f"{n}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
        moments[f"{n}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, "history": history}))
    shutil.rmtree(state_dir, ignore_errors=True)
    tmp.rename(state_dir)


def load_state(state_dir: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[int, list]:
    """Loads the weights and moments into `model` and `opt`; returns (step, history)."""
    model.load_state_dict(load_file(str(state_dir / "model.safetensors")))
    moments = load_file(str(state_dir / "optimizer.safetensors"))
    for n, p in model.named_parameters():
        if f"{n}.exp_avg" in moments:
            opt.state[p] = {"step": moments[f"{n}.step"][0].clone(), "exp_avg": moments[f"{n}.exp_avg"],
                            "exp_avg_sq": moments[f"{n}.exp_avg_sq"]}
    st = json.loads((state_dir / "state.json").read_text())
    return int(st["step"]), list(st["history"])


def balance_experts(model: torch.nn.Module, speed: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each expert's selection bias toward equal load."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE) and getattr(m, "load_counts", None) is not None:
                load = m.load_counts.float()
                m.gate.e_score_correction_bias += speed * torch.sign(load.mean() - load)
                m.load_counts = None
