#!/usr/bin/env bash
# First run on a GPU box (H100/H200 sm_90a or B200 sm_100a; torch with CUDA, no package registry needed),
# under 8 minutes. Stages, each with its own timeout; a failed stage does not stop the later ones, except
# the build (fatal: nothing after it could mean anything). A summary of every stage ends the run.
#   env        python / torch / GPU
#   build      stale mtp_core/_C*.so removed, mtp_core._C + mtp_core._C_cuda built in place for this GPU
#   import     the CUDA kernels load for this GPU
#   tests      the gpu-marked test files (scripts/gpu_check.py select-tests: parsed, never imported; no
#              test_serve*, none whose imports are missing here)
#   memcheck / racecheck   compute-sanitizer on 3 small kernel cases (skipped without compute-sanitizer)
#   bench      copy bandwidth; FP8 MLA decode GB/s (H = 16 / 128, Q = 1 / 2); NVFP4 / FP8 / bf16 GEMMs
#   decode     a kv_lora_rank-512 model's decode step eager vs CUDA graphs; greedy MTP == plain
# Everything is tee'd into $OUT/gpu_check.log when $OUT is set. Exit status: 0 when every stage passed
# or was skipped.
#
# Usage: scripts/gpu_check.sh [--dry_run]
#   --dry_run: the same stages on the CPU against the torch references (MTP_CORE_KERNELS=reference,
#              tiny shapes); builds and removes nothing; exits 0 when every stage passes (CI runs it).
# Env: PYTHON, MTP_CORE_CUDA_ARCHS (default: this GPU's arch), MAX_JOBS, GPU_CHECK_BUDGET_S (default 470:
#      no stage starts a timeout past it), SKIP_TESTS=1, SKIP_SANITIZER=1, SKIP_BENCH=1, SKIP_DECODE=1.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DRY=0
for arg in "$@"; do
  case "$arg" in
    --dry_run) DRY=1 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (use --dry_run)" >&2; exit 2 ;;
  esac
done
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
  TEE_PID=$!
fi
START=$(date +%s)
BUDGET="${GPU_CHECK_BUDGET_S:-470}"
DRY_FLAG=()
if [[ $DRY == 1 ]]; then
  DRY_FLAG=(--dry_run)
  export MTP_CORE_KERNELS=reference
  echo "gpu_check.sh --dry_run: CPU, torch reference kernels, tiny shapes (the numbers mean nothing)"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHON DRY
NAMES=() STATUS=() SECS=()
FATAL=""

# run_stage NAME TIMEOUT_S CMD...: runs CMD under a timeout clipped to the remaining budget, records its status.
run_stage() {
  local name="$1" limit="$2"; shift 2
  local now=$(( $(date +%s) - START ))
  if [[ -n "$FATAL" ]]; then
    NAMES+=("$name"); STATUS+=("not run ($FATAL)"); SECS+=(0); return 1
  fi
  local left=$(( BUDGET - now ))
  if (( left < 10 )); then
    NAMES+=("$name"); STATUS+=("not run (time budget of ${BUDGET} s spent)"); SECS+=(0); return 1
  fi
  (( limit > left )) && limit=$left
  echo
  echo "== $name (at ${now} s, timeout ${limit} s)"
  local t0=$(date +%s) rc
  # through bash -c so that a stage may be one of the functions below (exported with export -f)
  timeout --kill-after=10 "$limit" bash -c '"$@"' gpu_check_stage "$@"
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  NAMES+=("$name"); SECS+=("$dt")
  if (( rc == 0 )); then STATUS+=("ok")
  elif (( rc == 124 || rc == 137 )); then STATUS+=("TIMEOUT after ${limit} s")
  else STATUS+=("FAILED (exit $rc)"); fi
  return $rc
}

skip_stage() { NAMES+=("$1"); STATUS+=("skipped ($2)"); SECS+=(0); echo; echo "== $1: skipped ($2)"; }

summary() {
  echo
  echo "== summary ($(( $(date +%s) - START )) s in all)"
  local failed=0 i
  for i in "${!NAMES[@]}"; do
    printf '  %-10s %5s s  %s\n' "${NAMES[$i]}" "${SECS[$i]}" "${STATUS[$i]}"
    [[ "${STATUS[$i]}" == ok || "${STATUS[$i]}" == skipped* ]] || failed=1
  done
  if (( failed )); then echo "gpu_check: FAILED"; else echo "gpu_check: all stages passed"; fi
  return $failed
}

# ---- env ---------------------------------------------------------------------------------------
env_check() {
  "$PYTHON" - "$DRY" <<'EOF'
import sys, platform
import torch
dry = sys.argv[1] == "1"
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
from importlib.util import find_spec
need = ("safetensors", "tokenizers", "jinja2")       # what the engine imports (mtp_core.llm)
missing = [m for m in need if find_spec(m) is None]
optional = [m for m in ("pytest", "hypothesis", "yaml", "deep_gemm") if find_spec(m) is None]
print("python packages:", f"missing {', '.join(missing)}" if missing else "all the engine needs",
      f"(optional, absent: {', '.join(optional)})" if optional else "")
if missing:
    sys.exit(f"gpu_check.sh: the engine cannot run without {', '.join(missing)}")
if dry:
    print("dry run: CPU", platform.processor() or platform.machine())
    sys.exit(0)
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device")
major, minor = torch.cuda.get_device_capability()
print(f"{torch.cuda.get_device_name()} sm_{major}{minor}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
EOF
}
export -f env_check
run_stage env 60 env_check || FATAL="no usable torch / GPU"

# ---- build -------------------------------------------------------------------------------------
build() {
  local stale
  stale=$(find mtp_core -maxdepth 1 -name '_C*.so' 2>/dev/null | tr '\n' ' ')
  if [[ $DRY == 1 ]]; then
    echo "dry run: would remove ${stale:-nothing} and build mtp_core._C + mtp_core._C_cuda in place"
    "$PYTHON" -c 'from setup_ext import get_extensions; print("setup_ext imports")'
    return $?
  fi
  if [[ -n "$stale" ]]; then echo "removing stale $stale"; rm -f $stale; fi
  if [[ -z "${MTP_CORE_CUDA_ARCHS:-}" ]]; then
    MTP_CORE_CUDA_ARCHS="$("$PYTHON" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}a")')"
    export MTP_CORE_CUDA_ARCHS
  fi
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  echo "building for sm_${MTP_CORE_CUDA_ARCHS} with MAX_JOBS=${MAX_JOBS}"
  local dir log rc
  dir="$(mktemp -d)"; log="$dir/build.log"
  "$PYTHON" - "$dir" >"$log" 2>&1 <<'EOF'
import sys
from setuptools import setup
from setup_ext import get_extensions
ext_modules, cmdclass = get_extensions()
setup(name="mtp_core_native", packages=[], ext_modules=ext_modules, cmdclass=cmdclass,
      script_args=["build_ext", "--inplace", "--build-temp", sys.argv[1] + "/temp", "--build-lib", sys.argv[1] + "/lib"])
EOF
  rc=$?
  if (( rc != 0 )); then
    echo "BUILD FAILED (exit $rc); the last 80 lines of $log:"
    tail -n 80 "$log"
    return $rc
  fi
  if ! ls mtp_core/_C_cuda*.so >/dev/null 2>&1; then
    echo "BUILD FAILED: no mtp_core/_C_cuda*.so was built (is CUDA_HOME / nvcc visible?); the last 40 lines of $log:"
    tail -n 40 "$log"
    return 1
  fi
  ls -l mtp_core/_C*.so
}
export -f build
run_stage build 300 build || FATAL="build failed"

import_check() {
  "$PYTHON" - "$DRY" <<'EOF'
import sys
import mtp_core.kernels as k
print(k.native_ops().summary)
if sys.argv[1] == "1":
    assert not k.native_ops().cpu, "dry run must use the torch references"
else:
    import torch
    assert k.native_ops().cuda_ok(torch.device("cuda", 0)), "mtp_core._C_cuda did not load for this GPU"
EOF
}
export -f import_check
run_stage import 60 import_check || FATAL="the CUDA kernels do not load"

# ---- tests -------------------------------------------------------------------------------------
run_tests() {
  local files
  files=$("$PYTHON" scripts/gpu_check.py select-tests) || return 1
  echo "gpu-marked test files: $files"
  if [[ $DRY == 1 ]]; then
    # shellcheck disable=SC2086
    "$PYTHON" -m pytest -q -m gpu --collect-only -p no:cacheprovider $files
    local rc=$?
    (( rc == 5 )) && return 0   # "no tests collected" is not possible on a GPU; on a CPU collection is the check
    return $rc
  fi
  # shellcheck disable=SC2086
  MTP_CORE_REQUIRE_NATIVE=1 "$PYTHON" -m pytest -q -m gpu -rs -p no:cacheprovider $files
}
export -f run_tests
if [[ "${SKIP_TESTS:-0}" == 1 ]]; then skip_stage tests "SKIP_TESTS=1"; else run_stage tests 240 run_tests; fi

# ---- compute-sanitizer -------------------------------------------------------------------------
if [[ "${SKIP_SANITIZER:-0}" == 1 ]]; then
  skip_stage memcheck "SKIP_SANITIZER=1"; skip_stage racecheck "SKIP_SANITIZER=1"
elif [[ $DRY == 1 ]]; then
  run_stage memcheck 60 "$PYTHON" scripts/gpu_check.py sanitize --dry_run
  skip_stage racecheck "dry run: the memcheck stage ran the same cases against the references"
else
  SAN="$(command -v compute-sanitizer || true)"
  [[ -z "$SAN" && -x /usr/local/cuda/bin/compute-sanitizer ]] && SAN=/usr/local/cuda/bin/compute-sanitizer
  if [[ -z "$SAN" ]]; then
    skip_stage memcheck "compute-sanitizer not found"; skip_stage racecheck "compute-sanitizer not found"
  else
    run_stage memcheck 120 "$SAN" --tool memcheck --error-exitcode 3 "$PYTHON" scripts/gpu_check.py sanitize
    run_stage racecheck 150 "$SAN" --tool racecheck --error-exitcode 3 "$PYTHON" scripts/gpu_check.py sanitize
  fi
fi

# ---- benchmarks and the decode step --------------------------------------------------------------
if [[ "${SKIP_BENCH:-0}" == 1 ]]; then skip_stage bench "SKIP_BENCH=1"
else run_stage bench 150 "$PYTHON" scripts/gpu_check.py bench "${DRY_FLAG[@]}"; fi
if [[ "${SKIP_DECODE:-0}" == 1 ]]; then skip_stage decode "SKIP_DECODE=1"
else run_stage decode 200 "$PYTHON" scripts/gpu_check.py decode "${DRY_FLAG[@]}"; fi

summary
RC=$?
if [[ -n "${TEE_PID:-}" ]]; then   # let tee write the last lines before the caller reads the log
  exec >&- 2>&-
  wait "$TEE_PID" 2>/dev/null
fi
exit $RC
