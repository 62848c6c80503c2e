"""Held-out exact-match accuracy per family with fp32 and with bf16 weights (the native CPU decode step
computes in fp32 either way; bf16 halves the bytes it streams). Greedy, EOS honoured, Eagle K=3 (lossless).

    python scripts/dtype_accuracy.py [MODEL_DIR] [--per_task 50] [--max_tokens 512]
"""
from __future__ import annotations

import argparse
import time

import torch

from mtp_core.config import LLMConfig, SpeculativeConfig
from mtp_core.data import FAMILIES, score
from mtp_core.data.dataset import TARGET_SETS, eval_records
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("model_dir", nargs="?", default="mtp_core/assets/tiny-r1")
ap.add_argument("--per_task", type=int, default=50)
ap.add_argument("--max_tokens", type=int, default=512)
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()
torch.set_num_threads(args.threads)
records = [r for f in FAMILIES for r in eval_records(f, args.per_task)]
records += [r for name, family, digits in TARGET_SETS for r in eval_records(family, args.per_task, 1234, digits, name)]
acc, secs = {}, {}
for dtype in ("float32", "bfloat16"):
    llm = LLM(LLMConfig(model_dir=args.model_dir, dtype=dtype, max_batch_size=16,
                        speculative_config=SpeculativeConfig(num_nextn_predict_layers=3, mtp_mode="eagle")))
    t0 = time.perf_counter()
    outs = llm.generate([llm.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records],
                        SamplingParams(max_tokens=args.max_tokens))
    secs[dtype] = time.perf_counter() - t0
    acc[dtype] = score(records, [o.text for o in outs])
print(f"{len(records)} held-out questions, {args.model_dir}; wall: fp32 {secs['float32']:.0f} s, "
      f"bf16 {secs['bfloat16']:.0f} s")
print("| task | fp32 | bf16 | delta |\n| --- | --- | --- | --- |")
for task in acc["float32"]:
    a, b = acc["float32"][task], acc["bfloat16"][task]
    print(f"| {task} | {100 * a:.0f}% | {100 * b:.0f}% | {100 * (b - a):+.0f} |")
