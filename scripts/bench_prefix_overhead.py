"""Prefix caching on vs off in one process, runs alternated, wall and CPU time (the engine runs on this
thread with 1 torch thread, so thread CPU time is robust to other processes on a shared machine).

python scripts/bench_prefix_overhead.py --dataset DS.jsonl --concurrency 8 --repeats 5 [--mtp_mode vanilla --k 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from mtp_core.bench.dataset import encode_request, load_dataset
from mtp_core.bench.runner import run_requests
from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig
from mtp_core.engine.engine import Engine
from mtp_core.llm import LLM


HOST = {"s": 0.0}


def timed(cls, name: str) -> None:
    """Adds the time spent in cls.name to HOST["s"] (the prefix cache's host-side bookkeeping)."""
    fn = getattr(cls, name)

    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            HOST["s"] += time.perf_counter() - t0
    setattr(cls, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--mtp_mode", default="vanilla")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    spec = SpeculativeConfig(num_nextn_predict_layers=a.k, mtp_mode=a.mtp_mode, draft_len_policy="fixed") if a.k else None
    base = LLMConfig(model_dir="mtp_core/assets/tiny-r1", dtype="float32", speculative_config=spec,
                     max_batch_size=a.concurrency, kv_cache_config=KvCacheConfig())
    llm = LLM(base)
    from mtp_core.engine.scheduler import Scheduler
    from mtp_core.kv_cache.block_manager import BlockManager
    for cls, name in ((Scheduler, "_lookup"), (Scheduler, "settle"), (BlockManager, "map_prefix")):
        timed(cls, name)
    reqs = load_dataset(a.dataset)
    prompts = [encode_request(llm.tokenizer, r) for r in reqs]
    outs = [r.output_tokens for r in reqs]
    eos, think = list(llm.engine.stops.eos_token_ids), llm.engine.stops.think_ids
    res: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": [], "ttft_rest": [], "hit": [], "host": []} for k in ("on", "off")}
    for rep in range(a.repeats):
        for reuse in (("on", "off") if rep % 2 == 0 else ("off", "on")):
            cfg = replace(base, kv_cache_config=replace(base.kv_cache_config, enable_block_reuse=reuse == "on"))
            eng = Engine(llm.model, cfg, eos, think)
            run_requests(eng, prompts[:1], outs[:1], 1)                  # warm-up, then an empty cache
            eng.reset_prefix_cache()
            HOST["s"] = 0.0
            w0, c0 = time.perf_counter(), time.thread_time()
            recs = run_requests(eng, prompts, outs, a.concurrency)
            r = res[reuse]
            r["wall"].append(time.perf_counter() - w0)
            r["cpu"].append(time.thread_time() - c0)
            r["ttft_rest"].append(statistics.mean(x.ttft_s for x in recs[1:]) * 1e3)
            r["hit"].append(eng.blocks.stats.token_hit_rate)
            r["host"].append(HOST["s"])
    ntok = sum(outs)
    summary = {}
    for k, r in res.items():
        summary[k] = {"wall_tok_s": ntok / statistics.median(r["wall"]), "cpu_tok_s": ntok / statistics.median(r["cpu"]),
                      "ttft_rest_ms": statistics.median(r["ttft_rest"]), "token_hit_rate": r["hit"][0],
                      "host_ms": statistics.median(r["host"]) * 1e3, "cpu_s": statistics.median(r["cpu"]), "runs": r}
    on, off = summary["on"], summary["off"]
    print(f"{a.dataset} conc {a.concurrency} K={a.k} {a.mtp_mode}: output tok/s wall on {on['wall_tok_s']:.1f} off "
          f"{off['wall_tok_s']:.1f} (on/off {on['wall_tok_s'] / off['wall_tok_s']:.3f}); per CPU-second on "
          f"{on['cpu_tok_s']:.1f} off {off['cpu_tok_s']:.1f} (on/off {on['cpu_tok_s'] / off['cpu_tok_s']:.3f}); "
          f"TTFT of requests 2.. on {on['ttft_rest_ms']:.1f} ms off {off['ttft_rest_ms']:.1f} ms "
          f"({off['ttft_rest_ms'] / on['ttft_rest_ms']:.2f}x); token hit rate {on['token_hit_rate']:.3f}; "
          f"prefix-cache host time per run on {on['host_ms']:.2f} ms ({on['host_ms'] / 10 / on['cpu_s']:.3f}% of "
          f"its CPU time), off {off['host_ms']:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
