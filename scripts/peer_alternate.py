"""Issue 38's comparison with llama.cpp, alternating per measurement: for each checkpoint and its GGUF twin, our
batch-1 decode (and prefill) in a fresh process (`scale_bench.py`'s measurement), then `llama-bench` on the GGUF
at once, so that both sides of a ratio see the same minute of a VM whose speed drifts by tens of percent (running
all of ours and then all of llama.cpp's turned 1.03x into 0.75x on a Zen 5 host, BENCHMARKS.md).

    python3 scripts/peer_alternate.py --llama_bench PATH/llama-bench \\
        --pair CKPT_BF16=scale-bf16.gguf --pair CKPT_FP8=scale-Q8_0-lmbf16.gguf [--threads 1,2] [--rounds 3] \\
        [--prefill 512] [--tokens 48]

GGUFs from `../shared/peers/llamacpp` (`LM_HEAD_BF16=1 ./convert.sh`: the quantized files keep output.weight in
bf16, as our FP8 / NVFP4 twins keep the lm_head). llama-bench runs with `--repack 0` (its repacked Q8_0 path dies
with SIGILL on some of these VMs). Decode: ours from TPOT (best of 2 generations of --tokens), llama.cpp's tg64;
prefill (2 threads only, --prefill > 0): ours over a --prefill-token prompt, llama.cpp's pp of the same length.
Prints one line per measurement and, per row, the ratios of every round and their median.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_bench import HERE, run_child  # noqa: E402


def llama(bench: str, gguf: str, threads: int, prompt: int, gen: int) -> float:
    cmd = [bench, "-m", gguf, "-p", str(prompt), "-n", str(gen), "-t", str(threads), "-r", "1", "--repack", "0",
           "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed on {gguf}: {r.stderr.strip().splitlines()[-1:]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama_bench", required=True)
    ap.add_argument("--pair", action="append", required=True, help="CKPT_DIR=GGUF_FILE (repeatable)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prefill", type=int, default=512)
    a = ap.parse_args()
    pairs = [p.split("=", 1) for p in a.pair]
    if any(len(p) != 2 for p in pairs):
        raise SystemExit("--pair takes CKPT_DIR=GGUF_FILE")
    threads = [int(t) for t in a.threads.split(",")]
    child = argparse.Namespace(tokens=a.tokens, prefill=0, dtype="auto", eagle=False)
    ratios: dict[str, list[float]] = {}
    for r in range(a.rounds):
        for ckpt, gguf in pairs:
            for t in threads:
                child.prefill = a.prefill if t == 2 else 0
                ours = run_child(HERE, ckpt, t, child)
                if "error" in ours:
                    raise SystemExit(f"{ckpt}: {ours['error']}")
                rows = [(f"{Path(gguf).name} tg t={t}", ours["tok_s"], llama(a.llama_bench, gguf, t, 0, 64))]
                if child.prefill:
                    rows.append((f"{Path(gguf).name} pp{a.prefill} t={t}", ours["prefill_tok_s"],
                                 llama(a.llama_bench, gguf, t, a.prefill, 0)))
                for name, o, ll in rows:
                    ratios.setdefault(name, []).append(o / ll)
                    print(f"round {r} {name}: ours {o:.1f} llama.cpp {ll:.1f} tok/s, {o / ll:.3f}x", flush=True)
    for name, v in ratios.items():
        print(f"{name}: {' / '.join(f'{x:.3f}' for x in v)}, median {statistics.median(v):.3f}x")


if __name__ == "__main__":
    main()
