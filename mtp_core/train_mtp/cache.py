"""`mtp train-mtp` data: the frozen main model's continuations, hidden states and top-k logits, cached in
resumable chunks, and the training batches drawn from them.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.model.forward_path import ForwardPath
from mtp_core.train_mtp.inputs import FinetuneOptions
from mtp_core.train_mtp.output import layer_of


def json_digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def source_fingerprint(ckpt) -> str:
    """The main model's identity: config (less num_nextn_predict_layers) + main tensors' names, dtypes, shapes
    and byte lengths. The cached data depends on the main model only, so a copy of the checkpoint with its
    MTP modules removed or retrained reuses the same cache."""
    L = ckpt.config.num_hidden_layers
    parts = [json.dumps({k: v for k, v in ckpt.config.raw.items() if k != "num_nextn_predict_layers"}, sort_keys=True)]
    for name in sorted(ckpt.shards):
        layer = layer_of(name)
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


def atomic_json(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


@torch.inference_mode()
def record_targets(model: DeepseekV3ForCausalLM, path: ForwardPath, seqs: list[list[int]], topk: int,
                   batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(hidden [T, H] f32 after the final norm, top-k logit values [T, k] f32, their ids [T, k] i32) per
    sequence, from one dense causal forward (right-padded batches: padding never reaches real positions) and
    the serving engine's LM head (path)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res: list = [None] * len(seqs)
    for s in range(0, len(order), batch):
        group = order[s:s + batch]
        S = max(len(seqs[i]) for i in group)
        ids = torch.zeros(len(group), S, dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, :len(seqs[i])] = torch.tensor(seqs[i])
        h = model.forward_dense(ids)
        logits = path.logits(h)
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
        atomic_json(meta, meta_path)
    paths = []
    n_chunks = math.ceil(len(prompts) / o.gen_batch)
    t0 = time.perf_counter()
    for c in range(n_chunks):
        path = cache / f"chunk-{c:05d}.safetensors"
        paths.append(path)
        first = c * o.gen_batch
        chunk = prompts[first:first + o.gen_batch]
        digest = json_digest(chunk)
        if path.is_file():
            if _chunk_digest(path) == digest:
                continue
            raise ValueError(f"the cache chunk {path} was made from other prompts; delete {cache} or pass "
                             "another --work_dir")
        outs = gen.continuations(chunk, first)
        seqs = [p + q for p, q in zip(chunk, outs)]
        rec = record_targets(gen.llm.model, gen.llm.engine.paths.forward_path, seqs, o.topk)
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
