"""What a decode step verifying k drafts costs at a checkpoint's real widths, with and without a draft vocabulary
(speculative_config.draft_token_map), and what that makes of a given acceptance (issue 39).

    python3 scripts/draft_step_costs.py CKPT --token_map MAP.json [--threads 2] [--rounds 3] [--tokens 20]
                                        [--replay r1]

One process, one model in memory, one engine per setting (nextn=0; fixed K = 1, 2, 3 Eagle, each without and with
the map), settings alternating within each round. Each engine runs one 64-token random prompt and then --tokens
decode steps, timed one by one (wall clock), the first three after the prefill left out. With a checkpoint of
random weights (`mtp make-scale`) the target rejects every draft, so every step verifies k drafts and runs the
MTP module over one accepted position: the cost of a k-draft step whatever the acceptance. From those medians,
the speed-up over nextn=0 that an acceptance of E(k) expected tokens per step would give: E(k) * cost(0) /
cost(k), for DeepSeek-R1's published ALs (1.92 / 2.58 / 2.82 at K = 1 / 2 / 3, speculative/replay.py) unless
--als says otherwise. With --replay (benchmarks only: speculative/replay.py) the drafts are replaced by the target's
own continuation at those rates, so the steps accept what they would at that acceptance; the table then gives the
measured tokens per step and decode tokens/s (prefill left out) over nextn=0's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtp_core.config import LLMConfig  # noqa: E402
from mtp_core.config.engine import SpeculativeConfig  # noqa: E402
from mtp_core.engine.engine import Engine  # noqa: E402
from mtp_core.llm import LLM  # noqa: E402
from mtp_core.sampling import SamplingParams  # noqa: E402
from mtp_core.speculative.replay import ReplayDrafts, parse_rates  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt")
    ap.add_argument("--token_map", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=20)
    ap.add_argument("--als", default="1.92,2.58,2.82", help="E(k) for k = 1, 2, 3")
    ap.add_argument("--replay", default=None, help="Replayed acceptance rates (r1, or per position: 0.9,0.7,0.4)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(LLMConfig(model_dir=a.ckpt, max_seq_len=512))
    eos = list(llm.tokenizer.eos_token_ids) if llm.tokenizer is not None else []
    vocab = llm.model.config.vocab_size
    prompt = torch.randint(10, vocab, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    settings = [(0, None)] + [(k, m) for k in (1, 2, 3) for m in (None, a.token_map)]
    engines = {}
    for k, m in settings:
        spec = None if k == 0 else SpeculativeConfig(num_nextn_predict_layers=k, mtp_mode="eagle",
                                                     draft_len_policy="fixed", draft_token_map=m)
        engines[k, m] = Engine(llm.model, replace(llm.config, speculative_config=spec), eos, None)
    if a.replay:          # the target's own continuation, from the nextn=0 engine
        plain = engines[0, None]
        cont = plain.add_request(list(prompt), SamplingParams(max_tokens=a.tokens + 8, ignore_eos=True))
        while plain.has_unfinished():
            plain.step()
        replay = ReplayDrafts(parse_rates(a.replay), {tuple(prompt): list(cont.output_ids)}, vocab)
        for (k, _), eng in engines.items():
            if k:
                eng.spec.replay = replay
    times: dict = {s: [] for s in settings}
    emitted: dict = {s: [] for s in settings}
    prefill: dict = {s: [] for s in settings}
    for _ in range(a.rounds):
        for s in settings:
            eng = engines[s]
            seq = eng.add_request(list(prompt), SamplingParams(max_tokens=a.tokens, ignore_eos=True))
            t = time.perf_counter()
            eng.step()                                   # the prefill (and the prompt's drafts)
            prefill[s].append(time.perf_counter() - t)
            steps, out = [], []
            while eng.has_unfinished():
                n = len(seq.output_ids)
                t = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t)
                out.append(len(seq.output_ids) - n)
            times[s] += steps[3:-1]                      # the last step may stop short of its verified tokens
            emitted[s] += out[3:-1]
    als = [1.0] + [float(x) for x in a.als.split(",")]
    base = statistics.median(times[0, None])
    print(f"{a.ckpt}: vocabulary {vocab}, {a.threads} threads, {a.rounds} rounds x {a.tokens} tokens; map "
          f"{a.token_map} ({engines[1, a.token_map].paths.forward_path.draft_ids.numel()} ids)")
    print("| k | head | step ms (median) | p25 - p75 | x nextn=0 step | E(k) | speed-up at E(k) | tokens / step, "
          "measured | decode tok/s / nextn=0 | prefill ms (64 tokens) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rate0 = sum(emitted[0, None]) / sum(times[0, None])
    for k, m in settings:
        v = times[k, m]
        q = statistics.quantiles(v, n=4)
        med = statistics.median(v)
        per_step = sum(emitted[k, m]) / len(emitted[k, m])
        rate = sum(emitted[k, m]) / sum(v)
        print(f"| {k} | {'map' if m else 'full'} | {1e3 * med:.1f} | {1e3 * q[0]:.1f} - {1e3 * q[2]:.1f} | "
              f"{med / base:.2f} | {als[k]:.2f} | {als[k] * base / med:.2f}x | {per_step:.2f} | "
              f"{rate / rate0:.2f}x | {1e3 * statistics.median(prefill[k, m]):.0f} |")


if __name__ == "__main__":
    main()
