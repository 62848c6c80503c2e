#!/usr/bin/env bash
# Every number in BENCHMARKS.md, in one go, on the shipped model (CPU, 1 torch thread unless said).
# Usage: bash scripts/run_benchmarks.sh [OUT_DIR]   (about 15 minutes on the project's 2-core machines)
# The vLLM peer runs last, only when its venv exists (VLLM_PYTHON, default /work/venvs/vllm/bin/python; ~5 more min).
set -euo pipefail
out=${1:-runs/bench}
mkdir -p "$out"
T=1
echo "== sweep (figure 7 + 8, peers, roofline)"
mtp sweep --max_nextn 5 --num_requests 9 --output_tokens 128 --accuracy --accuracy_per_family 10 --peers \
  --num_threads $T --report_json "$out/sweep.json" --plot "$out/mtp_sweep.png" 2>&1 | tee "$out/sweep.txt"
echo "== batching: output tokens/s at batch 1, 4, 16 (nextn 0 and 3)"
mtp prepare-dataset --output "$out/ds.jsonl" --num_requests 32 --output_tokens 128
for c in 1 4 16; do
  mtp bench --dataset "$out/ds.jsonl" --num_requests 32 --concurrency $c --max_batch_size $c --num_threads $T \
    --report_json "$out/bench_c${c}_k0.json" > "$out/bench_c${c}_k0.txt" 2>&1
  mtp bench --dataset "$out/ds.jsonl" --num_requests 32 --concurrency $c --max_batch_size $c --num_threads $T \
    --spec_decode_algo MTP --spec_decode_max_draft_len 3 --report_json "$out/bench_c${c}_k3.json" \
    > "$out/bench_c${c}_k3.txt" 2>&1
  python3 - "$out" $c <<'PY'
import json, sys
out, c = sys.argv[1], sys.argv[2]
for k in (0, 3):
    r = json.load(open(f"{out}/bench_c{c}_k{k}.json"))
    p = r["performance"]
    print(f"batch {c:>2} nextn {k}: total {p['total_output_throughput_tps']:.1f} tok/s, "
          f"per user {p['per_user_output_throughput_tps']:.1f} tok/s, AL {r['decoding_stats'].get('acceptance_length', 1.0):.2f}")
PY
done | tee "$out/batching.txt"
echo "== general text: AL at K=3 (Vanilla and Eagle) on standard-library prompts"
mtp prepare-dataset --task_set general --output "$out/general.jsonl" --num_requests 9 --output_tokens 128
for mode in vanilla eagle; do
  mtp bench --dataset "$out/general.jsonl" --num_requests 9 --concurrency 1 --num_threads $T --spec_decode_algo MTP \
    --spec_decode_max_draft_len 3 --mtp_mode $mode --report_json "$out/general_$mode.json" > "$out/general_$mode.txt" 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['decoding_stats']; print(sys.argv[2], 'AL', round(d['acceptance_length'], 3), 'per position', [round(x, 3) for x in d.get('acceptance_per_position', [])])" \
    "$out/general_$mode.json" $mode
done | tee "$out/general.txt"
echo "== quantized checkpoints"
python3 scripts/quant_eval.py --model_dir mtp_core/assets/tiny-r1 --per_family 10 --out "$out/quant" --threads 2 \
  | tee "$out/quant.txt"
echo "== peer: vLLM's CPU build on the same model and prompts (only when its venv exists)"
vllm_py=${VLLM_PYTHON:-/work/venvs/vllm/bin/python}
if [ -x "$vllm_py" ]; then
  python3 scripts/compare_vllm.py --vllm_python "$vllm_py" --num_threads $T --rounds 2 --work_dir "$out/vllm" \
    --report_json "$out/vllm.json" | tee "$out/vllm.txt"
else
  echo "skipped: no vLLM venv python at $vllm_py (set VLLM_PYTHON, or see scripts/compare_vllm.py)" | tee "$out/vllm.txt"
fi
