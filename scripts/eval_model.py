"""Exact-match accuracy of a checkpoint on the held-out eval sets (every family + the 3-digit addition
target set), greedy with MTP (lossless, so the answers are those of plain greedy decoding), EOS honoured.

    python scripts/eval_model.py [MODEL_DIR] [--per_task 50] [--max_tokens 512] [--json OUT]
        [--relaxed [--relaxed_topk 10 --relaxed_delta 0.6]] [--mode eagle|vanilla] [--k 3]
        [--dtype float32|bfloat16]

With --relaxed the thinking phase uses relaxed acceptance (Vanilla K=3, top-10, delta 0.6 by default, as in
`mtp sweep`), which is not lossless: the answers can differ from plain greedy decoding.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from mtp_core.bench.eval_sets import accuracy_records
from mtp_core.bench.scoring import score
from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("model_dir", nargs="?", default="mtp_core/assets/tiny-r1")
ap.add_argument("--per_task", type=int, default=50)
ap.add_argument("--max_tokens", type=int, default=512)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--json")
ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                help="weights in memory (the native CPU step computes in fp32 either way)")
ap.add_argument("--mode", choices=("eagle", "vanilla"), default=None, help="default: eagle, or vanilla with --relaxed")
ap.add_argument("--k", type=int, default=3)
ap.add_argument("--kv_cache_dtype", choices=("auto", "fp8"), default="auto")
ap.add_argument("--relaxed", action="store_true")
ap.add_argument("--relaxed_topk", type=int, default=10)
ap.add_argument("--relaxed_delta", type=float, default=0.6)
args = ap.parse_args()
torch.set_num_threads(args.threads)
records = accuracy_records(args.per_task)
# a KV pool for the 16 sequences in flight only (the default takes 90% of free memory)
llm = LLM(LLMConfig(model_dir=args.model_dir, dtype=args.dtype, max_batch_size=16,
                    kv_cache_config=KvCacheConfig(max_tokens=16 * 1024, dtype=args.kv_cache_dtype),
                    speculative_config=SpeculativeConfig(
                        num_nextn_predict_layers=args.k,
                        mtp_mode=args.mode or ("vanilla" if args.relaxed else "eagle"),
                        use_relaxed_acceptance_for_thinking=args.relaxed,
                        relaxed_topk=args.relaxed_topk if args.relaxed else 1,
                        relaxed_delta=args.relaxed_delta if args.relaxed else 0.0,
                        draft_len_policy="fixed")))   # relaxed text depends on the drafts verified: K every step
t0 = time.perf_counter()
texts = []
for i in range(0, len(records), 32):     # in chunks; only the texts are kept
    chunk = records[i:i + 32]
    outs = llm.generate([llm.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in chunk],
                        SamplingParams(max_tokens=args.max_tokens))
    texts += [o.text for o in outs]
    del outs
acc = score(records, texts)
print(f"{len(records)} questions in {time.perf_counter() - t0:.0f} s ({args.model_dir}, {args.dtype}, "
      f"{'relaxed' if args.relaxed else 'strict'}, {args.mode or ('vanilla' if args.relaxed else 'eagle')} K={args.k})")
print("| task | exact match |\n| --- | --- |")
for task, a in acc.items():
    print(f"| {task} | {100 * a:.0f}% |")
if args.json:
    with open(args.json, "w") as f:
        json.dump({"per_task": args.per_task, "max_tokens": args.max_tokens, "dtype": args.dtype, "relaxed": args.relaxed,
                   "mode": args.mode or ("vanilla" if args.relaxed else "eagle"), "k": args.k, "accuracy": acc,
                   "generations": [{"task": r["task"], "question": r["question"], "answer": r["answer"],
                                    "text": t} for r, t in zip(records, texts)]}, f, indent=2)
