"""Greedy token-for-token parity on the shipped model's held-out prompts: the native CPU decode forward vs
the torch reference path (MTP_CORE_NATIVE_DECODE=0), and MTP (Eagle / Vanilla K=3) vs no MTP on the native
path; fp32 (and bf16 for its own MTP-vs-plain check with --bf16).

    python scripts/native_parity.py [MODEL_DIR] [--per_task 50] [--max_tokens 320] [--bf16]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from mtp_core.bench.eval_sets import accuracy_records
from mtp_core.config import LLMConfig, SpeculativeConfig
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("model_dir", nargs="?", default="mtp_core/assets/tiny-r1")
ap.add_argument("--per_task", type=int, default=50)
ap.add_argument("--max_tokens", type=int, default=320)
ap.add_argument("--threads", type=int, default=1)
ap.add_argument("--bf16", action="store_true")
ap.add_argument("--bf16_only", action="store_true")
args = ap.parse_args()
torch.set_num_threads(args.threads)
records = accuracy_records(args.per_task)


def run(dtype: str, nextn: int, mode: str, native: bool) -> list[list[int]]:
    os.environ["MTP_CORE_NATIVE_DECODE"] = "1" if native else "0"
    spec = SpeculativeConfig(num_nextn_predict_layers=nextn, mtp_mode=mode) if nextn else None
    llm = LLM(LLMConfig(model_dir=args.model_dir, dtype=dtype, max_batch_size=16, speculative_config=spec))
    assert (llm.model.native is not None) == native
    t0 = time.perf_counter()
    prompts = [llm.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records]
    outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))]
    print(f"  {dtype} nextn={nextn} {mode} {'native' if native else 'torch'}: {time.perf_counter() - t0:.0f} s",
          flush=True)
    return outs


def same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


print(f"{len(records)} held-out prompts x {args.max_tokens} tokens (EOS ignored), greedy, {args.model_dir}")
if not args.bf16_only:
    base = run("float32", 0, "auto", True)
    print(f"fp32 native vs torch path, nextn=0: {same(base, run('float32', 0, 'auto', False))}")
    for mode in ("eagle", "vanilla"):
        print(f"fp32 native, MTP {mode} K=3 vs nextn=0: {same(base, run('float32', 3, mode, True))}")
if args.bf16 or args.bf16_only:
    b16 = run("bfloat16", 0, "auto", True)
    for mode in ("eagle", "vanilla"):
        print(f"bf16 native, MTP {mode} K=3 vs nextn=0: {same(b16, run('bfloat16', 3, mode, True))}")
