"""A T-token target forward (a verify window: one row, its token and T - 1 drafts) against a one-token one, at
the checkpoint's real widths on the native CPU step, beside a bytes model (issue 38).

    python3 scripts/verify_window_bench.py CKPT [--threads 2] [--tokens 1,2,4,8] [--reps 7]

One request's prompt (64 tokens) is prefilled, then the native step op runs the target forward, the LM head
and the greedy verification of one row of T tokens over the prompt's last positions (rewriting their KV; no
MTP forward: mtp_layer -1), the same positions every call; best of reps. The bytes model: the weights a T-token forward reads, with the routed
experts distinct across its tokens (each token picks top-k of E experts; for tokens routed independently and
uniformly, E * (1 - (1 - k/E)^T) distinct experts per MoE layer), over the one-token forward's; the rest of the
step (attention, dense MLPs, shared experts, router, LM head) is read once whatever T.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_bench import read_bandwidth, step_bytes  # noqa: E402

from mtp_core.config import KvCacheConfig, LLMConfig  # noqa: E402
from mtp_core.llm import LLM  # noqa: E402
from mtp_core.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM(LLMConfig(model_dir=a.ckpt, dtype=a.dtype, max_batch_size=1, max_seq_len=1024, num_threads=a.threads,
                        kv_cache_config=KvCacheConfig(max_tokens=2048, enable_block_reuse=False)))
    eng, model = llm.engine, llm.model
    nd = model.native
    if nd is None or eng.paths.native_step is None:
        raise SystemExit("the native CPU step is not available for this checkpoint on this host")
    prompt = [20 + (i * 7919) % 900 for i in range(64)]
    seq = eng.add_request(prompt, SamplingParams(max_tokens=200, ignore_eos=True))
    eng.step()                                            # the prefill; the request stays, holding its blocks
    Ts = [int(t) for t in a.tokens.split(",")]
    if max(Ts) > 32:
        raise SystemExit("--tokens: at most 32 per window")
    start = seq.kv.num_cached - max(Ts)                   # windows rewrite the prompt's last positions
    table = torch.tensor([seq.kv.block_table], dtype=torch.int32)
    cfg = model.config
    sb = step_bytes(model)
    per_expert = sb["experts"] / (cfg.num_experts_per_tok + (cfg.n_shared_experts or 0))
    moe_layers = sum(1 for layer in model.model.layers[:model.num_main_layers] if hasattr(layer.mlp, "experts"))
    routed = per_expert * cfg.num_experts_per_tok           # one token's routed experts, every MoE layer
    fixed = sb["total"] - routed
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    out = {"ckpt": a.ckpt, "threads": a.threads, "read_GBps": round(read_bandwidth(a.threads), 2),
           "step_bytes": sb, "moe_layers": moe_layers, "rows": []}
    base_ms = None
    for T in Ts:
        ids = torch.tensor(seq.all_ids[start:start + T])
        args = (nd.handle, ids, torch.tensor([0, T], dtype=torch.int32), torch.tensor([start]), table,
                torch.zeros(1, dtype=torch.int32), eng.caches, nd.rope_cos, nd.rope_sin, -1)
        nd.step_op(*args)
        best = float("inf")
        for _ in range(a.reps):
            t0 = time.perf_counter()
            nd.step_op(*args)
            best = min(best, time.perf_counter() - t0)
        ms = best * 1e3
        base_ms = ms if base_ms is None else base_ms
        distinct = E * (1 - (1 - k / E) ** T)
        model_ratio = (fixed + routed * distinct / k) / sb["total"]
        out["rows"].append({"T": T, "ms": round(ms, 2), "over_T1": round(ms / base_ms, 3),
                            "bytes_model_over_T1": round(model_ratio, 3), "distinct_experts": round(distinct, 1)})
        print(json.dumps(out["rows"][-1]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
