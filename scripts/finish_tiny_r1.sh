#!/usr/bin/env bash
# Finish a tiny-r1 training run: evaluate it (held-out sets, 50 per family, strict and relaxed), measure MTP
# acceptance at K=3 (thinking text and general text) and, with --ship, copy it into mtp_core/assets/tiny-r1.
# Usage: bash scripts/finish_tiny_r1.sh RUN_DIR [--ship]     (RUN_DIR as given to `mtp train --out`)
# The model card's prose is written by hand from the numbers this leaves in RUN_DIR/finish/.
set -euo pipefail
run=${1:?usage: finish_tiny_r1.sh RUN_DIR [--ship]}
ship=${2:-}
[ -f "$run/model/config.json" ] || { echo "error: $run/model is missing; let \`mtp train\` reach its last step first" >&2; exit 2; }
out="$run/finish"
mkdir -p "$out"
T=1
for mode in strict relaxed; do
  flag=""; [ $mode = relaxed ] && flag="--relaxed"
  python3 scripts/eval_model.py "$run/model" --per_task 50 --max_tokens 768 --threads $T $flag \
    --json "$out/eval_$mode.json" | tee "$out/eval_$mode.txt"
done
mtp sweep --model_dir "$run/model" --max_nextn 3 --num_requests 9 --output_tokens 128 --num_threads $T --no_plot \
  --report_json "$out/sweep_thinking.json" 2>&1 | tee "$out/sweep_thinking.txt"
mtp sweep --model_dir "$run/model" --task_set general --max_nextn 3 --num_requests 9 --output_tokens 128 \
  --relaxed_nextn 0 --no_roofline --num_threads $T --no_plot --report_json "$out/sweep_general.json" 2>&1 \
  | tee "$out/sweep_general.txt"
if [ "$ship" = "--ship" ]; then
  python3 scripts/ship_model.py "$run"
fi
