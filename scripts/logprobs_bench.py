"""The cost of logprobs, a penalty and a grammar at batch 1 on the shipped model with MTP: offline output
tokens/s and acceptance length (AL) of greedy decoding without any, with `logprobs=5`, with
`frequency_penalty`, with a loose regex grammar (`[^{}]*`: the mask's cost, the text mostly unchanged) and
with a JSON object grammar, alternating; and whether the tokens equal the plain run's (logprobs and the loose
grammar must not change them).

    python3 scripts/logprobs_bench.py [--model_dir DIR] [--tokens 256] [--repeats 3] [--draft_len 3] [--native_step 0]

On a CPU with the native step a greedy request that needs its logits stays on the one-call step (its penalties
and grammar masks prepared per verify position before the call, its logprobs computed inside it), so this
measures that preparation and the logprobs' cost; `--native_step 0` measures the general path (target forward +
Python verification + the drafter) instead. The regex row is comparable with plain only while its tokens are the
same (a longer output may meet a token the grammar forbids, such as `<think>`). Run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams

PROMPT = "Explain why the sky is blue, step by step."


def main() -> None:
    from cli.common import DEFAULT_MODEL_DIR

    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft_len", type=int, default=3)
    ap.add_argument("--num_threads", type=int, default=None)
    ap.add_argument("--native_step", type=int, default=1, help="0: every step through the general path")
    a = ap.parse_args()
    cfg = LLMConfig(model_dir=a.model_dir, max_batch_size=1, max_seq_len=a.tokens + 128, num_threads=a.num_threads,
                    native_step=bool(a.native_step),
                    kv_cache_config=KvCacheConfig(max_tokens=2 * (a.tokens + 128)),
                    speculative_config=SpeculativeConfig(num_nextn_predict_layers=a.draft_len,
                                                         draft_len_policy="fixed") if a.draft_len else None)
    llm = LLM(cfg)
    kinds = {"plain": SamplingParams(max_tokens=a.tokens, ignore_eos=True),
             "logprobs=5": SamplingParams(max_tokens=a.tokens, ignore_eos=True, logprobs=5),
             "frequency_penalty=0.5": SamplingParams(max_tokens=a.tokens, ignore_eos=True, frequency_penalty=0.5),
             "regex [^{}]*": SamplingParams(max_tokens=a.tokens, guided=("regex", "[^{}]*")),
             "json_object": SamplingParams(max_tokens=a.tokens, guided=("json_object", ""))}
    for sp in kinds.values():                      # warm-up (the grammar backend is built on first use)
        llm.generate([PROMPT], SamplingParams(**{**sp.__dict__, "max_tokens": 8}))
    times: dict[str, list[float]] = {k: [] for k in kinds}
    tokens: dict[str, list[int]] = {}
    al: dict[str, float] = {}
    for _ in range(a.repeats):
        for name, sp in kinds.items():
            t0 = time.perf_counter()
            out = llm.generate([PROMPT], sp)[0]
            times[name].append(len(out.token_ids) / (time.perf_counter() - t0))
            tokens[name] = out.token_ids
            al[name] = out.stats.num_output_tokens / max(out.stats.num_steps, 1)
    base = statistics.median(times["plain"])
    print(f"{'request':<24} {'tokens/s (median)':>18} {'vs plain':>9} {'paired (IQR)':>26} {'AL':>6}  same tokens")
    for name in kinds:
        med = statistics.median(times[name])
        n = min(len(tokens[name]), len(tokens["plain"]))
        same = "yes" if tokens[name][:n] == tokens["plain"][:n] else \
            ("n/a" if "penalty" in name or "json" in name else "NO")
        # each repeat against the plain run just before it (drift on a shared machine cancels): median, quartiles
        ratios = [x / p - 1 for x, p in zip(times[name], times["plain"])]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        paired = f"{statistics.median(ratios):+.1%} ({q[0]:+.1%} .. {q[2]:+.1%})"
        print(f"{name:<24} {med:>18.1f} {med / base - 1:>+8.1%} {paired:>26} {al[name]:>6.2f}  {same}")


if __name__ == "__main__":
    main()
