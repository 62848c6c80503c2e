"""The accuracy cost of bf16 activations (the AVX512-BF16 dot products / AMX tiles) against the fp32 kernels
(MTP_CORE_CPU_ISA=avx512f), on the shipped model's weights in bf16, FP8-block and NVFP4, in the direct layout
(the one real-width checkpoints use; the shipped model itself runs the fp32 packed layout):

  * exact-match accuracy per task family on the held-out sets (greedy, EOS honoured), each kernel path;
  * the largest |log-probability| difference of the fp32 path's greedy tokens, teacher-forced, between paths.

    python3 scripts/bf16_acts_eval.py [--per_family 20] [--max_tokens 384] [--threads 2] [--json OUT]

Each (format, path) runs in a fresh process (the kernel choice is made per process from the environment).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
MODEL = HERE / "mtp_core" / "assets" / "tiny-r1"


def child(model_dir: str, dtype: str, per_family: int, max_tokens: int, threads: int, teacher: str) -> dict:
    import torch
    torch.set_num_threads(threads)
    from mtp_core.bench.eval_sets import accuracy_records
    from mtp_core.bench.scoring import score
    from mtp_core.config import KvCacheConfig, LLMConfig
    from mtp_core.llm import LLM
    from mtp_core.sampling import SamplingParams

    llm = LLM(LLMConfig(model_dir=model_dir, dtype=dtype, max_batch_size=16, max_seq_len=2048,
                        kv_cache_config=KvCacheConfig(max_tokens=16 * 1024), num_threads=threads))
    nd = getattr(llm.model, "native", None)
    summary = nd.handle.summary() if nd is not None else "torch path"
    records = accuracy_records(per_family)
    prompts = [llm.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records]
    tokens, texts = [], []
    for i in range(0, len(prompts), 16):
        for o in llm.generate(prompts[i:i + 16], SamplingParams(max_tokens=max_tokens)):
            tokens.append(list(o.token_ids))
            texts.append(o.text)
    result = {"summary": summary, "accuracy": score(records, texts), "tokens": tokens, "prompts": prompts}
    if teacher:   # log-probabilities of another run's greedy tokens, teacher-forced
        ref = json.loads(Path(teacher).read_text())
        lps = []
        for p, toks in zip(ref["prompts"], ref["tokens"]):
            o = llm.generate([p + toks], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
            lps.append([e[1] for e in o.prompt_logprobs[len(p):]])
        result["teacher_logprobs"] = lps
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per_family", type=int, default=20)
    ap.add_argument("--max_tokens", type=int, default=384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", nargs=4, metavar=("MODEL", "DTYPE", "OUT", "TEACHER"))
    a = ap.parse_args()
    if a.child:
        model, dtype, out, teacher = a.child
        Path(out).write_text(json.dumps(child(model, dtype, a.per_family, a.max_tokens, a.threads,
                                              teacher if teacher != "-" else "")))
        return
    from mtp_core.quantize import quantize_checkpoint
    work = Path(tempfile.mkdtemp(prefix="bf16acts-"))
    dirs = {"bf16": str(MODEL)}
    for fmt in ("fp8", "nvfp4"):
        quantize_checkpoint(str(MODEL), str(work / fmt), fmt)
        dirs[fmt] = str(work / fmt)
    report = {}

    def run(fmt: str, isa: str, out: Path, teacher: str) -> dict:
        env = dict(os.environ, MTP_CORE_CPU_ISA=isa, MTP_CORE_NATIVE_LAYOUT="direct")
        cmd = [sys.executable, __file__, "--per_family", str(a.per_family), "--max_tokens", str(a.max_tokens),
               "--threads", str(a.threads), "--child", dirs[fmt], "bfloat16" if fmt == "bf16" else "auto",
               str(out), teacher]
        subprocess.run(cmd, env=env, check=True, cwd=HERE)
        return json.loads(out.read_text())

    for fmt in dirs:
        base = work / f"{fmt}-fp32.json"
        r32 = run(fmt, "avx512f", base, "-")
        r16 = run(fmt, "auto", work / f"{fmt}-bf16.json", str(base))
        own = run(fmt, "avx512f", work / f"{fmt}-fp32-own.json", str(base))["teacher_logprobs"]
        diff = max((abs(x - y) for p, q in zip(own, r16["teacher_logprobs"]) for x, y in zip(p, q)), default=0.0)
        same = sum(x == y for x, y in zip(r32["tokens"], r16["tokens"]))
        report[fmt] = {"fp32": r32["accuracy"], "bf16": r16["accuracy"], "kernels_bf16": r16["summary"],
                       "kernels_fp32": r32["summary"], "max_abs_logprob_diff": diff,
                       "identical_outputs": f"{same}/{len(r32['tokens'])}"}
        print(json.dumps({fmt: report[fmt]}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
