#!/usr/bin/env bash
# The native-decode-step benchmarks (issue 14): before/after on one machine, alternating, plus the sweep on
# 1 and 2 threads and batch-16 throughput. Shipped model, CPU.
# Both trees run this checkout's model and prompts.
# Usage: bash scripts/native_bench.sh OUT_DIR [BEFORE_TREE]
#   BEFORE_TREE: a built checkout of the tree to compare against, e.g.
#     git worktree add /tmp/before 6f92df5 && (cd /tmp/before && python3 setup.py -q build_ext --inplace)
set -euo pipefail
out=${1:?usage: native_bench.sh OUT_DIR [BEFORE_TREE]}
before=${2:-}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
ds="$out/ds.jsonl"
(cd "$here" && python3 -m cli prepare-dataset --output "$ds" --num_requests 32 --output_tokens 128 >/dev/null)
echo "== decode speed, batch 1, 1 and 2 threads (scripts/decode_speed.py), alternating"
for pass in 1 2; do
  for T in 1 2; do
    if [ -n "$before" ]; then
      echo "before threads $T pass $pass: $(cd "$before" && PYTHONPATH=. python3 "$here/scripts/decode_speed.py" $T)"
    fi
    echo "after  threads $T pass $pass: $(cd "$here" && PYTHONPATH=. python3 scripts/decode_speed.py $T)"
  done
done | tee "$out/decode_speed.txt"
echo "== batch 16 total output tok/s (mtp bench, 32 requests x 128 tokens, 1 thread), alternating"
for pass in 1 2; do
  for tree in ${before:+"$before"} "$here"; do
    for k in 0 3; do
      spec=""; [ "$k" = 3 ] && spec="--spec_decode_algo MTP --spec_decode_max_draft_len 3"
      (cd "$tree" && python3 -m cli bench --model_dir "$here/mtp_core/assets/tiny-r1" --dataset "$ds" --num_requests 32 --concurrency 16 --max_batch_size 16 \
        --num_threads 1 $spec --report_json "$out/b16.json" >/dev/null 2>&1)
      python3 -c "import json,sys; p=json.load(open(sys.argv[1]))['performance']; print(sys.argv[2], 'pass', sys.argv[3], 'nextn', sys.argv[4], 'total tok/s', round(p['total_output_throughput_tps'], 1), 'per user', round(p['per_user_output_throughput_tps'], 1))" \
        "$out/b16.json" "$( [ "$tree" = "$here" ] && echo after || echo before)" $pass $k
    done
  done
done | tee "$out/batch16.txt"
for T in 1 2; do
  echo "== sweep, $T thread(s)"
  (cd "$here" && python3 -m cli sweep --max_nextn 5 --num_requests 9 --output_tokens 128 --num_threads $T --peers \
    --report_json "$out/sweep_t$T.json" --no_plot 2>/dev/null | tee "$out/sweep_t$T.txt")
done
