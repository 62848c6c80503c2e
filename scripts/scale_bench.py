"""Decode speed, memory and load time on a real-width checkpoint (`mtp make-scale`; FP8 / NVFP4 twins from
`mtp quantize`), against the read-bandwidth floor measured in the same run.

    python3 scripts/scale_bench.py CKPT [CKPT ...] [--threads 1,2] [--tokens 48] [--rounds 2] [--prefill 512]
        [--eagle] [--tree DIR] [--json OUT]

Each (checkpoint, threads) measurement runs in a fresh process (so resident and peak memory are its own): load time,
resident set after load and its peak, batch-1 nextn=0 decode (tokens/s from TPOT of `--tokens` greedy tokens, EOS
ignored), optionally Eagle K=1 / K=3 step times (`--eagle`), and prefill tokens/s of a `--prefill`-token prompt. The
floor is the bytes a batch-1 step reads (attention, dense MLP, top-k + shared experts, lm_head; from the model's own
tensors) over the read bandwidth of an fp32 sum of 1 GiB of initialised memory on the same number of threads (once
at the start, and in the child just before and after each timed generation: `floor_over_step_paired`, one value per
generation). `--tree DIR` runs the measurement with another checkout's mtp_core (e.g. a worktree of an older commit)
for before/after tables; rounds alternate trees.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def read_bandwidth(threads: int, gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of an fp32 sum over `gib` GiB of written memory (no shared zero pages) on `threads` threads."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    return probe_bandwidth(x, reps)


def probe_bandwidth(x, reps: int = 3) -> float:
    """GB/s of the fastest of `reps` fp32 sums over x (written memory), on the threads torch has."""
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        x.sum()
        best = max(best, x.numel() * 4 / (time.perf_counter() - t0))
    return best / 1e9


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def step_bytes(model) -> dict:
    """Bytes a batch-1 decode step reads, from the model's tensors (as stored: packed formats count packed)."""
    def nbytes(mod) -> int:
        return sum(t.numel() * t.element_size() for t in list(mod.parameters()) + list(mod.buffers()) if t.dim() >= 2)

    cfg = model.config
    out = {"attention": 0, "dense_mlp": 0, "experts": 0, "router": 0, "lm_head": nbytes(model.lm_head)}
    for layer in list(model.model.layers)[:model.num_main_layers]:
        out["attention"] += nbytes(layer.self_attn)
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            per = nbytes(mlp.experts[0])
            out["experts"] += cfg.num_experts_per_tok * per + (nbytes(mlp.shared_experts) if mlp.shared_experts else 0)
            out["router"] += mlp.gate.weight.numel() * 4
        else:
            out["dense_mlp"] += nbytes(mlp)
    out["total"] = sum(out.values())
    return out


def measure_one(ckpt: str, threads: int, tokens: int, prefill: int, eagle: bool, dtype: str) -> dict:
    import torch
    torch.set_num_threads(threads)
    from mtp_core.config import KvCacheConfig, LLMConfig, SpeculativeConfig
    from mtp_core.llm import LLM
    from mtp_core.sampling import SamplingParams

    base_rss = rss_mb()
    t0 = time.perf_counter()
    kv = KvCacheConfig(max_tokens=4096)
    llm = LLM(LLMConfig(model_dir=ckpt, dtype=dtype, max_batch_size=1, max_seq_len=2048, kv_cache_config=kv,
                        num_threads=threads))
    load_s = time.perf_counter() - t0
    rss = rss_mb()
    model = llm.model
    info = {"ckpt": ckpt, "threads": threads, "dtype": str(next(model.parameters()).dtype), "load_s": round(load_s, 2),
            "rss_mb": round(rss), "rss_delta_mb": round(rss - base_rss), "base_rss_mb": round(base_rss),
            "native": getattr(model, "native", None) is not None}
    nd = getattr(model, "native", None)
    if nd is not None and hasattr(nd, "handle"):
        info["native_summary"] = nd.handle.summary()
    elif nd is not None:
        info["native_summary"] = "native (old API)"
    info["step_bytes"] = step_bytes(model)
    ckpt_bytes = sum(p.stat().st_size for p in Path(ckpt).glob("*.safetensors"))
    info["ckpt_mb"] = round(ckpt_bytes / 2**20)
    prompt = list(range(20, 60))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))          # warm-up
    best, paired = None, []
    probe = torch.ones(2**28)                     # 1 GiB of written fp32: the read probe beside each generation
    for _ in range(2):
        bw0 = probe_bandwidth(probe)
        o = llm.generate([prompt], params)[0]
        tpot = (o.e2e_s - o.ttft_s) / (len(o.token_ids) - 1)
        bw = (bw0 + probe_bandwidth(probe)) / 2           # the read bandwidth of the seconds around this generation
        paired.append(info["step_bytes"]["total"] / (bw * 1e9) / tpot)
        best = tpot if best is None else min(best, tpot)
    del probe
    info["tpot_ms"] = round(best * 1e3, 2)
    info["tok_s"] = round(1.0 / best, 2)
    # floor / step with the floor read just before and after each generation (the VM's read bandwidth moves by up
    # to 40% between runs minutes apart, so the parent's one measurement at the start pairs badly)
    info["floor_over_step_paired"] = [round(x, 3) for x in paired]
    if prefill:
        long = [20 + (i * 7919) % 900 for i in range(prefill)]
        llm.generate([long], SamplingParams(max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        llm.generate([long[::-1]], SamplingParams(max_tokens=1, ignore_eos=True))
        info["prefill_tok_s"] = round(prefill / (time.perf_counter() - t0), 1)
    info["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if eagle:   # the same weights under an MTP Eagle engine (K = 1, 3): the step time against nextn=0's
        from mtp_core.engine.engine import Engine
        eos = list(llm.tokenizer.eos_token_ids)
        for K in (1, 3):
            spec = SpeculativeConfig(num_nextn_predict_layers=K, mtp_mode="eagle")
            cfg = LLMConfig(model_dir=ckpt, dtype=dtype, max_batch_size=1, max_seq_len=2048, kv_cache_config=kv,
                            num_threads=threads, speculative_config=spec)
            llm.engine = None
            llm.engine = Engine(model, cfg, eos, llm.tokenizer.think_token_ids())
            llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
            s0 = llm.engine.num_steps
            o = llm.generate([prompt], params)[0]
            info[f"eagle_k{K}_step_ms"] = round((o.e2e_s - o.ttft_s) * 1e3 / max(1, llm.engine.num_steps - s0 - 1), 2)
            info[f"eagle_k{K}_al"] = round(len(o.token_ids) / max(1, llm.engine.num_steps - s0), 3)
    return info


def run_child(tree: Path, ckpt: str, threads: int, a: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", ckpt, "--threads", str(threads),
           "--tokens", str(a.tokens), "--prefill", str(a.prefill), "--dtype", a.dtype] + (["--eagle"] if a.eagle else [])
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return {"ckpt": ckpt, "threads": threads, "error": r.stderr.strip().splitlines()[-1:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpts", nargs="*")
    ap.add_argument("--one", default="")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--eagle", action="store_true")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tree", action="append", default=[])
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure_one(a.one, int(a.threads), a.tokens, a.prefill, a.eagle, a.dtype)))
        return
    threads = [int(t) for t in a.threads.split(",")]
    trees = [HERE] + [Path(t).resolve() for t in a.tree]
    import platform
    host = {"cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), ""),
            "amx": "amx_tile" in open("/proc/cpuinfo").read(), "python": platform.python_version(),
            "loadavg": open("/proc/loadavg").read().split()[:3]}
    bw = {t: round(read_bandwidth(t), 2) for t in threads}
    host["read_GBps"] = bw
    print(json.dumps(host), flush=True)
    results = []
    for rnd in range(a.rounds):
        for ckpt in a.ckpts:
            for t in threads:
                for tree in (trees if rnd % 2 == 0 else trees[::-1]):
                    r = run_child(tree, ckpt, t, a)
                    r["tree"], r["round"] = str(tree), rnd
                    if "step_bytes" in r:
                        floor_s = r["step_bytes"]["total"] / (bw[t] * 1e9)
                        r["floor_ms"] = round(floor_s * 1e3, 2)
                        r["floor_over_step"] = round(floor_s * 1e3 / r["tpot_ms"], 3)
                    results.append(r)
                    print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"host": host, "results": results}, indent=1))


if __name__ == "__main__":
    main()
