"""Decode step time against context length: DeepSeek-V3.2 sparse attention (DSA) vs DeepSeek-V3's dense MLA.

    python3 scripts/dsa_long_context.py CKPT [CKPT ...] [--contexts 1024,16384] [--threads 2] [--steps 7]
        [--dtype auto] [--json OUT]

Per checkpoint (each in a fresh process: its own memory) and context length C: the native CPU decode forward of
one token at position C - 1 (batch 1, nextn=0: every main layer, final norm, LM head), with positions 0..C-2
already in the paged cache. The cache is filled with synthetic rows (c_kv and k_pe ~ N(0, 1) like RMS-normed
latents, index keys ~ N(0, 1) like LayerNorm'd ones) instead of a C-token prefill, which at V3.2's widths on two
cores would take minutes per context: the step's cost does not depend on the values (dense MLA reads every key;
DSA scores every index key, selects index_topk of them whatever their scores, and attends to those). Each step
rewrites the same slot, so the context stays C. The contexts alternate step by step (a shared machine's load hits
them alike). Reported: the median and the best of `--steps` timed steps per context after two warm-up rounds,
and their ratios to the first context's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
PAGE = 64


def measure(ckpt: str, contexts: list[int], threads: int, steps: int, dtype: str) -> dict:
    import torch
    torch.set_num_threads(threads)
    sys.path.insert(0, str(HERE))
    from mtp_core.loader import load_model
    from mtp_core.model import AttentionMetadata, DeepseekV3ForCausalLM
    from mtp_core.native.forward_path import prepare_decode

    model = load_model(ckpt, dtype, make_model=DeepseekV3ForCausalLM)[0]
    prepare_decode(model)
    nd = model.native
    if nd is None:
        raise SystemExit("the native CPU forward is off for this checkpoint (see the log)")
    cfg = model.config
    cache_dtype = next(model.parameters()).dtype
    out = {"ckpt": ckpt, "threads": threads, "dtype": str(cache_dtype).removeprefix("torch."),
           "dsa": cfg.is_dsa, "index_topk": cfg.index_topk, "summary": nd.handle.summary(), "contexts": {}}
    g = torch.Generator().manual_seed(0)
    setups = {}
    for C in contexts:
        blocks = -(-C // PAGE)
        caches = [torch.randn(blocks, PAGE, cfg.kv_cache_dim, generator=g).to(cache_dtype)
                  for _ in range(cfg.num_hidden_layers)]
        table = list(range(blocks))[::-1]
        setups[C] = (caches, AttentionMetadata.build([[C - 1]], [table], PAGE, use_absorbed=True))
    ids = torch.tensor([17])
    times: dict[int, list[float]] = {C: [] for C in contexts}
    with torch.inference_mode():
        for i in range(steps + 2):          # the contexts alternate, so that the machine's load hits them alike
            for C, (caches, meta) in setups.items():
                t0 = time.perf_counter()
                nd.logits(nd.forward(ids, meta, caches))
                if i >= 2:
                    times[C].append(time.perf_counter() - t0)
    for C in contexts:
        out["contexts"][C] = {"median_ms": round(1e3 * statistics.median(times[C]), 2),
                              "best_ms": round(1e3 * min(times[C]), 2)}
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    first = out["contexts"][contexts[0]]
    for C in contexts:
        r = out["contexts"][C]
        r["median_ratio"] = round(r["median_ms"] / first["median_ms"], 3)
        r["best_ratio"] = round(r["best_ms"] / first["best_ms"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="+")
    ap.add_argument("--contexts", default="1024,16384")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    contexts = [int(c) for c in a.contexts.split(",")]
    if a.one:
        print(json.dumps(measure(a.ckpts[0], contexts, a.threads, a.steps, a.dtype)))
        return
    results = []
    for ckpt in a.ckpts:
        cmd = [sys.executable, __file__, ckpt, "--one", "--contexts", a.contexts, "--threads", str(a.threads),
               "--steps", str(a.steps), "--dtype", a.dtype]
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(HERE)))
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            continue
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
