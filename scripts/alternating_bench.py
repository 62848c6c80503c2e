"""Decode settings compared in one process, the engines taking turns (issue 39): the steadiest harness found on a
VM whose speed moves by 10-30% within minutes, where separate `mtp bench` runs carry that drift.

    python3 -m cli prepare-dataset --output task.jsonl --num_requests 160 --output_tokens 128
    python3 scripts/alternating_bench.py --dataset task.jsonl --batch 4 --rounds 12 --chunk 16 \\
        --settings n0,k0,k3,default

One engine per setting, all on the shipped model (or --model_dir), 1 thread: n0 (nextn=0), default (MTP K = 3 as
the README turns it on: cost policy, auto mode), k0 (the same with every decision forced to 0 drafts: a step at 0
drafts, whatever the policy would choose), kept (the default making every prompt position's hidden state at
prefill, as before deferred prompts left their last layer for later), prior0 (the default with the cost prior
before it came from the bytes a draft reads: 1 + 0.4 k before any step is measured, 1 + 0.25 k from one measured
count), k1 / k2 / k3 (fixed Eagle counts). Each round gives every engine the
same chunk of prompts (a new chunk each round; 128 tokens, EOS ignored) through `LLM.generate`, in an order that
rotates by round; an engine keeps its state across rounds (its policy learns as a server's would). Prints each
setting's tokens/s over all rounds, its total and median-round speed over the first setting's, and the draft
counts the MTP engines verified per row-step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cli.common import DEFAULT_MODEL_DIR  # noqa: E402
from mtp_core.config import LLMConfig, SpeculativeConfig  # noqa: E402
from mtp_core.llm import LLM  # noqa: E402
from mtp_core.sampling import SamplingParams  # noqa: E402
from mtp_core.speculative.costs import CostPrior  # noqa: E402

SETTINGS = {
    "n0": None,
    "default": dict(num_nextn_predict_layers=3),
    "k0": dict(num_nextn_predict_layers=3),
    "kept": dict(num_nextn_predict_layers=3),
    "prior0": dict(num_nextn_predict_layers=3),
    **{f"k{k}": dict(num_nextn_predict_layers=k, draft_len_policy="fixed", mtp_mode="eagle") for k in (1, 2, 3)},
}


def build(name: str, model_dir: str, batch: int) -> LLM:
    spec = SETTINGS[name]
    llm = LLM(LLMConfig(model_dir=model_dir, speculative_config=SpeculativeConfig(**spec) if spec else None,
                        max_batch_size=batch, num_threads=1))
    if name == "k0":
        llm.engine.spec.policy._decide = lambda *a: (0, True, True)    # every decision: 0 drafts, settled
    if name == "prior0":       # the cost prior before it came from the model's bytes: 0.4 per draft, 0.25 per verified
        pol = llm.engine.spec.policy                       # draft from one measured count
        pol.costs.prior = CostPrior(pol.costs.prior.catchup_ratio, 0.15, fused=False)
    if name == "kept":
        llm.engine.paths.runner.split_prompts = None     # every prompt hidden state made at prefill, as before
    return llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True, help="JSONL with a prompt per line (cli prepare-dataset)")
    ap.add_argument("--model_dir", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=8, help="prompts per engine per round")
    ap.add_argument("--settings", default="n0,k0,k3,default", help=f"comma-separated, the first the baseline: "
                    f"{', '.join(SETTINGS)}")
    a = ap.parse_args()
    names = a.settings.split(",")
    bad = [n for n in names if n not in SETTINGS]
    if bad or len(names) < 2:
        raise SystemExit(f"--settings: two or more of {', '.join(SETTINGS)}, got {a.settings!r}")
    torch.set_num_threads(1)
    prompts = [json.loads(line)["prompt"] for line in open(a.dataset)]
    if len(prompts) < 8:
        raise SystemExit(f"{a.dataset}: need at least 8 prompts, found {len(prompts)}")
    llms = {n: build(n, a.model_dir, a.batch) for n in names}
    ids = [llms[names[0]].tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    for llm in llms.values():
        llm.generate(ids[:8], params)                                 # warm-up
        llm.engine.reset_prefix_cache()      # its prompts come again: they would count as prefixes that recur
    spent = {n: [] for n in names}
    for r in range(a.rounds):
        part = [ids[(r * a.chunk + i) % len(ids)] for i in range(a.chunk)]
        for n in names[r % len(names):] + names[:r % len(names)]:
            t0 = time.perf_counter()
            llms[n].generate(part, params)
            spent[n].append(time.perf_counter() - t0)
    base = names[0]
    tokens = a.rounds * a.chunk * 128
    print(f"batch {a.batch}, {a.rounds} rounds x {a.chunk} prompts, {Path(a.dataset).name}")
    for n in names:
        hist = llms[n].engine.scheduler.finished_stats.drafts_per_step
        line = f"  {n:8s} {tokens / sum(spent[n]):9.0f} tok/s"
        if n != base:
            line += (f"  vs {base}: total {sum(spent[base]) / sum(spent[n]):.3f}x, median round "
                     f"{statistics.median(b / x for b, x in zip(spent[base], spent[n])):.3f}x")
        if hist:
            line += f"  drafts per row-step (0..K) {hist}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
