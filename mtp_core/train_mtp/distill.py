"""The distillation step of `mtp train-mtp`: the losses of the trained (chain, depth) pairs against the frozen
main model's greedy tokens, the learning-rate schedule, and the float32 model being trained (new modules
initialised from the last main layer with --add_mtp)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mtp_core.config import ModelConfig
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.train_mtp.inputs import FinetuneOptions
from mtp_core.train_mtp.objective import mtp_depth_forward, shift_hidden


def distill_losses(model: DeepseekV3ForCausalLM, batch: dict[str, torch.Tensor], mode: str, eagle_depth: int,
                   kl_weight: float) -> tuple[list[torch.Tensor], dict[str, list[tuple[float, float]]]]:
    """Losses of every trained (chain, depth) and (correct, counted) per depth for the running accuracy.

    Position p (0-based, in the window) of any depth reads token x_{p+1} and predicts the main model's greedy
    token after x_{p+1}: argmax of its logits at p+1 (top_idx[:, p+1, 0])."""
    ids, h, valid = batch["ids"], batch["hidden"], batch["valid"]
    S = ids.shape[1]
    S1 = S - 1
    emb = model.model.embed_tokens(ids[:, 1:])
    cos, sin = model.rope.cos_sin(torch.arange(S1))
    base = h[:, :-1]
    greedy = batch["top_idx"][..., 0]

    def loss_at(g: torch.Tensor, d: int) -> tuple[torch.Tensor, tuple[float, float]]:
        logits = model.lm_head(g[:, d - 1:S1 - 1]).float()          # positions p = d-1 .. S-3
        target = greedy[:, d:S1]                                      # argmax at p+1
        mask = valid[:, d:S1].float()
        count = mask.sum().clamp(min=1.0)
        ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
        loss = (ce * mask).sum() / count
        if kl_weight > 0:
            p = torch.softmax(batch["top_val"][:, d:S1], dim=-1)
            logq = torch.log_softmax(logits, dim=-1).gather(-1, batch["top_idx"][:, d:S1])
            loss = loss + kl_weight * (-(p * logq).sum(-1) * mask).sum() / count
        correct = ((logits.argmax(-1) == target).float() * mask).sum().item()
        return loss, (correct, mask.sum().item())

    losses: list[torch.Tensor] = []
    acc: dict[str, list[tuple[float, float]]] = {"vanilla": [], "eagle": []}
    g1 = None
    if mode in ("vanilla", "both"):
        hiddens = [base]
        v_losses = []
        for d in range(1, model.num_mtp_modules + 1):
            g = mtp_depth_forward(model, model.mtp_module(d - 1), emb, hiddens, cos, sin)
            g1 = g if d == 1 else g1
            loss, a = loss_at(g, d)
            v_losses.append(loss)
            acc["vanilla"].append(a)
            hiddens = hiddens + [shift_hidden(g)]
        losses.append(torch.stack(v_losses).mean())
    if mode in ("eagle", "both"):
        hiddens = [base]
        e_losses = []
        for d in range(1, eagle_depth + 1):
            g = g1 if (d == 1 and g1 is not None) else mtp_depth_forward(model, model.mtp_module(0), emb, hiddens,
                                                                          cos, sin)
            loss, a = loss_at(g, d)
            if not (d == 1 and mode == "both"):   # depth 1 is the Vanilla chain's, already in its loss
                e_losses.append(loss)
            acc["eagle"].append(a)
            hiddens = hiddens + [shift_hidden(g)]
        if e_losses:
            losses.append(torch.stack(e_losses).mean())
    return losses, acc


def lr_at(o: FinetuneOptions, step: int) -> float:
    warm = max(1, min(20, o.max_steps // 10))
    if step < warm:
        return o.lr * (step + 1) / warm
    t = min((step - warm) / max(o.max_steps - warm, 1), 1.0)
    return o.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def init_new_modules(model: DeepseekV3ForCausalLM, seed: int) -> None:
    """New MTP modules (--add_mtp): attention, MLP/MoE and their norms copied from the last main layer (weights
    that already read this model's residual stream), enorm/hnorm = 1, eh_proj = [I | I] (the block starts
    from the sum of the normalised token embedding and the normalised main hidden), shared_head.norm = the
    main final norm (so the shared lm_head sees hidden states on the scale it was trained on). Anything
    whose shape differs from the last layer's gets a small random init."""
    from mtp_core.tiny import init_weights

    L = model.num_main_layers
    last = model.model.layers[L - 1]
    with torch.no_grad():
        for k in range(model.num_mtp_modules):
            m = model.mtp_module(k)
            init_weights(m, seed + 101 * k)
            src = last.state_dict()
            own = m.state_dict()
            for name, t in src.items():
                if name in own and own[name].shape == t.shape:
                    own[name].copy_(t)
            m.enorm.weight.fill_(1.0)
            m.hnorm.weight.fill_(1.0)
            H = m.enorm.weight.shape[0]
            m.eh_proj.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], dim=1))
            m.shared_head.norm.weight.copy_(model.model.norm.weight)


def build_training_model(o: FinetuneOptions) -> tuple[DeepseekV3ForCausalLM, object, dict]:
    """float32 model with the source weights (dequantized when quantized); --add_mtp appends N new modules."""
    from mtp_core.loader import load_model

    src_model, ckpt = load_model(o.model_dir, dtype="float32", keep_quantized=False, make_model=DeepseekV3ForCausalLM)
    if ckpt.config.is_dsa:
        raise ValueError(f"{o.model_dir} is a DeepSeek-V3.2 (sparse attention) checkpoint; MTP training covers "
                         "DeepSeek-V3 attention only for now")
    if not o.add_mtp:
        return src_model, ckpt, dict(ckpt.config.raw)
    raw = {**ckpt.config.raw, "num_nextn_predict_layers": o.add_mtp}
    torch.manual_seed(o.seed)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(raw))
    missing, unexpected = model.load_state_dict(src_model.state_dict(), strict=False)
    L = ckpt.config.num_hidden_layers
    assert not unexpected and all(int(n.split(".")[2]) >= L for n in missing if n.startswith("model.layers."))
    init_new_modules(model, o.seed)
    model.eval()
    return model, ckpt, raw


def trained_module_ids(o: FinetuneOptions, num_modules: int) -> list[int]:
    return [0] if o.mtp_mode == "eagle" else list(range(num_modules))
