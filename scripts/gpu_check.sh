#!/usr/bin/env bash
# One-shot GPU check for an H200 (or any sm_90a / sm_100a GPU), under 8 minutes:
#   1. build mtp_core._C and mtp_core._C_cuda in place against this machine's torch,
#   2. run every test marked `gpu`,
#   3. time the FP8 MLA decode kernel (batch 1..64) against a measured device-to-device copy and
#      the weight-only NVFP4 GEMM against the bytes of its weights; print one table each;
#   4. time a decode step of the shipped model eagerly and with CUDA graphs (K = 0 and 3, batch 1 and 4)
#      and check that both give the same tokens.
# Env: MTP_CORE_CUDA_ARCHS (default: this GPU's arch only), MAX_JOBS, PYTHON, SKIP_TESTS=1, SKIP_BENCH=1.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
START=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - START )) s)"; }

"$PYTHON" - <<'EOF'
import torch
assert torch.cuda.is_available(), "gpu_check.sh: torch sees no CUDA device"
major, minor = torch.cuda.get_device_capability()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()} sm_{major}{minor}")
EOF
if [[ -z "${MTP_CORE_CUDA_ARCHS:-}" ]]; then
  MTP_CORE_CUDA_ARCHS="$("$PYTHON" -c 'import torch; a, b = torch.cuda.get_device_capability(); print(f"{a}{b}a")')"
  export MTP_CORE_CUDA_ARCHS
fi
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

stamp "build (sm_${MTP_CORE_CUDA_ARCHS})"
BUILD_DIR="$(mktemp -d)"
"$PYTHON" - "$BUILD_DIR" <<'EOF'
import sys
from setuptools import setup
from setup_ext import get_extensions
ext_modules, cmdclass = get_extensions()
setup(name="mtp_core_native", packages=[], ext_modules=ext_modules, cmdclass=cmdclass,
      script_args=["build_ext", "--inplace", "--build-temp", sys.argv[1] + "/temp", "--build-lib", sys.argv[1] + "/lib"])
EOF
"$PYTHON" -c 'import mtp_core.kernels as k; print(k.NATIVE.summary); assert k.NATIVE.cuda_archs, "CUDA extension did not build"'

if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  stamp "gpu tests"
  MTP_CORE_REQUIRE_NATIVE=1 "$PYTHON" -m pytest -q -m gpu -rs -p no:cacheprovider tests/
fi

if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
  stamp "benchmark"
  "$PYTHON" - <<'EOF'
import math
import torch
from mtp_core.kernels import mla_decode, nvfp4_gemm

torch.manual_seed(0)
dev = torch.device("cuda")
CALLS = 32   # distinct block tables per graph, so the KV reads do not come from L2 (50 MB)


def graph_time_us(fns) -> float:
    """Mean time per call of fns, captured back to back in one CUDA graph (no launch overhead)."""
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(fns))


src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
dst = torch.empty_like(src)
copy_gbs = 2 * src.numel() / graph_time_us([lambda: dst.copy_(src)] * 4) / 1e3
print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)")
del src, dst

page, seqlen, dim = 64, 4096, 576
pages_per_seq = seqlen // page
pool = torch.randn(12288, page, dim, device=dev).div_(0.05).to(torch.float8_e4m3fn)   # 453 MB
kv_scale = torch.tensor([0.05], device=dev)
print(f"\nFP8 MLA decode, seqlen {seqlen}, page {page}, 576-dim fp8 latent cache")
print(f"{'H':>4} {'Q':>2} {'B':>3} {'us':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8}")
for heads, num_q in ((16, 2), (128, 1), (128, 2)):
    for batch in (1, 2, 4, 8, 16, 32, 64):
        q_lat = torch.randn(batch, num_q, heads, 512, device=dev, dtype=torch.bfloat16)
        q_pe = torch.randn(batch, num_q, heads, 64, device=dev, dtype=torch.bfloat16)
        lens = torch.full((batch,), seqlen, dtype=torch.int32, device=dev)
        tables = [torch.randint(0, pool.shape[0], (batch, pages_per_seq), dtype=torch.int32, device=dev)
                  for _ in range(CALLS)]
        fns = [lambda t=t: mla_decode(q_lat, q_pe, pool, t, lens, 1 / math.sqrt(192), kv_scale) for t in tables]
        us = graph_time_us(fns)
        gbs = batch * pages_per_seq * page * dim / us / 1e3
        tflops = batch * num_q * heads * seqlen * 2 * (576 + 512) / us / 1e6
        print(f"{heads:>4} {num_q:>2} {batch:>3} {us:>8.1f} {gbs:>7.0f} {100 * gbs / copy_gbs:>5.0f}% {tflops:>8.1f}")
del pool

print("\nWeight-only NVFP4 GEMM (in-kernel dequant to bf16), bytes = packed weight + block scales")
print(f"{'N':>5} {'K':>5} {'M':>3} {'us':>8} {'GB/s':>7} {'%copy':>6}")
for n, k in ((7168, 2048), (2048, 7168), (4096, 7168)):
    weights = [(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev),
                torch.rand(n, k // 16, device=dev).add_(0.1).to(torch.float8_e4m3fn)) for _ in range(8)]
    scale_2 = torch.tensor([0.01], device=dev)
    for m in (1, 16, 64):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        us = graph_time_us([lambda w=w, s=s: nvfp4_gemm(x, w, s, scale_2) for w, s in weights])
        gbs = (n * k // 2 + n * k // 16) / us / 1e3
        print(f"{n:>5} {k:>5} {m:>3} {us:>8.1f} {gbs:>7.0f} {100 * gbs / copy_gbs:>5.0f}%")

print("\nDecode step of the shipped tiny-r1 (bf16), eager vs CUDA graphs (the whole step: target, verification,")
print("K Eagle drafts), greedy, prompts x 96 tokens; the same tokens are required")
import time
from mtp_core.config import CudaGraphConfig, LLMConfig, SpeculativeConfig
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams
prompts = ["What is 347 + 285?", "Sort these numbers: 42, 7, 19, 88, 3", "Add 2012 and 346.",
           "How many times does the letter r appear in strawberry?"]
print(f"{'K':>2} {'B':>2} {'eager ms/step':>14} {'graph ms/step':>14} {'speed-up':>9} {'same':>5}")
for K in (0, 3):
    for batch in (1, 4):
        res = {}
        for cg in (None, CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True)):
            spec = SpeculativeConfig(num_nextn_predict_layers=K, mtp_mode="eagle", draft_len_policy="fixed") if K else None
            llm = LLM(LLMConfig(model_dir="mtp_core/assets/tiny-r1", dtype="bfloat16", device="cuda",
                                max_batch_size=4, speculative_config=spec, cuda_graph_config=cg))
            sp = SamplingParams(max_tokens=96, ignore_eos=True)
            llm.generate(prompts[:batch], sp)
            torch.cuda.synchronize()
            s0, t = llm.engine.num_steps, time.perf_counter()
            outs = llm.generate(prompts[:batch], sp)
            torch.cuda.synchronize()
            res[cg is not None] = (1e3 * (time.perf_counter() - t) / (llm.engine.num_steps - s0),
                                   [o.token_ids for o in outs])
        same = res[True][1] == res[False][1]
        print(f"{K:>2} {batch:>2} {res[False][0]:>14.2f} {res[True][0]:>14.2f} "
              f"{res[False][0] / res[True][0]:>8.2f}x {str(same):>5}")
EOF
fi
stamp "done"
