#!/usr/bin/env bash
# Issue 28's goal table: MTP on with the default settings (--mtp_mode auto, draft_len_policy cost) against no
# MTP, on the shipped model, 1 thread, one run with the settings alternating. Run it on a quiet machine.
#   1. batch 1, task prompts: `mtp sweep` (fixed K, the policy rows, the adaptive rows, the roofline ideal)
#   2. batch 1, general-text prompts: `mtp bench`, nextn=0 vs default MTP, two passes
#   3. batch 4 and 16, task prompts: `mtp bench`, total output tok/s, nextn=0 vs default MTP vs fixed K=3
# Usage: bash scripts/policy_bench.sh OUT_DIR
set -euo pipefail
out=${1:?usage: policy_bench.sh OUT_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cd "$here"
model="$here/mtp_core/assets/tiny-r1"
python3 -m cli prepare-dataset --output "$out/task.jsonl" --num_requests 40 --output_tokens 128 >/dev/null
python3 -m cli prepare-dataset --output "$out/general.jsonl" --task_set general --num_requests 9 \
  --output_tokens 128 >/dev/null
lscpu | grep -E "Model name|^CPU\(s\)" | tr -s ' ' | tee "$out/host.txt"

echo "== 1. sweep, batch 1, task prompts"
python3 -m cli sweep --max_nextn 3 --policy_nextn 3 --num_requests 9 --output_tokens 128 --num_threads 1 \
  --no_plot --report_json "$out/sweep.json" 2>/dev/null | tee "$out/sweep.txt"

bench() {   # name dataset requests concurrency [flags...] -> one line
  local name=$1 ds=$2 n=$3 c=$4; shift 4
  python3 -m cli bench --model_dir "$model" --dataset "$ds" --num_requests "$n" --concurrency "$c" \
    --max_batch_size "$c" --num_threads 1 --warmup 8 "$@" --report_json "$out/b.json" >/dev/null 2>&1
  python3 - "$out/b.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
p, s = r["performance"], r.get("decoding_stats") or {}
print(f"{sys.argv[2]:34s} total tok/s {p['total_output_throughput_tps']:9.1f}  per user "
      f"{p['per_user_output_throughput_tps']:8.1f}  AL {s.get('acceptance_length', 1.0):.3f}  "
      f"drafts/step {s.get('mean_drafts_per_step', 0.0):.2f}")
EOF
}
MTP="--spec_decode_algo MTP --spec_decode_max_draft_len 3"
echo "== 2. batch 1, general-text prompts"
for pass in 1 2; do
  bench "general nextn=0 pass $pass" "$out/general.jsonl" 9 1
  bench "general MTP default pass $pass" "$out/general.jsonl" 9 1 $MTP
done | tee "$out/general.txt"
echo "== 3. batch 4 and 16, task prompts"
for c in 4 16; do
  for pass in 1 2; do
    bench "batch $c nextn=0 pass $pass" "$out/task.jsonl" 40 $c
    bench "batch $c MTP default pass $pass" "$out/task.jsonl" 40 $c $MTP
    bench "batch $c MTP fixed K=3 pass $pass" "$out/task.jsonl" 40 $c $MTP --spec_decode_draft_len_policy fixed
  done
done | tee "$out/batched.txt"
