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
   at inference (`mtp_objective.mtp_depth_forward`): Vanilla chains module d at depth d, Eagle reuses module
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
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtp_core.config import ModelConfig
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.train.mtp_objective import mtp_depth_forward, shift_hidden

log = logging.getLogger("mtp.train_mtp")

MTP_SHARD = "model-mtp.safetensors"
REPORT = "train_mtp_report.json"
MODES = ("eagle", "vanilla", "both")
_PACKED = {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8}


@dataclass
class FinetuneOptions:
    model_dir: Path
    out: Path
    prompts: Path
    eval_prompts: Optional[Path] = None      # held-out prompts; default: a seeded split of --prompts
    heldout: float = 0.1                     # share of --prompts held out when no eval file is given
    max_eval_prompts: int = 32
    max_steps: int = 300
    lr: float = 5e-4
    weight_decay: float = 0.0
    mtp_mode: str = "both"                   # eagle: module 1 recursively; vanilla: module k at depth k
    eagle_depth: int = 3
    add_mtp: int = 0
    gen_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    topk: int = 8
    kl_weight: float = 0.0
    batch_size: int = 8
    seq_len: int = 256
    save_every: int = 100
    log_every: int = 10
    eval_tokens: int = 128
    eval_k: int = 3
    gen_batch: int = 64                      # prompts per cache chunk
    max_batch_size: int = 16                 # engine batch while generating / evaluating
    num_threads: Optional[int] = None
    work_dir: Optional[Path] = None
    keep_work: bool = False
    overwrite: bool = False
    chat_template: bool = True
    link: bool = True                        # hard-link untouched shards (else copy)

    @property
    def work(self) -> Path:
        return self.work_dir if self.work_dir is not None else self.out.with_name(self.out.name + ".train-mtp-work")


@dataclass
class PromptItem:
    text: Optional[str] = None
    ids: Optional[list[int]] = None


# ---- input checks ---------------------------------------------------------------------------------------

def read_prompts(path: Path) -> list[PromptItem]:
    """JSON lines (objects with "prompt", "text" or "input_ids" -- `mtp prepare-dataset` files work -- or
    JSON strings) or plain text, one prompt per non-blank line."""
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"prompt file {path} not found; pass --prompts with a JSONL or text file of prompts") from None
    except IsADirectoryError:
        raise ValueError(f"prompt file {path} is a directory; pass a JSONL or text file of prompts") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {path} ({getattr(e, 'strerror', None) or e.__class__.__name__}); "
                         "pass a readable UTF-8 JSONL or text file") from None
    lines = [(n, ln) for n, ln in enumerate(raw.splitlines(), 1) if ln.strip()]
    if not lines:
        raise ValueError(f"prompt file {path} holds no prompt; give one prompt per line (or JSONL)")
    jsonl = str(path).endswith((".jsonl", ".json")) or lines[0][1].lstrip().startswith("{")
    items: list[PromptItem] = []
    for n, ln in lines:
        if not jsonl:
            items.append(PromptItem(text=ln.rstrip("\r")))
            continue
        try:
            d = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg}); fix the line or use a plain-text file") from None
        if isinstance(d, str):
            d = {"prompt": d}
        if not isinstance(d, dict):
            raise ValueError(f"{path}:{n}: expected an object with \"prompt\" or \"input_ids\", got {type(d).__name__}")
        text = d.get("prompt", d.get("text"))
        ids = d.get("input_ids")
        if ids is not None:
            if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in ids)):
                raise ValueError(f"{path}:{n}: input_ids must be a non-empty list of non-negative integers")
            items.append(PromptItem(ids=list(ids)))
        elif isinstance(text, str) and text.strip():
            items.append(PromptItem(text=text))
        else:
            raise ValueError(f"{path}:{n}: needs a non-empty \"prompt\" (or \"text\") string or \"input_ids\"")
    return items


def _inside(a: Path, b: Path) -> bool:
    a, b = a.resolve(), b.resolve()
    return a == b or a.is_relative_to(b)


def check_inputs(o: FinetuneOptions, num_modules: int) -> None:
    """Every refusal that needs no model: one-line ValueErrors, before anything is written."""
    if o.add_mtp < 0:
        raise ValueError(f"--add_mtp must be >= 1, got {o.add_mtp}")
    if num_modules == 0 and not o.add_mtp:
        raise ValueError(f"{o.model_dir} has no MTP modules (num_nextn_predict_layers = 0); pass --add_mtp N "
                         "to create and train N of them")
    if num_modules and o.add_mtp:
        raise ValueError(f"--add_mtp creates MTP modules, but {o.model_dir} already has {num_modules}; drop "
                         "--add_mtp to fine-tune them")
    if o.mtp_mode not in MODES:
        raise ValueError(f"--mtp_mode must be eagle, vanilla or both, got {o.mtp_mode!r}")
    for name, v, lo in (("--max_steps", o.max_steps, 1), ("--gen_tokens", o.gen_tokens, 1),
                        ("--batch_size", o.batch_size, 1), ("--seq_len", o.seq_len, 8), ("--topk", o.topk, 1),
                        ("--save_every", o.save_every, 1), ("--eval_tokens", o.eval_tokens, 1),
                        ("--eval_k", o.eval_k, 1), ("--eagle_depth", o.eagle_depth, 1),
                        ("--gen_batch", o.gen_batch, 1), ("--log_every", o.log_every, 1)):
        if v < lo:
            raise ValueError(f"{name} must be >= {lo}, got {v}")
    if not (o.lr > 0 and o.kl_weight >= 0 and o.temperature >= 0 and 0 < o.heldout < 1):
        raise ValueError("--lr must be > 0, --kl_weight >= 0, --temperature >= 0 and --heldout in (0, 1)")
    if o.num_threads is not None and o.num_threads < 1:
        raise ValueError(f"--num_threads must be >= 1, got {o.num_threads}")
    src, out = Path(o.model_dir), Path(o.out)
    if _inside(out, src):
        raise ValueError(f"--out {out} is inside the source checkpoint {src}; choose a directory outside it")
    if out.exists() and _inside(src, out):
        raise ValueError(f"the source checkpoint {src} is inside --out {out}; choose another output directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; choose a new directory")
    if out.exists() and any(out.iterdir()) and not o.overwrite:
        raise ValueError(f"--out {out} exists and is not empty; choose a new directory or pass --overwrite")
    if _inside(o.work, src):
        raise ValueError(f"--work_dir {o.work} is inside the source checkpoint {src}; choose a directory outside it")


def _free_bytes(path: Path) -> int:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def check_disk(o: FinetuneOptions, num_tokens: int, hidden: int, out_bytes: int) -> None:
    """Refuse (before generating) when the cache + output would not fit on the disk."""
    cache = num_tokens * (hidden * 4 + o.topk * 8 + 4)
    done = sum(f.stat().st_size for f in (o.work / "cache").glob("chunk-*.safetensors")) if (o.work / "cache").is_dir() else 0
    need = max(cache - done, 0) + out_bytes + (64 << 20)
    free = _free_bytes(o.work)
    if need > free:
        raise ValueError(f"not enough disk for the self-distillation cache: needs ~{need >> 20} MiB, "
                         f"{free >> 20} MiB free under {o.work}; free space, point --work_dir elsewhere or lower "
                         "--gen_tokens / the number of prompts")


# ---- self-distillation data -----------------------------------------------------------------------------

def encode_prompts(tok, items: list[PromptItem], chat_template: bool, max_len: int) -> list[list[int]]:
    """Token ids: input_ids as given; text that already starts with BOS (pre-rendered) as is; otherwise the
    chat template when asked and the checkpoint has one, else the tokenizer's own special tokens. Prompts
    longer than max_len keep their last max_len tokens."""
    out = []
    bos = getattr(tok, "bos_token", None)
    for it in items:
        if it.ids is not None:
            ids = list(it.ids)
        elif bos and it.text.startswith(bos):
            ids = tok.encode(it.text, add_special_tokens=False)
        elif chat_template and tok.chat_template is not None:
            text = tok.apply_chat_template([{"role": "user", "content": it.text}], add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(it.text)
        out.append(ids[-max_len:])
    return out


def split_prompts(n: int, o: FinetuneOptions) -> tuple[list[int], list[int]]:
    """(train indices, held-out indices) of a seeded split (no eval file) -- the held-out ones never train."""
    order = list(range(n))
    random.Random(o.seed + 7_777).shuffle(order)
    n_eval = min(max(1, round(o.heldout * n)), o.max_eval_prompts)
    if n - n_eval < 1:
        raise ValueError(f"the prompt file holds {n} prompt(s): too few to hold some out; give at least 2 "
                         "prompts or a separate --eval_prompts file")
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def source_fingerprint(ckpt) -> str:
    """The main model's identity: config (less num_nextn_predict_layers) + main tensors' names, dtypes, shapes
    and byte lengths. The cached data depends on the main model only, so a copy of the checkpoint with its
    MTP modules removed or retrained reuses the same cache."""
    L = ckpt.config.num_hidden_layers
    parts = [json.dumps({k: v for k, v in ckpt.config.raw.items() if k != "num_nextn_predict_layers"}, sort_keys=True)]
    for name in sorted(ckpt.shards):
        layer = _layer_of(name)
        if layer is not None and layer >= L:
            continue
        v = ckpt.shard_tensors[ckpt.shards[name]][name]
        parts.append(f"{name}:{v['dtype']}:{v['shape']}:{v['data_offsets'][1] - v['data_offsets'][0]}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, metadata: Optional[dict] = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)


def _chunk_digest(path: Path) -> Optional[str]:
    try:
        with safe_open(str(path), framework="pt") as h:
            return (h.metadata() or {}).get("prompts")
    except Exception:  # noqa: BLE001 - a damaged chunk is simply generated again
        return None


def _atomic_json(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


@torch.inference_mode()
def record_targets(model: DeepseekV3ForCausalLM, seqs: list[list[int]], topk: int, batch: int = 8
                   ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(hidden [T, H] f32 after the final norm, top-k logit values [T, k] f32, their ids [T, k] i32) per
    sequence, from one dense causal forward (right-padded batches: padding never reaches real positions)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res: list = [None] * len(seqs)
    for s in range(0, len(order), batch):
        group = order[s:s + batch]
        S = max(len(seqs[i]) for i in group)
        ids = torch.zeros(len(group), S, dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
        h = model.forward_dense(ids)
        logits = model.compute_logits(h)
        val, idx = logits.topk(topk, dim=-1)
        for r, i in enumerate(group):
            n = len(seqs[i])
            res[i] = (h[r, :n].float().clone(), val[r, :n].float().clone(), idx[r, :n].to(torch.int32).clone())
    return res


class Generator:
    """The frozen main model behind the engine (created on first use: a resumed run may not need it)."""

    def __init__(self, o: FinetuneOptions, model_dir: Path) -> None:
        self.o, self.model_dir, self._llm = o, model_dir, None

    @property
    def llm(self):
        if self._llm is None:
            from mtp_core.config import LLMConfig
            from mtp_core.llm import LLM
            self._llm = LLM(LLMConfig(model_dir=str(self.model_dir), max_batch_size=self.o.max_batch_size,
                                      num_threads=self.o.num_threads))
        return self._llm

    def continuations(self, prompts: list[list[int]], first_index: int) -> list[list[int]]:
        from mtp_core.sampling import SamplingParams
        o = self.o
        params = [SamplingParams(max_tokens=o.gen_tokens, temperature=o.temperature,
                                 seed=(o.seed * 1_000_003 + first_index + i) if o.temperature > 0 else None)
                  for i in range(len(prompts))]
        # in waves of one engine batch: a request admitted while others decode makes every step of the wave
        # a mixed prefill + decode step (the slow naive attention path); waves keep decode steps pure
        res: list[list[int]] = []
        for s in range(0, len(prompts), o.max_batch_size):
            outs = self.llm.generate(prompts[s:s + o.max_batch_size], params[s:s + o.max_batch_size])
            res += [list(r.token_ids) for r in outs]
        return res


def build_cache(o: FinetuneOptions, gen: Generator, prompts: list[list[int]], meta: dict,
                echo: Callable[[str], None]) -> list[Path]:
    """Writes the missing chunks; returns every chunk path in order."""
    cache = o.work / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    meta_path = cache / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if old != meta:
            raise ValueError(f"the cache in {cache} was made from other settings (source checkpoint or generation "
                             "flags); delete it or pass another --work_dir")
    else:
        _atomic_json(meta, meta_path)
    paths = []
    n_chunks = math.ceil(len(prompts) / o.gen_batch)
    t0 = time.perf_counter()
    for c in range(n_chunks):
        path = cache / f"chunk-{c:05d}.safetensors"
        paths.append(path)
        first = c * o.gen_batch
        chunk = prompts[first:first + o.gen_batch]
        digest = _digest(chunk)
        if path.is_file():
            if _chunk_digest(path) == digest:
                continue
            raise ValueError(f"the cache chunk {path} was made from other prompts; delete {cache} or pass "
                             "another --work_dir")
        outs = gen.continuations(chunk, first)
        seqs = [p + q for p, q in zip(chunk, outs)]
        rec = record_targets(gen.llm.model, seqs, o.topk)
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        _atomic_save({"ids": torch.tensor([t for s in seqs for t in s], dtype=torch.int32),
                      "hidden": torch.cat([r[0] for r in rec]).contiguous(),
                      "top_val": torch.cat([r[1] for r in rec]).contiguous(),
                      "top_idx": torch.cat([r[2] for r in rec]).contiguous(),
                      "lengths": lens, "prompt_lengths": torch.tensor([len(p) for p in chunk], dtype=torch.int64)},
                     path, metadata={"prompts": digest})
        echo(f"self-distillation data: chunk {c + 1}/{n_chunks} ({sum(len(q) for q in outs)} generated tokens, "
             f"{time.perf_counter() - t0:.0f} s)")
    return paths


@dataclass
class Cache:
    ids: torch.Tensor          # [T] long
    hidden: torch.Tensor       # [T, H]
    top_val: torch.Tensor      # [T, k]
    top_idx: torch.Tensor      # [T, k] long
    starts: list[int]
    lengths: list[int]
    prompt_lengths: list[int]

    @classmethod
    def load(cls, paths: list[Path]) -> "Cache":
        parts = [load_file(str(p)) for p in paths]
        lengths = [int(x) for p in parts for x in p["lengths"]]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        return cls(torch.cat([p["ids"] for p in parts]).long(), torch.cat([p["hidden"] for p in parts]),
                   torch.cat([p["top_val"] for p in parts]), torch.cat([p["top_idx"] for p in parts]).long(),
                   starts, lengths, [int(x) for p in parts for x in p["prompt_lengths"]])


def make_batch(cache: Cache, step: int, o: FinetuneOptions) -> dict[str, torch.Tensor]:
    """Windows of at most seq_len tokens from batch_size sequences, a pure function of (seed, step): half end
    at the sequence end (the whole continuation with its prompt context), half at a random point."""
    rng = random.Random(o.seed * 1_000_003 + step)
    rows = [rng.randrange(len(cache.lengths)) for _ in range(o.batch_size)]
    spans = []
    for r in rows:
        n, s0 = cache.lengths[r], cache.starts[r]
        w = min(n, o.seq_len)
        end = n if rng.random() < 0.5 else rng.randint(w, n)
        spans.append((s0 + end - w, w))
    S = max(w for _, w in spans)
    H, k = cache.hidden.shape[1], cache.top_val.shape[1]
    ids = torch.zeros(len(rows), S, dtype=torch.long)
    hid = torch.zeros(len(rows), S, H, dtype=cache.hidden.dtype)
    val = torch.zeros(len(rows), S, k)
    idx = torch.zeros(len(rows), S, k, dtype=torch.long)
    valid = torch.zeros(len(rows), S, dtype=torch.bool)
    for b, (a, w) in enumerate(spans):
        ids[b, :w], hid[b, :w] = cache.ids[a:a + w], cache.hidden[a:a + w]
        val[b, :w], idx[b, :w] = cache.top_val[a:a + w], cache.top_idx[a:a + w]
        valid[b, :w] = True
    return {"ids": ids, "hidden": hid.float(), "top_val": val, "top_idx": idx, "valid": valid}


# ---- training -------------------------------------------------------------------------------------------

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

    src_model, ckpt = load_model(o.model_dir, dtype="float32")
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


def train_modules(o: FinetuneOptions, model: DeepseekV3ForCausalLM, cache: Cache,
                  echo: Callable[[str], None]) -> list[dict]:
    """Trains the MTP modules in place (resuming from WORK/state); returns the history."""
    from mtp_core.train.trainer import _load_state, _save_state, balance_experts

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
    step, history = (_load_state(state_dir, mtp, opt) if (state_dir / "state.json").is_file() else (0, []))
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
            _save_state(state_dir, mtp, opt, step, history)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return history


# ---- output ---------------------------------------------------------------------------------------------

def _layer_of(name: str) -> Optional[int]:
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
    L = ckpt.config.num_hidden_layers
    n_mod = model.num_mtp_modules
    src_dtypes = {n: hdr[n]["dtype"] for f, hdr in ckpt.shard_tensors.items() for n in hdr if ckpt.shards.get(n) == f}
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
        main = [n for n in names if (_layer_of(n) is None or _layer_of(n) < L)]
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
    # the MTP shard
    mtp_tensors: dict[str, torch.Tensor] = {}
    cfg_dtype = str(config_raw.get("torch_dtype") or "bfloat16")
    raw_src: dict[str, torch.Tensor] = {}
    need_raw = [n for n in ckpt.shards if (_layer_of(n) or -1) >= L and _layer_of(n) - L not in trained]
    need_raw += ["model.embed_tokens.weight", "lm_head.weight"]
    for n in need_raw:
        if n in ckpt.shards:
            with safe_open(str(ckpt.shards[n]), framework="pt") as h:
                raw_src[n] = h.get_tensor(n)
    state = model.state_dict()
    for k in range(n_mod):
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
    save_file(mtp_tensors, str(dest / MTP_SHARD), metadata={"format": "pt"})
    for n in mtp_tensors:
        weight_map[n] = MTP_SHARD
    total = 0
    for rel in set(weight_map.values()):
        total += (dest / rel).stat().st_size
    (dest / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    (dest / "config.json").write_text(json.dumps(config_raw, indent=2) + "\n")
    # NVFP4 (ModelOpt): the bf16 MTP linears are excluded from quantization
    hf_q = src / "hf_quant_config.json"
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


# ---- evaluation -----------------------------------------------------------------------------------------

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
    eos, think = sorted(llm.engine.eos_token_ids), llm.engine.think_ids
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


# ---- the command ----------------------------------------------------------------------------------------

def run(o: FinetuneOptions, echo: Callable[[str], None] = print) -> dict:
    from mtp_core.loader.checkpoint import open_checkpoint
    from mtp_core.tokenizer import Tokenizer

    if o.num_threads:
        torch.set_num_threads(o.num_threads)
    t_start = time.perf_counter()
    ckpt = open_checkpoint(o.model_dir)
    cfg = ckpt.config
    check_inputs(o, cfg.num_nextn_predict_layers)
    items = read_prompts(o.prompts)
    eval_items = read_prompts(o.eval_prompts) if o.eval_prompts is not None else None
    tok = Tokenizer.from_dir(ckpt.model_dir)
    max_prompt = cfg.max_position_embeddings - max(o.gen_tokens, o.eval_tokens) - 2 * o.eval_k - 2
    if max_prompt < 1:
        raise ValueError(f"--gen_tokens/--eval_tokens leave no room for a prompt within max_position_embeddings "
                         f"{cfg.max_position_embeddings}; lower them")
    ids = encode_prompts(tok, items, o.chat_template, max_prompt)
    if eval_items is not None:
        train_ids, eval_ids = ids, encode_prompts(tok, eval_items, o.chat_template, max_prompt)[:o.max_eval_prompts]
    else:
        tr, ev = split_prompts(len(ids), o)
        train_ids, eval_ids = [ids[i] for i in tr], [ids[i] for i in ev]
    n_tokens = sum(len(p) for p in train_ids) + len(train_ids) * o.gen_tokens
    src_bytes = sum(f.stat().st_size for f in ckpt.shard_tensors)
    check_disk(o, n_tokens, cfg.hidden_size, src_bytes if not o.link else src_bytes // 4)
    num_modules = o.add_mtp or cfg.num_nextn_predict_layers
    if o.mtp_mode == "vanilla" and num_modules < 2:
        echo("note: with one MTP module Vanilla and Eagle K=1 are the same drafting")
    o.work.mkdir(parents=True, exist_ok=True)
    fp = source_fingerprint(ckpt)
    meta = {"source": fp, "gen_batch": o.gen_batch, "gen_tokens": o.gen_tokens, "temperature": o.temperature,
            "seed": o.seed, "topk": o.topk, "version": 1}
    train_meta = {**meta, "prompts": _digest(train_ids), "add_mtp": o.add_mtp, "mtp_mode": o.mtp_mode, "eagle_depth": o.eagle_depth,
                  "lr": o.lr, "batch_size": o.batch_size, "seq_len": o.seq_len, "kl_weight": o.kl_weight}
    tm_path = o.work / "train_meta.json"
    if tm_path.is_file() and (o.work / "state").is_dir():
        old = json.loads(tm_path.read_text())
        if {k: v for k, v in old.items() if k != "max_steps"} != train_meta:
            raise ValueError(f"{o.work} holds a training run with other settings; delete it, pass another "
                             "--work_dir, or rerun with the same flags to resume")
    _atomic_json({**train_meta, "max_steps": o.max_steps}, tm_path)
    echo(f"train-mtp: {len(train_ids)} training prompts, {len(eval_ids)} held-out, "
         f"{num_modules} MTP module(s){' (new)' if o.add_mtp else ''}, mode {o.mtp_mode}")

    gen = Generator(o, ckpt.model_dir)
    settings = eval_settings(o, num_modules)
    t_data = time.perf_counter()
    paths = build_cache(o, gen, train_ids, meta, echo)
    data_s = time.perf_counter() - t_data
    before_path = o.work / "eval_before.json"
    if before_path.is_file():
        before = json.loads(before_path.read_text())
    elif cfg.num_nextn_predict_layers:
        before = acceptance(ckpt.model_dir, o, eval_ids, settings)
        _atomic_json(before, before_path)
    else:
        before = {f"{m} K={k}": {"acceptance_length": 1.0, "acceptance_per_position": [],
                                  "draft_acceptance_rate": None, "note": "no MTP modules"} for m, k in settings}
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

    out = Path(o.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        summary = write_output(o, ckpt, model, config_raw, tmp, trained_module_ids(o, num_modules))
        after = acceptance(tmp, o, eval_ids, settings)
        for label, r in after.items():
            b = before.get(label, {}).get("acceptance_length")
            echo(f"after:  {label} AL {r['acceptance_length']:.3f} (before {b:.3f}) per position "
                 f"{[round(a, 3) for a in r['acceptance_per_position']]}")
        report = {"source": str(o.model_dir), "options": {k: (str(v) if isinstance(v, Path) else v)
                                                           for k, v in asdict(o).items()},
                  "num_train_prompts": len(train_ids), "num_heldout_prompts": len(eval_ids),
                  "num_train_tokens_est": n_tokens,
                  "added_modules": o.add_mtp, "trained_modules": [k + 1 for k in trained_module_ids(o, num_modules)],
                  "before": before, "after": after, "data_seconds_this_run": round(data_s, 1),
                  "train_seconds_this_run": round(train_s, 1), "steps": o.max_steps,
                  "final_loss": history[-1]["loss"] if history else None, **summary}
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
    if not o.keep_work:   # only what this command put there (--work_dir may be a directory of the user's)
        for name in ("cache", "state", "state.tmp"):
            shutil.rmtree(o.work / name, ignore_errors=True)
        for name in ("eval_before.json", "train_meta.json"):
            (o.work / name).unlink(missing_ok=True)
        try:
            o.work.rmdir()
        except OSError:
            pass
    echo(f"wrote {out} ({time.perf_counter() - t_start:.0f} s; training {train_s:.0f} s)")
    return report
