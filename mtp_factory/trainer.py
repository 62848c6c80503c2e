"""`mtp train`: a DeepSeek-V3-architecture model trained jointly with its MTP modules, on CPU or GPU.

Reproducible from the recipe's seed: the batch of step s is generated from (seed, s), so a run resumed
from its last saved state continues exactly where it stopped. State is saved with safetensors only
(weights and AdamW moments) plus a JSON file.
"""
from __future__ import annotations

import itertools
import json
import math
import re
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

import mtp_core
from mtp_core.config import ModelConfig
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.tiny import init_weights
from mtp_core.tokenizer_build import train_bpe_tokenizer, write_tokenizer_files
from mtp_core.train_mtp.objective import mtp_losses
from mtp_core.train_mtp.state import balance_experts, load_state, save_state
from mtp_factory.data.dataset import training_texts
from mtp_factory.data.phrasing import SPELL_CLOSE, SPELL_OPEN
from mtp_factory.recipes import Recipe

# the shipped models (each a directory named as its recipe)
ASSETS = Path(mtp_core.__file__).resolve().parent / "assets"


def build_tokenizer(recipe: Recipe, out_dir: Path) -> Tokenizer:
    """Trains the recipe's BPE tokenizer on its own training texts and writes it into `out_dir`."""
    texts = list(training_texts(seed=recipe.seed + 7919, num_examples=recipe.tokenizer_examples,
                                general_fraction=recipe.general_fraction))
    tok = train_bpe_tokenizer(texts, recipe.vocab_size)
    write_tokenizer_files(out_dir, tok, recipe.max_position_embeddings)
    return tok


def trace_style_at(recipe: Recipe, step: int) -> int:
    """The trace style (data.tasks.render) of step `step`'s examples."""
    style = recipe.late_trace_style if 0 <= recipe.v3_traces_from <= step else 2
    for start, later in recipe.trace_styles:
        if step >= start:
            style = later
    return style


def batch_for_step(tok: Tokenizer, recipe: Recipe, step: int) -> torch.Tensor:
    """[B, S] token ids of step `step`: examples packed back to back, a pure function of (seed, step)."""
    rows, seq_len, _ = rows_at(recipe, step)
    need = rows * seq_len
    ids: list[int] = []
    mix = None
    for start, weights in recipe.mix_segments:       # the last segment that has started decides
        if step >= start:
            mix = dict(weights)
    style = trace_style_at(recipe, step)
    spell = recipe.spell_drill_fraction if step >= recipe.spell_drill_from else 0.0
    stream = training_texts(seed=recipe.seed * 1_000_003 + step, num_examples=10**6,
                            general_fraction=recipe.general_fraction, family_weights=mix,
                            drill_fraction=recipe.drill_fraction, style=style, spell_drill_fraction=spell)
    while len(ids) < need:
        chunk = list(itertools.islice(stream, 16))
        if style > 2:       # later styles may hold spelled spans
            for text in chunk:
                ids.extend(encode_training_text(tok, text))
        else:
            for enc in tok.encode_batch(chunk, add_special_tokens=False):
                ids.extend(enc.ids)
    return torch.tensor(ids[:need], dtype=torch.long).view(rows, seq_len)


def rows_at(recipe: Recipe, step: int) -> tuple[int, int, float]:
    """(rows, tokens per row, share of the rows with MTP losses) of step `step`'s batch: the recipe's, or a
    later shape (row_shapes)."""
    shape = (recipe.batch_size, recipe.seq_len, recipe.mtp_batch_fraction)
    for start, *later in recipe.row_shapes:
        if step >= start:
            shape = tuple(later)
    return shape


def encode_training_text(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of a training string whose spelled spans (data.phrasing.spelled) are tokenized a character
    per token (a leading space joins the first character, as BPE's pre-tokenizer would); the rest as usual."""
    parts = re.split(f"{SPELL_OPEN}(.*?){SPELL_CLOSE}", text, flags=re.DOTALL)
    ids: list[int] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            if part:
                ids.extend(tok.encode(part, add_special_tokens=False).ids)
            continue
        pieces = list(part)
        if len(pieces) > 1 and pieces[0] == " ":
            pieces = [" " + pieces[1]] + pieces[2:]
        for piece in pieces:
            ids.extend(tok.encode(piece, add_special_tokens=False).ids)
    return ids


def lr_at(recipe: Recipe, step: int) -> float:
    """Warmup then cosine to min_lr_ratio x lr over the segment's planned total; a "restart" segment
    warms up again to its own peak and decays over its own length."""
    start = 0
    for end, kind, *args in recipe.lr_segments:
        if step < end or end == recipe.lr_segments[-1][0]:
            break
        start = end
    floor = recipe.lr * recipe.min_lr_ratio
    if kind == "constant":      # (end, "constant", peak): warmup (from step 0) then flat
        return args[0] * min(1.0, (step + 1) / recipe.warmup_steps)
    if kind == "linear":        # (end, "linear", from, to): straight line over the segment
        return args[0] + (args[1] - args[0]) * min((step - start) / max(end - start, 1), 1.0)
    if kind == "cosine":
        total = args[0]
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        t = min((step - recipe.warmup_steps) / max(total - recipe.warmup_steps, 1), 1.0)
        return floor + (recipe.lr - floor) * 0.5 * (1 + math.cos(math.pi * t))
    length, peak, warmup, *rest = args
    floor = rest[0] if rest else floor
    if step - start < warmup:
        return peak * (step - start + 1) / warmup
    t = min((step - start - warmup) / max(length - warmup, 1), 1.0)
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * t))


def run_model_config(run_dir: Path) -> tuple[Recipe, dict]:
    """(recipe, config.json dict) of a `mtp train --out` directory, from its recipe.json and tokenizer, as the
    trainer built them (for reading a run's saved state while it trains)."""
    rec = json.loads((run_dir / "recipe.json").read_text())
    recipe = Recipe(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in rec.items()})
    tok = Tokenizer.from_file(str(run_dir / "tokenizer" / "tokenizer.json"))
    return recipe, recipe.model_config(tok.get_vocab_size(), *_bos_eos(tok))


def _bos_eos(tok: Tokenizer) -> tuple[int, int]:
    return tok.token_to_id("<｜begin▁of▁sentence｜>"), tok.token_to_id("<｜end▁of▁sentence｜>")


def _init_from_checkpoint(model: DeepseekV3ForCausalLM, source: str, echo: Callable[[str], None]) -> None:
    """Start from trained weights (a shipped asset's name, or a checkpoint directory) instead of the random
    init: every tensor of the model must be there with the same shape (weights only from safetensors)."""
    src = ASSETS / source if (ASSETS / source / "model.safetensors").is_file() else Path(source)
    if not (src / "model.safetensors").is_file():
        raise ValueError(f"init_from={source!r}: no model.safetensors there; name a shipped asset or a checkpoint dir")
    weights = load_file(str(src / "model.safetensors"))
    own = model.state_dict()
    bad = sorted(k for k in own if k not in weights or weights[k].shape != own[k].shape)
    if bad:
        raise ValueError(f"init_from={source!r} does not fit this recipe's shape (first mismatch: {bad[0]})")
    model.load_state_dict({k: weights[k].to(own[k].dtype) for k in own})
    echo(f"initialised from {src}")


def train(recipe: Recipe, out_dir: Path, max_steps: Optional[int] = None, device: str = "cpu",
          echo: Callable[[str], None] = print) -> Path:
    """Trains (or resumes) into out_dir/state; exports the checkpoint to out_dir/model when done."""
    torch.set_num_threads(recipe.num_threads)
    torch.set_flush_denormal(True)   # denormal gradients are very slow on CPUs
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_dir = out_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        tok_dir.mkdir(parents=True, exist_ok=True)
        shipped = ASSETS / (recipe.tokenizer_from or recipe.name)
        if (shipped / "tokenizer.json").is_file():
            # the `tokenizers` BPE trainer breaks count ties in hash order, so a retrained vocabulary can
            # differ run to run; reproducing a shipped model starts from its exact tokenizer
            for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copy(shipped / f, tok_dir / f)
            echo(f"using the shipped tokenizer of {recipe.tokenizer_from or recipe.name}")
        else:
            build_tokenizer(recipe, tok_dir)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    bos, eos = _bos_eos(tok)
    cfg_dict = recipe.model_config(tok.get_vocab_size(), bos, eos)
    (out_dir / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2))
    torch.manual_seed(recipe.seed)
    model = DeepseekV3ForCausalLM(ModelConfig.from_dict(cfg_dict)).to(device)
    init_weights(model, recipe.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=recipe.lr, betas=(0.9, 0.95))
    state_dir = out_dir / "state"
    step, history = (load_state(state_dir, model, opt) if (state_dir / "state.json").is_file() else (0, []))
    if not step and recipe.init_from:   # a resumed run has its own weights in the state
        _init_from_checkpoint(model, recipe.init_from, echo)
    if step:
        echo(f"resuming {recipe.name} from step {step}")
    last = min(recipe.steps, max_steps if max_steps is not None else recipe.steps)
    model.train()
    t0, tokens = time.perf_counter(), 0
    while step < last:
        ids = batch_for_step(tok, recipe, step).to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(recipe, step)
        # bf16 autocast (weights, optimizer state and the losses stay float32): ~1.5x on a CPU with AMX
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                            enabled=recipe.autocast_bf16):
            h = model.forward_dense(ids)
            logits = model.lm_head(h[:, :-1]).float()
            main_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            rows = max(1, round(ids.shape[0] * rows_at(recipe, step)[2]))
            v_losses, e_losses, v_acc, e_acc = mtp_losses(model, ids[:rows], h[:rows], recipe.num_mtp_modules,
                                                          recipe.eagle_depth)
        loss = main_loss + recipe.mtp_lambda * torch.stack(v_losses).mean()
        if e_losses:
            loss = loss + recipe.mtp_lambda * torch.stack(e_losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        balance_experts(model, recipe.bias_update_speed)
        step += 1
        tokens += ids.numel()
        rec = {"step": step, "loss": loss.item(), "main_loss": main_loss.item(),
               "mtp_loss": [x.item() for x in v_losses], "eagle_loss": [x.item() for x in e_losses],
               "mtp_acc": v_acc, "eagle_acc": e_acc, "lr": lr_at(recipe, step - 1),
               "tokens_per_s": tokens / (time.perf_counter() - t0)}
        history.append(rec)
        if step % 10 == 0 or step == last:
            echo(f"step {step}/{recipe.steps} loss {rec['loss']:.3f} main {rec['main_loss']:.3f} "
                 f"mtp acc {[round(a, 3) for a in v_acc]} eagle acc {[round(a, 3) for a in e_acc]} "
                 f"{rec['tokens_per_s']:.0f} tok/s")
        if step % recipe.save_every == 0 or step == last:
            save_state(state_dir, model, opt, step, history)
    if step >= recipe.steps:
        export(model, cfg_dict, tok_dir, out_dir / "model", recipe)
        echo(f"exported {out_dir / 'model'}")
    return out_dir / "model"


def export(model: DeepseekV3ForCausalLM, cfg_dict: dict, tok_dir: Path, dest: Path, recipe: Recipe) -> None:
    """Hugging Face layout: config.json, model.safetensors (ship dtype), tokenizer files, generation config."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = getattr(torch, recipe.ship_dtype)
    state = {k: (v.to(torch.float32) if ("gate.weight" in k and v.dim() == 2 and ".mlp.gate." in k)
                 or k.endswith("e_score_correction_bias") else v.to(dtype)).contiguous()
             for k, v in model.state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    for f in tok_dir.iterdir():
        shutil.copy(f, tmp / f.name)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg_dict["bos_token_id"], "eos_token_id": cfg_dict["eos_token_id"], "do_sample": False},
        indent=2))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
