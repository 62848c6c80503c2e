#!/usr/bin/env bash
# MTP at real widths (random-weight checkpoints from `mtp make-scale`), 2 threads, batch 1, on a quiet machine:
#   1. every draft rejected (the head predicts nothing): MTP on with the default settings vs nextn=0, 24 tokens
#      after a 2-token warm-up (scripts/rejected_head_bench.py), on CKPT_REJECT;
#   2. a realistic acceptance, replayed (`mtp bench --replay_acceptance r1`): nextn=0, the default policy and
#      fixed K = 1, 2, 3 on CKPT_REPLAY (the step cost of each K and the policy's choices), two alternating passes;
#      with MAP_SIZE=N also the default policy and fixed K = 1, 2, 3 drafting over a draft vocabulary of N ids
#      (`mtp token-map` over the synthetic prompts; the replay sets acceptance, so the rows show the cost side).
# Usage: CKPT_REJECT=<dir> CKPT_REPLAY=<dir> bash scripts/mtp_real_width.sh OUT_DIR
set -euo pipefail
out=${1:?usage: mtp_real_width.sh OUT_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cd "$here"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's mtp_core, whatever is installed
lscpu | grep -E "Model name|^CPU\(s\)|Model:|CPU family" | tr -s ' ' | tee "$out/host.txt"

if [ -n "${CKPT_REJECT:-}" ]; then
  echo "== 1. every draft rejected: $CKPT_REJECT"
  python3 scripts/rejected_head_bench.py "$CKPT_REJECT" --threads 2 --tokens 24 --rounds 2 | tee "$out/rejected.txt"
fi

if [ -n "${CKPT_REPLAY:-}" ]; then
  echo "== 2. replayed R1 acceptance: $CKPT_REPLAY"
  python3 -m cli prepare-dataset --output "$out/synthetic.jsonl" --synthetic --num_requests 6 --input_tokens 64 \
    --output_tokens 64 --model_dir "$CKPT_REPLAY" >/dev/null
  bench() {   # name flags...
    local name=$1; shift
    python3 -m cli bench --model_dir "$CKPT_REPLAY" --dataset "$out/synthetic.jsonl" --num_threads 2 --warmup 1 \
      --max_seq_len 512 "$@" --report_json "$out/b.json" >/dev/null 2>&1
    python3 - "$out/b.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
p, s = r["performance"], r.get("decoding_stats") or {}
pol = (r.get("draft_len_policy") or {}).get("step_costs") or {}
print(f"{sys.argv[2]:28s} tok/s {p['per_user_output_throughput_tps']:7.2f}  TPOT {p['tpot_ms']:7.2f} ms  "
      f"AL {s.get('acceptance_length', 1.0):.3f}  drafted AL {s.get('drafting_acceptance_length', 0):.3f} "
      f"in {100 * s.get('drafting_share', 0):.0f}% of steps  chosen {s.get('draft_limit_histogram')}  "
      f"costs {json.dumps(pol)}")
EOF
  }
  MTP="--spec_decode_algo MTP --spec_decode_max_draft_len 3 --replay_acceptance r1"
  MAP=()
  if [ -n "${MAP_SIZE:-}" ]; then
    python3 -m cli token-map --dataset "$out/synthetic.jsonl" --model_dir "$CKPT_REPLAY" --size "$MAP_SIZE" \
      --output "$out/map.json"
    MAP=(--spec_decode_token_map "$out/map.json")
  fi
  for pass in 1 2; do
    bench "nextn=0 pass $pass"
    bench "default MTP, r1 pass $pass" $MTP
    [ ${#MAP[@]} -eq 0 ] || bench "default MTP + map, r1 pass $pass" $MTP "${MAP[@]}"
  done | tee "$out/replay.txt"
  for k in 1 2 3; do
    bench "fixed K=$k, r1" --spec_decode_algo MTP --spec_decode_max_draft_len $k --replay_acceptance r1 \
      --spec_decode_draft_len_policy fixed
    [ ${#MAP[@]} -eq 0 ] || bench "fixed K=$k + map, r1" --spec_decode_algo MTP --spec_decode_max_draft_len $k \
      --replay_acceptance r1 --spec_decode_draft_len_policy fixed "${MAP[@]}"
  done | tee -a "$out/replay.txt"
fi
