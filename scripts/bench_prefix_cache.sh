#!/usr/bin/env bash
# Prefix caching benchmarks (BENCHMARKS.md "Prefix caching"): shipped model, 1 thread, reuse on vs off,
# runs alternated. Usage: scripts/bench_prefix_cache.sh OUT_DIR [REPEATS] [extra mtp bench flags...]
set -euo pipefail
out=${1:?OUT_DIR}; reps=${2:-2}; shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
mtp() { python3 -m cli "$@"; }
mtp prepare-dataset --output "$out/p512.jsonl" --num_requests 8 --output_tokens 32 --shared_prefix 512
mtp prepare-dataset --output "$out/p256.jsonl" --num_requests 32 --output_tokens 64 --shared_prefix 256
mtp prepare-dataset --output "$out/p0.jsonl" --num_requests 32 --output_tokens 64
for r in $(seq 1 "$reps"); do
  for reuse in on off; do
    flag=(); [ "$reuse" = off ] && flag=(--disable_kv_cache_reuse)
    # 1) TTFT: 8 requests one after another (concurrency 1); request 1 misses, 2..8 share 512 tokens with it
    mtp bench --dataset "$out/p512.jsonl" --concurrency 1 --warmup 1 --num_threads 1 "${flag[@]}" "$@" \
      --report_json "$out/ttft_${reuse}_$r.json" --request_json "$out/ttft_req_${reuse}_$r.json" > /dev/null
    # 2) 32 requests sharing 256 tokens, concurrency 8
    mtp bench --dataset "$out/p256.jsonl" --concurrency 8 --warmup 1 --num_threads 1 "${flag[@]}" "$@" \
      --report_json "$out/shared_${reuse}_$r.json" > /dev/null
    # 3) no shared prefix, concurrency 8
    mtp bench --dataset "$out/p0.jsonl" --concurrency 8 --warmup 1 --num_threads 1 "${flag[@]}" "$@" \
      --report_json "$out/none_${reuse}_$r.json" > /dev/null
  done
done
python3 - "$out" "$reps" <<'PY'
import json, statistics, sys
out, reps = sys.argv[1], int(sys.argv[2])
def load(name): return json.load(open(f"{out}/{name}"))
rows = {}
for reuse in ("on", "off"):
    first, rest, shared, none, hit = [], [], [], [], []
    for r in range(1, reps + 1):
        req = load(f"ttft_req_{reuse}_{r}.json")
        first.append(req[0]["ttft_ms"]); rest.append(statistics.mean(x["ttft_ms"] for x in req[1:]))
        shared.append(load(f"shared_{reuse}_{r}.json")["performance"]["total_output_throughput_tps"])
        none.append(load(f"none_{reuse}_{r}.json")["performance"]["total_output_throughput_tps"])
        hit.append(load(f"shared_{reuse}_{r}.json")["prefix_cache"]["token_hit_rate"])
    rows[reuse] = dict(first=first, rest=rest, shared=shared, none=none, hit=hit)
    print(reuse, json.dumps(rows[reuse]))
m = {k: {f: statistics.median(v) for f, v in d.items()} for k, d in rows.items()}
print(f"TTFT request 1 (miss): on {m['on']['first']:.1f} ms, off {m['off']['first']:.1f} ms")
print(f"TTFT requests 2..8 (512 shared): on {m['on']['rest']:.1f} ms, off {m['off']['rest']:.1f} ms, "
      f"{m['off']['rest'] / m['on']['rest']:.2f}x lower")
print(f"32 req sharing 256, conc 8: on {m['on']['shared']:.1f} tok/s, off {m['off']['shared']:.1f} tok/s, "
      f"{m['on']['shared'] / m['off']['shared']:.3f}x; token hit rate on {m['on']['hit']:.3f}")
print(f"no shared prefix, conc 8: on {m['on']['none']:.1f} tok/s, off {m['off']['none']:.1f} tok/s, "
      f"on/off {m['on']['none'] / m['off']['none']:.3f}")
PY
