"""The Python stages of scripts/gpu_check.sh (one subcommand per stage; run them through the shell script).

    python scripts/gpu_check.py select-tests            # gpu-marked test files that can be imported here
    python scripts/gpu_check.py sanitize [--dry_run]    # 3 small kernel launches (for compute-sanitizer)
    python scripts/gpu_check.py bench [--dry_run]       # copy bandwidth, MLA decode table, GEMM table
    python scripts/gpu_check.py decode [--dry_run]      # decode step of a kv_lora_rank-512 model, MTP == plain

--dry_run walks the same code on the CPU against the torch references (MTP_CORE_KERNELS=reference, tiny
shapes, one repetition) so that CI keeps the script working; its numbers mean nothing.
"""
from __future__ import annotations

import argparse
import ast
import gc
import importlib.util
import logging
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Test files never run here whatever they import (the server stack: fastapi / openai / httpx / uvicorn).
EXCLUDED_PREFIXES = ("test_serve",)


# ---- select-tests ------------------------------------------------------------------------------
def _imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _uses_gpu_marker(tree: ast.AST) -> bool:
    """pytest.mark.gpu anywhere in the file (decorator or pytestmark), read from the syntax tree."""
    return any(isinstance(n, ast.Attribute) and n.attr == "gpu" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(tree))


def select_test_files(tests_dir: Path) -> tuple[list[Path], list[str]]:
    """(gpu-marked test files whose imports all resolve here, 'file: why skipped' lines). Files are parsed,
    never imported; conftest.py's own imports count for every file."""
    local = {p.stem for p in tests_dir.glob("*.py")} | {"mtp_core", "cli", "scripts"}
    conftest = tests_dir / "conftest.py"
    base = _imports(ast.parse(conftest.read_text())) if conftest.is_file() else set()
    chosen, skipped = [], []
    for path in sorted(tests_dir.glob("test_*.py")):
        if path.name.startswith(EXCLUDED_PREFIXES):
            continue
        tree = ast.parse(path.read_text())
        if not _uses_gpu_marker(tree):
            continue
        missing = sorted(m for m in (_imports(tree) | base) - local
                         if m not in sys.builtin_module_names and importlib.util.find_spec(m) is None)
        if missing:
            skipped.append(f"{path.name}: needs {', '.join(missing)} (not installed)")
        else:
            chosen.append(path)
    return chosen, skipped


def cmd_select_tests(args) -> int:
    chosen, skipped = select_test_files(ROOT / "tests")
    for line in skipped:
        print(f"gpu_check: skipping {line}", file=sys.stderr)
    if not chosen:
        print("gpu_check: no gpu-marked test file can be imported here", file=sys.stderr)
        return 1
    print(" ".join(str(p.relative_to(ROOT)) for p in chosen))
    return 0


# ---- shared helpers ----------------------------------------------------------------------------
def _setup(dry_run: bool):
    import torch
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py: torch sees no CUDA device (use --dry_run on a CPU)")
    return torch.device("cpu" if dry_run else "cuda")


def _time_us(fns, dev, reps: int) -> float:
    """Mean time per call of fns: on CUDA captured back to back in one graph (no launch overhead)."""
    import torch
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            for fn in fns:
                fn()
        return (time.perf_counter() - t) * 1e6 / (reps * len(fns))
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
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(fns))


def _mla_inputs(torch, dev, batch, num_q, heads, seqlen, num_blocks, page=64, latent=512, rope=64):
    pool = (torch.randn(num_blocks, page, latent + rope, device=dev) / 0.05).to(torch.float8_e4m3fn)
    q_lat = torch.randn(batch, num_q, heads, latent, device=dev, dtype=torch.bfloat16)
    q_pe = torch.randn(batch, num_q, heads, rope, device=dev, dtype=torch.bfloat16)
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device=dev)
    pages = -(-seqlen // page)
    table = torch.randint(0, num_blocks, (batch, pages), dtype=torch.int32, device=dev)
    return q_lat, q_pe, pool, table, lens, torch.tensor([0.05], device=dev)


# ---- sanitize ----------------------------------------------------------------------------------
def cmd_sanitize(args) -> int:
    """Three small launches of each kernel family, each checked against its reference (the sanitizer
    watches the launches; the comparison catches wrong values it cannot see)."""
    torch = __import__("torch")
    dev = _setup(args.dry_run)
    from mtp_core.kernels import (mla_decode, mla_decode_ref, nvfp4_gemm, nvfp4_gemm_ref, nvfp4_quantize,
                                  quantize_nvfp4_ref)
    ok = True
    # MLA: split-KV with a combine (2 rows, one short: empty splits), and a single-split padded slot
    for batch, num_q, heads, seqlen in ((2, 1, 16, 300), (1, 2, 16, 70)):
        args_ = _mla_inputs(torch, dev, batch, num_q, heads, seqlen, num_blocks=16)
        args_[4][0] = 5                                        # a short row next to a long one
        out, lse = mla_decode(*args_[:5], 1 / math.sqrt(192), args_[5])
        want, want_lse = mla_decode_ref(*args_[:5], 1 / math.sqrt(192), args_[5])
        err = (out.float() - want.float()).abs().max().item()
        print(f"mla_decode B={batch} Q={num_q} H={heads} seqlen={seqlen}: max |err| {err:.3g}")
        ok &= err < 5e-2 and torch.allclose(lse, want_lse, atol=2e-3, rtol=1e-3)
    # NVFP4 weight-only GEMM with split-K, and activation quantization with a NaN block
    x = torch.randn(3, 1024, device=dev, dtype=torch.bfloat16)
    w = torch.randint(0, 256, (200, 512), dtype=torch.uint8, device=dev)
    s = (torch.rand(200, 64, device=dev) + 0.1).to(torch.float8_e4m3fn)
    s2 = torch.tensor([0.02], device=dev)
    got, want = nvfp4_gemm(x, w, s, s2).float(), nvfp4_gemm_ref(x, w, s, s2).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"nvfp4_gemm M=3 N=200 K=1024: max relative err {err:.3g}")
    ok &= err < 1e-2
    x[1, 5] = float("nan")
    gs = torch.tensor([0.01], device=dev)
    packed, scale = nvfp4_quantize(x, gs)
    want_packed, want_scale = quantize_nvfp4_ref(x, gs)
    same = torch.equal(packed, want_packed) and torch.equal(scale.view(torch.uint8), want_scale.view(torch.uint8))
    print(f"nvfp4_quantize 3x1024 with a NaN: bitwise equal to the reference: {same}")
    ok &= same
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print("sanitize cases:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


# ---- bench -------------------------------------------------------------------------------------
def cmd_bench(args) -> int:
    torch = __import__("torch")
    dev = _setup(args.dry_run)
    import torch.nn.functional as F
    from mtp_core.kernels import native_ops, mla_decode, nvfp4_gemm
    from mtp_core.kernels.dispatch import choose_linear_kernel, linear_target
    from mtp_core.loader.quant.fp8 import quantize_fp8_block
    from mtp_core.loader.quant.linear import Fp8BlockLinear, Nvfp4Linear
    dry = args.dry_run
    reps = 1 if dry else 5
    print(f"kernels: {native_ops().summary}")

    n_bytes = (1 << 20) if dry else (1 << 30)
    src = torch.ones(n_bytes, dtype=torch.uint8, device=dev)       # written: untouched pages read as zero
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() / _time_us([lambda: dst.copy_(src)] * 4, dev, reps) / 1e3
    print(f"copy: {copy_gbs:.0f} GB/s (read + write, {n_bytes >> 20} MiB)")
    del src, dst

    seqlen = 256 if dry else 4096
    calls = 2 if dry else 32          # distinct block tables per graph, so the KV reads do not come from L2
    pool_blocks = 64 if dry else 12288
    print(f"\nFP8 MLA decode, seqlen {seqlen}, page 64, 576-dim e4m3 latent cache "
          f"(bytes = fp8 pages read; %copy of the copy above)")
    print(f"{'H':>4} {'Q':>2} {'B':>3} {'us':>9} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8}")
    batches = (1, 4) if dry else (1, 2, 4, 8, 16, 32, 64)
    pool = (torch.randn(pool_blocks, 64, 576, device=dev) / 0.05).to(torch.float8_e4m3fn)
    kv_scale = torch.tensor([0.05], device=dev)
    for heads, num_q in ((16, 1), (16, 2), (128, 1), (128, 2)):
        for batch in batches:
            q_lat = torch.randn(batch, num_q, heads, 512, device=dev, dtype=torch.bfloat16)
            q_pe = torch.randn(batch, num_q, heads, 64, device=dev, dtype=torch.bfloat16)
            lens = torch.full((batch,), seqlen, dtype=torch.int32, device=dev)
            tables = [torch.randint(0, pool_blocks, (batch, seqlen // 64), dtype=torch.int32, device=dev)
                      for _ in range(calls)]
            fns = [lambda t=t: mla_decode(q_lat, q_pe, pool, t, lens, 1 / math.sqrt(192), kv_scale) for t in tables]
            us = _time_us(fns, dev, reps)
            gbs = batch * seqlen * 576 / us / 1e3
            tflops = batch * num_q * heads * seqlen * 2 * (576 + 512) / us / 1e6
            print(f"{heads:>4} {num_q:>2} {batch:>3} {us:>9.1f} {gbs:>7.1f} {100 * gbs / copy_gbs:>5.0f}% "
                  f"{tflops:>8.2f}")
    del pool

    shapes = ((256, 128),) if dry else ((7168, 2048), (2048, 7168), (4096, 7168))
    ms = (1, 16) if dry else (1, 16, 64)
    target = linear_target(dev)
    print(f"\nGEMMs, weights [N, K], activations [M, K] bf16; GB/s = weight bytes read / time")
    print(f"{'kernel':>14} {'N':>5} {'K':>5} {'M':>3} {'us':>9} {'GB/s':>7} {'%copy':>6}")
    for n, k in shapes:
        w = torch.randn(n, k) * 0.02
        fp8_w, fp8_s = quantize_fp8_block(w)
        from mtp_core.loader.quant.nvfp4 import quantize_nvfp4
        nv_w, nv_s, nv_s2 = quantize_nvfp4(w)
        weights = {
            "bf16": (lambda wb=w.to(dev, torch.bfloat16): (lambda x: x @ wb.t()), n * k * 2),
            "nvfp4": (lambda: _nvfp4_module(Nvfp4Linear, nv_w, nv_s, nv_s2, dev), n * k // 2 + n * k // 16),
            "fp8_block": (lambda: Fp8BlockLinear(fp8_w, fp8_s).to(dev), n * k + fp8_s.numel() * 4),
        }
        for name, (make, nbytes) in weights.items():
            fn = make()
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                fn(x)
                kernel = getattr(fn, "kernel", None) or "torch matmul"
                us = _time_us([lambda: fn(x)] * (2 if dry else 8), dev, reps)
                gbs = nbytes / us / 1e3
                print(f"{kernel:>14} {n:>5} {k:>5} {m:>3} {us:>9.1f} {gbs:>7.1f} {100 * gbs / copy_gbs:>5.0f}%"
                      f"  ({name})")
    kernel, why = choose_linear_kernel("nvfp4", 7168, 2048, torch.bfloat16, target, has_input_scale=True)
    print(f"\nNVFP4 with an input_scale on this device: {kernel} ({why})")
    return 0


def _nvfp4_module(cls, w, s, s2, dev):
    import torch
    gs = torch.tensor(0.02)       # input_scale: the W4A4 path (Blackwell) quantizes activations with it
    return cls(w, s, s2, gs).to(dev)


# ---- decode ------------------------------------------------------------------------------------
class _FallbackLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        msg = record.getMessage()
        if "torch reference" in msg:
            self.lines.append(msg)


def cmd_decode(args) -> int:
    """A decode step of a model whose kv_lora_rank (512) reaches the CUDA MLA kernel: the scale-model maker's
    Moonlight widths at 2 layers + 1 MTP module (8 experts, vocab 4096), bf16 weights, fp8 KV cache. Eager vs
    CUDA graphs for K = 0 and 3, batch 1 and 4; greedy tokens with MTP must equal those without."""
    torch = __import__("torch")
    dev = _setup(args.dry_run)
    dry = args.dry_run
    handler = _FallbackLog()
    klog = logging.getLogger("mtp_core.kernels")
    klog.addHandler(handler)
    klog.setLevel(logging.INFO)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        return _decode(torch, dev, dry, handler, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _decode(torch, dev, dry, handler, tmp: Path) -> int:
    from mtp_core.config import CudaGraphConfig, KvCacheConfig, LLMConfig, SpeculativeConfig
    from mtp_core.llm import LLM
    from mtp_core.sampling import SamplingParams
    from mtp_core.scale_model import write_scale_checkpoint
    t = time.perf_counter()
    # narrow experts (8 of 128, top-2, one shared of the same width) keep the MoE under MoE.DENSE_MAX_BYTES,
    # so that the whole step has a static form and can be captured in a CUDA graph
    moe = dict(moe_intermediate_size=8 if dry else 128, num_experts_per_tok=2, n_shared_experts=1,
               intermediate_size=64 if dry else 1024)
    model_dir = write_scale_checkpoint(tmp / "moon", "moonlight", num_layers=2, num_mtp=1,
                                       width_divisor=16 if dry else 1, vocab_size=512 if dry else 4096,
                                       n_routed_experts=8, seed=0, overrides=moe)
    print(f"wrote {model_dir} in {time.perf_counter() - t:.0f} s (kv_lora_rank "
          f"{512 // (16 if dry else 1)}, {'CPU dry run' if dry else 'bf16 on ' + torch.cuda.get_device_name()})")
    prompts = ["the quick brown fox", "1 2 3 4 5 6", "hello world, this is", "a b c d e f g"]
    max_tokens = 8 if dry else 64
    print(f"{'K':>2} {'B':>2} {'eager ms/step':>14} {'graph ms/step':>14} {'speed-up':>9} {'graph==eager':>13}")
    tokens: dict[tuple[int, int, bool], list[list[int]]] = {}
    for K in (0, 3):
        for batch in ((1,) if dry else (1, 4)):
            res = {}
            for use_graph in (False, True):
                spec = (SpeculativeConfig(num_nextn_predict_layers=K, mtp_mode="eagle", draft_len_policy="fixed")
                        if K else None)
                cg = CudaGraphConfig(batch_sizes=[1, 2, 4], enable_padding=True) if use_graph else None
                llm = LLM(LLMConfig(model_dir=str(model_dir), dtype="float32" if dry else "bfloat16",
                                    device=dev.type, max_batch_size=4, speculative_config=spec,
                                    cuda_graph_config=cg,
                                    # a small pool (4 rows of ~80 tokens); freed between engines below
                                    kv_cache_config=KvCacheConfig(dtype="fp8", max_tokens=8192)))
                sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
                llm.generate(prompts[:batch], sp)                      # warm up (and capture)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                s0, t = llm.engine.num_steps, time.perf_counter()
                outs = llm.generate(prompts[:batch], sp)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                steps = llm.engine.num_steps - s0
                res[use_graph] = (1e3 * (time.perf_counter() - t) / max(1, steps), [o.token_ids for o in outs])
                if use_graph:
                    replays = llm.engine.paths.graphs.num_replays if llm.engine.paths.graphs is not None else 0
                    if replays == 0:
                        print(f"   K={K} B={batch}: the static step never ran (graphs off: see the log)")
                tokens[(K, batch, use_graph)] = res[use_graph][1]
                del llm
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            same = res[True][1] == res[False][1]
            print(f"{K:>2} {batch:>2} {res[False][0]:>14.2f} {res[True][0]:>14.2f} "
                  f"{res[False][0] / res[True][0]:>8.2f}x {str(same):>13}")
    ok = all(tokens[k] == tokens[(k[0], k[1], False)] for k in tokens)
    for (K, batch, use_graph), toks in sorted(tokens.items()):
        if K:
            plain = tokens[(0, batch, use_graph)]
            equal = toks == plain
            ok &= equal
            where = "" if equal else f" (first difference in row {_first_diff(toks, plain)})"
            print(f"greedy MTP K={K} == plain, batch {batch}, {'graphs' if use_graph else 'eager'}: {equal}{where}")
    mla = sorted({line for line in handler.lines if "mla_decode" in line})
    print("mla_decode:", "; ".join(mla) if mla else "served by the native kernel on every call")
    if not dry and mla:
        print("decode: the MLA decode fell back to the torch reference (see above)")
        ok = False
    return 0 if ok else 1


def _first_diff(a: list[list[int]], b: list[list[int]]) -> str:
    for r, (x, y) in enumerate(zip(a, b)):
        if x != y:
            i = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
            return f"{r}, token {i}"
    return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name, fn in (("select-tests", cmd_select_tests), ("sanitize", cmd_sanitize), ("bench", cmd_bench),
                     ("decode", cmd_decode)):
        p = sub.add_parser(name)
        p.add_argument("--dry_run", action="store_true", help="CPU, torch references, tiny shapes")
        p.set_defaults(fn=fn)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
