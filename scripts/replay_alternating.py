"""MTP at real widths with a replayed acceptance, its settings taking turns in one process (issue 39): one model
load (a 16-layer FP8 scale checkpoint is ~10 GB; two would not fit beside each other), one engine per setting
over it, the rounds alternating so that the VM's speed phases (10-40% for seconds at a time) fall on every side.

    python3 -m cli prepare-dataset --output syn.jsonl --synthetic --num_requests 6 --input_tokens 64 \\
        --output_tokens 64 --model_dir CKPT
    python3 scripts/replay_alternating.py CKPT syn.jsonl [--threads 2] [--rounds 4] [--rates r1] [--fixed 1,2,3] \\
        [--map MAP]

Settings: n0 (nextn=0), default (MTP K = 3 as the README turns it on: cost policy, auto mode), default+map (the same
drafting over a draft vocabulary, --map) and fixed Eagle counts (--fixed), the MTP ones with their drafts replaced
by the target's own greedy continuation at the given rates (speculative/replay.py; benchmarks only). Each round runs
every prompt through every engine, batch 1, prefill included, in an order that rotates by round; an engine keeps its
state (its policy learns). Prints per round each setting's output tokens per second, then per setting the median
ratio to n0 and its draft counts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig  # noqa: E402
from mtp_core.engine.engine import Engine  # noqa: E402
from mtp_core.llm import LLM  # noqa: E402
from mtp_core.sampling import SamplingParams  # noqa: E402
from mtp_core.speculative.replay import ReplayDrafts, parse_rates  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("dataset", help="JSONL with a prompt per line (cli prepare-dataset --synthetic)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rates", default="r1")
    ap.add_argument("--fixed", default="", help="fixed Eagle counts to run too, e.g. 1,2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--map", default="", help="a draft vocabulary (mtp token-map): adds the setting default+map")
    a = ap.parse_args()
    kv = KvCacheConfig(max_tokens=4096, enable_block_reuse=False)
    llm = LLM(LLMConfig(model_dir=a.ckpt, max_batch_size=1, num_threads=a.threads, max_seq_len=512,
                        kv_cache_config=kv))
    rows = [json.loads(line) for line in open(a.dataset)]
    prompts = [r["input_ids"] if "input_ids" in r else llm.tokenizer.encode(r["prompt"], add_special_tokens=False)
               for r in rows]
    params = SamplingParams(max_tokens=a.tokens, ignore_eos=True)
    eos, think = list(llm.tokenizer.eos_token_ids), llm.tokenizer.think_token_ids()
    engines = {"n0": llm.engine}
    specs = {"default": SpeculativeConfig(num_nextn_predict_layers=3)}
    if a.map:
        specs["default+map"] = SpeculativeConfig(num_nextn_predict_layers=3, draft_token_map=a.map)
    specs.update({f"k{k}": SpeculativeConfig(num_nextn_predict_layers=int(k), draft_len_policy="fixed",
                                             mtp_mode="eagle") for k in a.fixed.split(",") if k})
    for name, spec in specs.items():
        engines[name] = Engine(llm.model, dataclasses.replace(llm.config, speculative_config=spec), eos, think)
    conts = {tuple(p): list(o.token_ids) for p, o in zip(prompts, llm.generate(prompts, params))}
    replay = ReplayDrafts(parse_rates(a.rates), conts, llm.model.config.vocab_size)
    for name in specs:
        engines[name].spec.replay = replay
    names = list(engines)
    for name in names:                                            # warm-up: one prompt each
        llm.engine = engines[name]
        llm.generate(prompts[:1], params)
    speed: dict[str, list[float]] = {n: [] for n in names}
    print(f"{len(prompts)} prompts x {a.tokens} tokens, batch 1, {a.threads} threads, replay {replay.label()}",
          flush=True)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            llm.engine = engines[name]
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            speed[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        print(f"round {r}: " + "  ".join(f"{n} {speed[n][-1]:.2f}" for n in names), flush=True)
    for name in names[1:]:
        hist = engines[name].scheduler.finished_stats.draft_limit_per_step
        ratios = [x / b for x, b in zip(speed[name], speed["n0"])]
        print(f"{name:8s} / n0: median {statistics.median(ratios):.3f} (rounds "
              f"{', '.join(f'{x:.3f}' for x in ratios)}), drafts chosen per step (0..K) {hist}", flush=True)
    llm.engine = engines["n0"]


if __name__ == "__main__":
    main()
