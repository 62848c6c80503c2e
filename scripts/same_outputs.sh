#!/usr/bin/env bash
# same_outputs.sh TREE_A TREE_B [OUT]: does a change keep the shipped model's outputs? Runs the quickstart (its three
# prompts, 768 tokens) in both checkouts under deterministic settings (nextn=0, Eagle K=1 / K=3, Vanilla K=3,
# relaxed, the confidence gate, sampled with a seed; draft_len_policy fixed) and the sweep (K <= 3, 9 prompts x 128
# tokens), then compares: stdout byte for byte, the statistics lines, and the sweep's AL / acceptance / drafts /
# waste in every fixed-setting row (the policy rows choose from measured timings). Exit 0 when all are the same.
# Each TREE is a checkout with its CPU extension built (python3 setup.py build_ext --inplace).
set -u
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); OUT=${3:-$(mktemp -d)}
capture() {   # capture TREE DIR
  mkdir -p "$2"
  local q=(python3 -m cli quickstart --num_threads 1)
  local mtp=(--spec_decode_algo MTP --spec_decode_draft_len_policy fixed)
  ( cd "$1" && export OMP_NUM_THREADS=1
    "${q[@]}" > "$2/plain.out" 2> "$2/plain.err"
    "${q[@]}" "${mtp[@]}" --spec_decode_max_draft_len 1 > "$2/eagle1.out" 2> "$2/eagle1.err"
    "${q[@]}" "${mtp[@]}" --spec_decode_max_draft_len 3 > "$2/eagle3.out" 2> "$2/eagle3.err"
    "${q[@]}" "${mtp[@]}" --spec_decode_max_draft_len 3 --use_mtp_vanilla > "$2/vanilla3.out" 2> "$2/vanilla3.err"
    "${q[@]}" "${mtp[@]}" --spec_decode_max_draft_len 3 --use_relaxed_acceptance_for_thinking --relaxed_topk 10 \
      --relaxed_delta 0.6 > "$2/relaxed.out" 2> "$2/relaxed.err"
    "${q[@]}" "${mtp[@]}" --spec_decode_max_draft_len 3 --spec_decode_draft_confidence 0.5 > "$2/conf.out" 2> "$2/conf.err"
    "${q[@]}" "${mtp[@]}" --spec_decode_max_draft_len 3 --temperature 0.8 --top_k 20 --seed 7 \
      > "$2/sampled.out" 2> "$2/sampled.err"
    python3 -m cli sweep --max_nextn 3 --num_requests 9 --output_tokens 128 --num_threads 1 --no_plot \
      > "$2/sweep.out" 2> "$2/sweep.err" )
}
stats() { grep -E "^(decoding|drafts|acceptance|accepted|waste)" "$1"; }
sweep_al() {   # setting, K, AL, accept, drafts, waste of the fixed-setting rows
  grep -E "^(nextn|eagle|vanilla)" "$1" | grep -v policy | awk '{n = NF; print substr($0, 1, 34), $(n-12), $(n-11), $(n-10), $(n-6), $(n-5)}'
}
capture "$A" "$OUT/a"; capture "$B" "$OUT/b"
same=0
for f in "$OUT"/a/*.out; do
  n=$(basename "$f" .out); [ "$n" = sweep ] && continue
  cmp -s "$f" "$OUT/b/$n.out" || { echo "stdout differs: $n"; same=1; }
  diff -q <(stats "$OUT/a/$n.err") <(stats "$OUT/b/$n.err") > /dev/null || { echo "statistics differ: $n"; same=1; }
done
diff <(sweep_al "$OUT/a/sweep.out") <(sweep_al "$OUT/b/sweep.out") || { echo "sweep AL differs"; same=1; }
[ "$(sweep_al "$OUT/a/sweep.out" | wc -l)" -ge 10 ] || { echo "sweep: fewer than 10 rows in $OUT/a/sweep.out"; same=1; }
[ $same = 0 ] && echo "same outputs, statistics and sweep AL ($OUT)"
exit $same
