"""Where a decode step's time goes with MTP on but no drafts, against an engine at nextn=0 (issue 39).

    python3 -m cli prepare-dataset --output task.jsonl --num_requests 40 --output_tokens 128
    python3 scripts/step_parts.py --dataset task.jsonl [--batch 4] [--rounds 3]

Two engines on the shipped model, 1 thread: nextn=0, and MTP (nextn 3, cost policy) whose decisions are forced to
0 drafts, so that each of its steps is a k = 0 step. Each engine's step methods are wrapped with perf_counter
timers; every round generates the same requests (128 tokens each, EOS ignored) after a warm-up on other prompts,
the engines alternating, and the best round of each is printed as microseconds per step, part by part. The rounds
repeat their prompts: the nextn=0 engine serves them from the prefix cache in later rounds, the MTP engine (whose
prompts' MTP forwards wait) cannot, so the `execute` (prefill) column is not comparable between the two.
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from cli.common import DEFAULT_MODEL_DIR
from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams

PARTS = [("engine", "step", "step"), ("engine", "_forward", "forward"), ("native", "step_op", "op"),
         ("engine", "_schedule", "schedule"), ("engine", "_commit", "commit"), ("engine", "_choose_drafts", "choose"),
         ("engine", "_propose", "propose"), ("engine", "_store_drafts", "store"), ("engine", "_finish_step", "finish"),
         ("native_step", "_settle", "settle"), ("native_step", "step_for", "step_for"), ("runner", "execute", "execute")]


def build(nextn: int, batch: int) -> tuple[LLM, collections.Counter]:
    spec = SpeculativeConfig(num_nextn_predict_layers=nextn, draft_len_policy="cost") if nextn else None
    llm = LLM(LLMConfig(model_dir=str(DEFAULT_MODEL_DIR), speculative_config=spec, dtype="auto", max_seq_len=1024,
                        max_batch_size=batch, overlap_scheduler_on_cpu=False, num_threads=1,
                        kv_cache_config=KvCacheConfig(max_tokens=16384, tokens_per_block=16)))
    e = llm.engine
    if e.paths.native_step is None:
        raise SystemExit("the native step is not available on this host (build the extension)")
    if nextn:
        e.spec.policy._decide = lambda *a: (0, True, True)    # every decision: 0 drafts, settled
    spent: collections.Counter = collections.Counter()
    owners = {"engine": e, "native": e.paths.native_step.native, "native_step": e.paths.native_step, "runner": e.paths.runner}
    for owner, attr, key in PARTS:
        obj = owners[owner]
        fn = getattr(obj, attr)

        def timed(*a, _fn=fn, _key=key, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_key] += time.perf_counter() - t0
        setattr(obj, attr, timed)
    return llm, spent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dataset", required=True, help="JSONL with a prompt per line (cli prepare-dataset)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    prompts = [json.loads(line)["prompt"] for line in open(a.dataset)]
    if len(prompts) < 16:
        raise SystemExit(f"{a.dataset}: need at least 16 prompts, found {len(prompts)}")
    engines = {"nextn0": build(0, a.batch), "mtp_k0": build(3, a.batch)}
    ids = [engines["nextn0"][0].tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    warm, measured = ids[:8], ids[8:40]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    best: dict[str, tuple[float, dict, int]] = {}
    for _ in range(a.rounds):
        for name, (llm, spent) in engines.items():
            llm.generate(warm, params)
            spent.clear()
            n0 = llm.engine.num_steps
            llm.generate(measured, params)
            steps = llm.engine.num_steps - n0
            if name not in best or spent["step"] < best[name][0]:
                best[name] = (spent["step"], dict(spent), steps)
    for name, (_, spent, steps) in best.items():
        parts = " ".join(f"{k} {1e6 * v / steps:.1f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
        print(f"{name} batch {a.batch}, {steps} steps, us/step: {parts}")


if __name__ == "__main__":
    main()
