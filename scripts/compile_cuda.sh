#!/usr/bin/env bash
# Compile every CUDA source under csrc/ to an object file (no link) for sm_90a and sm_100a,
# against the headers of the installed torch, with the same defines torch's CUDAExtension uses.
# Works on a machine without a GPU and with a CPU-only torch wheel (it ships the CUDA headers).
# Fails on the first compiler error. Usage: scripts/compile_cuda.sh [-v]   (-v: ptxas register report)
set -euo pipefail

cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
PYTHON="${PYTHON:-python}"
VERBOSE=0
[[ "${1:-}" == "-v" ]] && VERBOSE=1

if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "compile_cuda.sh: nvcc not found (set NVCC=/path/to/nvcc)" >&2
  exit 1
fi

mapfile -t TORCH_INCLUDES < <("$PYTHON" -c 'import torch.utils.cpp_extension as c; print("\n".join(c.include_paths()))')
PY_INCLUDE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
CXX11_ABI="$("$PYTHON" -c 'import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')"
mapfile -t COMMON_FLAGS < <("$PYTHON" -c 'import torch.utils.cpp_extension as c; print("\n".join(c.COMMON_NVCC_FLAGS))')

INCLUDES=(-I csrc -I "$PY_INCLUDE")
for inc in "${TORCH_INCLUDES[@]}"; do INCLUDES+=(-I "$inc"); done

ARCHS=(-gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_100a,code=sm_100a)
FLAGS=(-std=c++20 -O3 -c "${ARCHS[@]}" "${COMMON_FLAGS[@]}" -Xcompiler -fPIC
       "-D_GLIBCXX_USE_CXX11_ABI=${CXX11_ABI}" -DTORCH_EXTENSION_NAME=_C_cuda)
[[ $VERBOSE == 1 ]] && FLAGS+=(-Xptxas -v)

OUT_DIR="$(mktemp -d)"
trap 'rm -rf "$OUT_DIR"' EXIT

mapfile -t SOURCES < <(find csrc -name '*.cu' | sort)
if [[ ${#SOURCES[@]} -eq 0 ]]; then
  echo "compile_cuda.sh: no .cu files under csrc/" >&2
  exit 1
fi

echo "nvcc: $("$NVCC" --version | tail -1)"
for src in "${SOURCES[@]}"; do
  obj="$OUT_DIR/$(basename "${src%.cu}").o"
  start=$(date +%s)
  "$NVCC" "${FLAGS[@]}" "${INCLUDES[@]}" -o "$obj" "$src"
  echo "ok  $src  (sm_90a + sm_100a, $(( $(date +%s) - start )) s)"
done

# The CUDA bindings are host C++ (g++ builds them in the real extension); check their syntax too.
# A CPU-only torch wheel ships c10/cuda headers but not the generated cuda_cmake_macros.h: shim it.
SHIM_INC=()
if ! find "${TORCH_INCLUDES[@]}" -path '*c10/cuda/impl/cuda_cmake_macros.h' 2>/dev/null | grep -q .; then
  mkdir -p "$OUT_DIR/shim/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$OUT_DIR/shim/c10/cuda/impl/cuda_cmake_macros.h"
  SHIM_INC=(-I "$OUT_DIR/shim")
fi
CUDA_INC=""
for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}" "$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")" \
            /usr/local/cuda; do
  if [[ -n "$home" && -f "$home/include/cuda_runtime.h" ]]; then CUDA_INC="$home/include"; break; fi
done
if [[ -z "$CUDA_INC" ]]; then
  echo "compile_cuda.sh: cuda_runtime.h not found (set CUDA_HOME)" >&2
  exit 1
fi
for src in $(find csrc/cuda -name '*.cpp' | sort); do
  start=$(date +%s)
  "${CXX:-g++}" -std=c++20 -fsyntax-only -I "$CUDA_INC" "${INCLUDES[@]}" "${SHIM_INC[@]}" \
    "-D_GLIBCXX_USE_CXX11_ABI=${CXX11_ABI}" "$src"
  echo "ok  $src  (host syntax, $(( $(date +%s) - start )) s)"
done
echo "compile_cuda.sh: all CUDA sources compiled"
