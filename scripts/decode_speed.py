"""Decode speed of the checkout this runs in: the shipped tiny-r1, batch 1, 1 torch thread (or argv[1]), float32,
3 held-out prompts x 128 tokens (EOS ignored), best of 3; nextn=0, Eagle K=3, Vanilla K=3.

A before/after comparison runs it in two checkouts back to back, alternating, e.g.
    git worktree add /tmp/before <commit> && (cd /tmp/before && python3 setup.py -q build_ext --inplace)
    for i in 1 2; do (cd /tmp/before && PYTHONPATH=. python3 /path/to/scripts/decode_speed.py);
                     PYTHONPATH=. python3 scripts/decode_speed.py; done
(the model and prompts always come from the checkout holding this script).
"""
import json
import sys
import time
from pathlib import Path

import torch

from mtp_core.config import LLMConfig, SpeculativeConfig
from mtp_core.bench.eval_sets import eval_records
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
ASSET = Path(__file__).resolve().parent.parent / "mtp_core" / "assets" / "tiny-r1"
prompts = [eval_records(f, 1, ASSET / "eval")[0]["prompt"] for f in ("add", "sort", "count")]
result = {}
for K, mode in ((0, "auto"), (3, "eagle"), (3, "vanilla")):
    spec = SpeculativeConfig(num_nextn_predict_layers=K, mtp_mode=mode, draft_len_policy="fixed") if K else None
    llm = LLM(LLMConfig(model_dir=str(ASSET), dtype="float32", max_batch_size=1, speculative_config=spec))
    params = SamplingParams(max_tokens=128, ignore_eos=True)
    llm.generate(prompts[:1], params)                                    # warm-up
    best, steps, tokens = float("inf"), 0, 0
    for _ in range(3):
        s0, t0 = llm.engine.num_steps, time.perf_counter()
        outs = [llm.generate([p], params)[0] for p in prompts]
        dt = time.perf_counter() - t0
        if dt < best:
            best, steps, tokens = dt, llm.engine.num_steps - s0, sum(len(o.token_ids) for o in outs)
    result[f"nextn={K}" if not K else f"{mode} K={K}"] = {
        "tok_per_s": round(tokens / best, 1), "step_ms": round(1e3 * best / steps, 2), "AL": round(tokens / steps, 3)}
print(json.dumps(result))
