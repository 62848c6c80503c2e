"""`mtp train-mtp`: fine-tune (or add) the MTP modules of a checkpoint by self-distillation.

The verifier of MTP speculative decoding is the unchanged main model, so retraining only the MTP modules can
change speed, never greedy output. This module:

1. **Data** (`build_cache`): the frozen main model generates continuations of the user's training prompts
   with the engine (batched; greedy or sampled), then one dense forward over prompt + continuation records
   its final-norm hidden states and its top-k logits. Stored in chunks of `gen_batch` prompts under
   `WORK/cache/chunk-NNNNN.safetensors`, each written to a temporary name and renamed, so an interrupted run
   resumes at the first missing chunk.
2. **Training** (`train_modules`): only MTP parameters get gradients. Module k's target at position p is
   the main model's greedy token there (the argmax of its logits: exactly what strict verification checks);
   optionally a KL term to its top-k distribution. The attention context of every draft depth is arranged as
   at inference (`objective.mtp_depth_forward`): Vanilla chains module d at depth d, Eagle reuses module
   1 at every depth on its own outputs. AdamW, warmup + cosine; the state (MTP weights, moments, step) is
   saved every `save_every` steps and a rerun resumes from it.
3. **Output** (`write_output`): DST in Hugging Face layout, built in a temporary sibling and renamed at the
   end: every main tensor keeps its exact bytes (a shard holding only main tensors is hard-linked or copied;
   a shard that also held MTP tensors is rewritten without them, tensor data unchanged), the MTP tensors in
   their own shard `model-mtp.safetensors`, an updated `model.safetensors.index.json`, config.json (with
   `num_nextn_predict_layers: N` after `--add_mtp N`), the tokenizer and the other small files.
4. **Report**: acceptance length per depth before and after on held-out prompts, `train_mtp_report.json`.

MTP tensor format in DST: trained modules are written in the dtype their source tensors had (bf16 for the
shipped model); when the source stored them quantized (FP8 block / NVFP4), or for new modules of a quantized
checkpoint, they are written in bfloat16 without scales (loaders that decide per tensor, as this one does,
read them as unquantized; NVFP4's `hf_quant_config.json` lists them in `exclude_modules`). Modules that were
not trained (Eagle mode trains module 1 only) keep their source tensors byte for byte. Like DeepSeek-V3's
checkpoints, each MTP layer also carries copies of the embedding and the head
(`model.layers.{L+k}.embed_tokens.weight`, `.shared_head.head.weight`).

Layout: `inputs.py` (options, prompts, the checks made before anything is written), `cache.py` (part 1),
`distill.py` (part 2's losses, schedule and model), `objective.py` (the draft depths' attention context),
`state.py` (the resumable training state), `output.py` (part 3); the training loop, the report and `run`
are here.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.train_mtp.cache import (Cache, Generator, atomic_json, build_cache, json_digest, make_batch,
                                      source_fingerprint)
from mtp_core.train_mtp.distill import build_training_model, distill_losses, lr_at, trained_module_ids
from mtp_core.train_mtp.inputs import (FinetuneOptions, check_disk, check_inputs, encode_prompts, read_prompts,
                                       split_prompts)
from mtp_core.train_mtp.output import write_output
from mtp_core.train_mtp.state import balance_experts, load_state, save_state

REPORT = "train_mtp_report.json"


def train_modules(o: FinetuneOptions, model: DeepseekV3ForCausalLM, cache: Cache,
                  echo: Callable[[str], None]) -> list[dict]:
    """Trains the MTP modules in place (resuming from WORK/state); returns the history."""
    torch.set_flush_denormal(True)
    for p in model.parameters():
        p.requires_grad_(False)
    mtp = torch.nn.ModuleList([model.mtp_module(k) for k in range(model.num_mtp_modules)])
    trained = torch.nn.ModuleList([mtp[k] for k in trained_module_ids(o, len(mtp))])
    for p in trained.parameters():
        p.requires_grad_(True)
    model.eval()
    trained.train()
    opt = torch.optim.AdamW([p for p in mtp.parameters() if p.requires_grad], lr=o.lr, betas=(0.9, 0.95),
                            weight_decay=o.weight_decay)
    state_dir = o.work / "state"
    step, history = (load_state(state_dir, mtp, opt) if (state_dir / "state.json").is_file() else (0, []))
    if step:
        echo(f"resuming MTP training from step {step}")
    depths = {"vanilla": [[0.0, 0.0] for _ in range(len(mtp))], "eagle": [[0.0, 0.0] for _ in range(o.eagle_depth)]}
    t0, steps_here, loss_sum = time.perf_counter(), 0, 0.0
    while step < o.max_steps:
        batch = make_batch(cache, step, o)
        for g in opt.param_groups:
            g["lr"] = lr_at(o, step)
        losses, acc = distill_losses(model, batch, o.mtp_mode, o.eagle_depth, o.kl_weight)
        loss = torch.stack(losses).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in trained.parameters()], 1.0)
        opt.step()
        balance_experts(trained, 1e-3)
        step += 1
        steps_here += 1
        loss_sum += loss.item()
        for chain in ("vanilla", "eagle"):
            for d, (c, n) in enumerate(acc[chain]):
                depths[chain][d][0] += c
                depths[chain][d][1] += n
        history.append({"step": step, "loss": loss.item(), "lr": lr_at(o, step - 1),
                        **{f"{c}_acc": [round(a / n, 4) if n else None for a, n in acc[c]] for c in acc if acc[c]}})
        if step % o.log_every == 0 or step == o.max_steps:
            run = " ".join(f"{chain} acc/depth " + " ".join(f"{c / n:.3f}" for c, n in depths[chain] if n)
                           for chain in ("eagle", "vanilla") if any(n for _, n in depths[chain]))
            el = time.perf_counter() - t0
            echo(f"step {step}/{o.max_steps} loss {loss_sum / steps_here:.3f} {run} lr {lr_at(o, step - 1):.2e} "
                 f"{el / steps_here:.2f} s/step")
            depths = {c: [[0.0, 0.0] for _ in v] for c, v in depths.items()}
            loss_sum, steps_here, t0 = 0.0, 0, time.perf_counter()
        if step % o.save_every == 0 or step == o.max_steps:
            save_state(state_dir, mtp, opt, step, history)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return history


def eval_settings(o: FinetuneOptions, num_modules: int) -> list[tuple[str, int]]:
    modes = ["eagle", "vanilla"] if o.mtp_mode == "both" else [o.mtp_mode]
    out = []
    for m in modes:
        if m == "vanilla" and num_modules < 2:
            continue
        out.append((m, o.eval_k if m == "eagle" else min(o.eval_k, num_modules)))
    return out


def acceptance(model_dir: Path, o: FinetuneOptions, prompts: list[list[int]], settings: list[tuple[str, int]]
               ) -> dict[str, dict]:
    """AL and acceptance per draft position of each (mode, K) on the held-out prompts (greedy, EOS ignored)."""
    from mtp_core.bench.metrics import summarize_decoding
    from mtp_core.bench.sweep import Setting, run_setting
    from mtp_core.config import LLMConfig
    from mtp_core.llm import LLM

    llm = LLM(LLMConfig(model_dir=str(model_dir), max_batch_size=o.max_batch_size, num_threads=o.num_threads))
    eos, think = sorted(llm.engine.stops.eos_token_ids), llm.engine.stops.think_ids
    base = llm.config
    del llm.engine
    res = {}
    for mode, K in settings:
        recs = run_setting(llm.model, base, eos, think, Setting(mode, K), prompts, [o.eval_tokens] * len(prompts),
                           concurrency=o.max_batch_size, warmup=0, ignore_eos=True)
        dec = summarize_decoding(recs, K, f"{mode} K={K}")
        res[f"{mode} K={K}"] = {"acceptance_length": dec["acceptance_length"],
                                "acceptance_per_position": dec["acceptance_per_position"],
                                "draft_acceptance_rate": dec["draft_acceptance_rate"]}
    return res


def run(o: FinetuneOptions, echo: Callable[[str], None] = print) -> dict:
    from mtp_core.loader.checkpoint import open_checkpoint

    if o.num_threads:
        torch.set_num_threads(o.num_threads)
    t_start = time.perf_counter()
    ckpt = open_checkpoint(o.model_dir)
    cfg = ckpt.config
    check_inputs(o, cfg.num_nextn_predict_layers)
    train_ids, eval_ids = _prompt_ids(o, ckpt)
    n_tokens = sum(len(p) for p in train_ids) + len(train_ids) * o.gen_tokens
    src_bytes = sum(f.stat().st_size for f in ckpt.shard_tensors)
    check_disk(o, n_tokens, cfg.hidden_size, src_bytes if not o.link else src_bytes // 4)
    num_modules = o.add_mtp or cfg.num_nextn_predict_layers
    if o.mtp_mode == "vanilla" and num_modules < 2:
        echo("note: with one MTP module Vanilla and Eagle K=1 are the same drafting")
    meta = _claim_work_dir(o, ckpt, train_ids)
    echo(f"train-mtp: {len(train_ids)} training prompts, {len(eval_ids)} held-out, "
         f"{num_modules} MTP module(s){' (new)' if o.add_mtp else ''}, mode {o.mtp_mode}")

    gen = Generator(o, ckpt.model_dir)
    settings = eval_settings(o, num_modules)
    t_data = time.perf_counter()
    paths = build_cache(o, gen, train_ids, meta, echo)
    data_s = time.perf_counter() - t_data
    before = _acceptance_before(o, ckpt, eval_ids, settings)
    gen._llm = None
    for label, r in before.items():
        echo(f"before: {label} AL {r['acceptance_length']:.3f} per position "
             f"{[round(a, 3) for a in r['acceptance_per_position']]}")

    cache = Cache.load(paths)
    model, ckpt2, config_raw = build_training_model(o)
    t_train = time.perf_counter()
    history = train_modules(o, model, cache, echo)
    train_s = time.perf_counter() - t_train
    del cache

    trained = trained_module_ids(o, num_modules)
    counts = {"num_train_prompts": len(train_ids), "num_heldout_prompts": len(eval_ids),
              "num_train_tokens_est": n_tokens, "added_modules": o.add_mtp, "trained_modules": [k + 1 for k in trained]}
    times = {"data_seconds_this_run": round(data_s, 1), "train_seconds_this_run": round(train_s, 1),
             "steps": o.max_steps, "final_loss": history[-1]["loss"] if history else None}
    report = _write_checkpoint(o, ckpt, model, config_raw, trained, (eval_ids, settings, before), counts, times, echo)
    if not o.keep_work:
        _clean_work_dir(o)
    echo(f"wrote {Path(o.out)} ({time.perf_counter() - t_start:.0f} s; training {train_s:.0f} s)")
    return report


def _prompt_ids(o: FinetuneOptions, ckpt) -> tuple[list[list[int]], list[list[int]]]:
    """The training and held-out prompts as token ids (each cut to leave room for its continuation)."""
    from mtp_core.tokenizer import Tokenizer

    cfg = ckpt.config
    items = read_prompts(o.prompts)
    eval_items = read_prompts(o.eval_prompts) if o.eval_prompts is not None else None
    tok = Tokenizer.from_dir(ckpt.model_dir)
    max_prompt = cfg.max_position_embeddings - max(o.gen_tokens, o.eval_tokens) - 2 * o.eval_k - 2
    if max_prompt < 1:
        raise ValueError(f"--gen_tokens/--eval_tokens leave no room for a prompt within max_position_embeddings "
                         f"{cfg.max_position_embeddings}; lower them")
    ids = encode_prompts(tok, items, o.chat_template, max_prompt)
    if eval_items is not None:
        return ids, encode_prompts(tok, eval_items, o.chat_template, max_prompt)[:o.max_eval_prompts]
    tr, ev = split_prompts(len(ids), o)
    return [ids[i] for i in tr], [ids[i] for i in ev]


def _claim_work_dir(o: FinetuneOptions, ckpt, train_ids: list[list[int]]) -> dict:
    """The work directory, refused when it holds a training run with other settings; returns the cache's meta."""
    o.work.mkdir(parents=True, exist_ok=True)
    fp = source_fingerprint(ckpt)
    meta = {"source": fp, "gen_batch": o.gen_batch, "gen_tokens": o.gen_tokens, "temperature": o.temperature,
            "seed": o.seed, "topk": o.topk, "version": 1}
    train_meta = {**meta, "prompts": json_digest(train_ids), "add_mtp": o.add_mtp, "mtp_mode": o.mtp_mode,
                  "eagle_depth": o.eagle_depth,
                  "lr": o.lr, "batch_size": o.batch_size, "seq_len": o.seq_len, "kl_weight": o.kl_weight}
    tm_path = o.work / "train_meta.json"
    if tm_path.is_file() and (o.work / "state").is_dir():
        old = json.loads(tm_path.read_text())
        if {k: v for k, v in old.items() if k != "max_steps"} != train_meta:
            raise ValueError(f"{o.work} holds a training run with other settings; delete it, pass another "
                             "--work_dir, or rerun with the same flags to resume")
    atomic_json({**train_meta, "max_steps": o.max_steps}, tm_path)
    return meta


def _acceptance_before(o: FinetuneOptions, ckpt, eval_ids: list[list[int]], settings: list[tuple[str, int]]
                       ) -> dict[str, dict]:
    """The source's AL on the held-out prompts (kept in the work directory for a rerun; 1.0 without modules)."""
    before_path = o.work / "eval_before.json"
    if before_path.is_file():
        return json.loads(before_path.read_text())
    if ckpt.config.num_nextn_predict_layers:
        before = acceptance(ckpt.model_dir, o, eval_ids, settings)
        atomic_json(before, before_path)
        return before
    return {f"{m} K={k}": {"acceptance_length": 1.0, "acceptance_per_position": [],
                           "draft_acceptance_rate": None, "note": "no MTP modules"} for m, k in settings}


def _write_checkpoint(o: FinetuneOptions, ckpt, model: DeepseekV3ForCausalLM, config_raw: dict, trained: list[int],
                      evaluation: tuple, counts: dict, times: dict, echo: Callable[[str], None]) -> dict:
    """The checkpoint and its report, built in a temporary sibling of --out, measured (AL after), then renamed
    into place (replacing an old --out only now); evaluation: (held-out ids, settings, AL before)."""
    eval_ids, settings, before = evaluation
    out = Path(o.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        summary = write_output(o, ckpt, model, config_raw, tmp, trained)
        after = acceptance(tmp, o, eval_ids, settings)
        for label, r in after.items():
            b = before.get(label, {}).get("acceptance_length")
            echo(f"after:  {label} AL {r['acceptance_length']:.3f} (before {b:.3f}) per position "
                 f"{[round(a, 3) for a in r['acceptance_per_position']]}")
        report = {"source": str(o.model_dir), "options": {k: (str(v) if isinstance(v, Path) else v)
                                                           for k, v in asdict(o).items()},
                  **counts, "before": before, "after": after, **times, **summary}
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _clean_work_dir(o: FinetuneOptions) -> None:
    """Only what this command put there (--work_dir may be a directory of the user's)."""
    for name in ("cache", "state", "state.tmp"):
        shutil.rmtree(o.work / name, ignore_errors=True)
    for name in ("eval_before.json", "train_meta.json"):
        (o.work / name).unlink(missing_ok=True)
    try:
        o.work.rmdir()
    except OSError:
        pass
