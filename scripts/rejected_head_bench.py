"""What MTP costs when its head predicts nothing: a checkpoint with random weights (`mtp make-scale`), where the
target rejects every draft. A fresh engine runs a 2-token warm-up request, then one request of --tokens tokens
is timed (prefill included); MTP on (the default settings: Eagle, draft_len_policy cost) against nextn=0, each in
its own process, alternating.

    python3 scripts/rejected_head_bench.py CKPT [--threads 2] [--tokens 24] [--rounds 2] [--prompt_len 40]

Prints per run: tokens/s over the timed request, the steps it took, the draft counts the policy chose per step,
and the ratio MTP / nextn=0 per round.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def one(ckpt: str, threads: int, nextn: int, tokens: int, prompt_len: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig
    from mtp_core.llm import LLM
    from mtp_core.sampling import SamplingParams

    spec = SpeculativeConfig(num_nextn_predict_layers=nextn) if nextn else None
    llm = LLM(LLMConfig(model_dir=ckpt, max_batch_size=1, num_threads=threads, speculative_config=spec,
                        kv_cache_config=KvCacheConfig(max_tokens=4096)))
    prompt = [20 + (7 * i) % 900 for i in range(prompt_len)]
    llm.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))          # warm-up
    chosen: list[int] = []
    if nextn:
        pol, orig = llm.engine.spec.policy, llm.engine.spec.policy.choose

        def choose(rows, in_flight):
            out = orig(rows, in_flight)
            chosen.append(out[0] if out else 0)
            return out
        pol.choose = choose
    s0 = llm.engine.num_steps
    t0 = time.perf_counter()
    o = llm.generate([prompt[::-1]], SamplingParams(max_tokens=tokens, ignore_eos=True))[0]
    dt = time.perf_counter() - t0
    st = llm.engine.stats
    return {"nextn": nextn, "tok_s": round(len(o.token_ids) / dt, 2), "steps": llm.engine.num_steps - s0,
            "chosen": chosen, "drafts_proposed": st.num_draft_proposed, "drafts_accepted": st.num_draft_accepted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt_len", type=int, default=40)
    ap.add_argument("--nextn", type=int, default=3)
    ap.add_argument("--one", type=int, default=-1)
    a = ap.parse_args()
    if a.one >= 0:
        print(json.dumps(one(a.ckpt, a.threads, a.one, a.tokens, a.prompt_len)))
        return
    for r in range(a.rounds):
        res = {}
        for n in ((0, a.nextn) if r % 2 == 0 else (a.nextn, 0)):
            cmd = [sys.executable, __file__, a.ckpt, "--threads", str(a.threads), "--tokens", str(a.tokens),
                   "--prompt_len", str(a.prompt_len), "--one", str(n)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            res[n] = json.loads(out)
            print(json.dumps(res[n]), flush=True)
        print(f"round {r}: MTP / nextn=0 = {res[a.nextn]['tok_s'] / res[0]['tok_s']:.3f}", flush=True)


if __name__ == "__main__":
    main()
