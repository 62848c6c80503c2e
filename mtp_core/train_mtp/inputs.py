"""`mtp train-mtp` inputs: options, the prompts file, checks that run before anything is written.
"""
from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


MODES = ("eagle", "vanilla", "both")


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


