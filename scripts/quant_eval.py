"""Issue 8 evidence: the shipped model in bf16 (as shipped), FP8-block and NVFP4, on the held-out eval
prompts: greedy token agreement with bf16, AL at K=3 (Vanilla), exact-match accuracy, weight memory.

    python scripts/quant_eval.py --model_dir mtp_core/assets/tiny-r1 --per_family 10 --out runs/quant
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from mtp_core import LLM, LLMConfig, SamplingParams, SpeculativeConfig
from mtp_core.bench.eval_sets import eval_records, read_manifest
from mtp_core.bench.scoring import score
from mtp_core.quantize import quantize_checkpoint


def weight_bytes(model: torch.nn.Module) -> int:
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_dir", default="mtp_core/assets/tiny-r1")
    ap.add_argument("--per_family", type=int, default=10)
    ap.add_argument("--max_tokens", type=int, default=768)
    ap.add_argument("--out", default="runs/quant")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    dirs = {"bf16": Path(args.model_dir)}
    for fmt in ("fp8", "nvfp4"):
        dirs[fmt] = out / fmt
        quantize_checkpoint(args.model_dir, dirs[fmt], fmt)
    records = [r for f in read_manifest().families for r in eval_records(f, args.per_family)]
    prompts = [r["prompt"] for r in records]
    params = SamplingParams(max_tokens=args.max_tokens)
    results, ref = {}, None
    for name, d in dirs.items():
        row = {}
        for keep in ((False, True) if name != "bf16" else (False,)):
            cfg = LLMConfig(model_dir=str(d), max_batch_size=16, keep_quantized=keep,
                            speculative_config=SpeculativeConfig(num_nextn_predict_layers=3, mtp_mode="vanilla"))
            llm = LLM(cfg)
            row["weight_MiB_kept_quantized" if keep else "weight_MiB_dequantized"] = weight_bytes(llm.model) / 2**20
            if keep:
                continue
            t0 = time.perf_counter()
            outs = llm.generate([llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts], params)
            row["seconds"] = time.perf_counter() - t0
            row["AL_K3_vanilla"] = llm.engine.stats.acceptance_length
            row["accuracy"] = score(records, [o.text for o in outs])
            toks = [o.token_ids for o in outs]
            if ref is None:
                ref = toks
            same = sum(a == b for a, b in zip(toks, ref))
            agree = sum(sum(x == y for x, y in zip(a, b)) for a, b in zip(toks, ref))
            row["identical_outputs"] = f"{same}/{len(ref)}"
            row["token_agreement_until_end"] = agree / max(sum(len(b) for b in ref), 1)
        results[name] = row
        print(name, json.dumps(row, default=float)[:400], flush=True)
    (out / "quant_eval.json").write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
