"""Progress of a training run (possibly still running) from its last saved state: per-fact accuracy of
the single-digit facts (the 100 sums a + b, the 100 sums with a carry a + b + 1, the 64 products 2-9 x 2-9,
each completed greedily after a drill prefix) and exact-match accuracy on a few held-out questions per
family (greedy, no MTP needed). Appends one JSON line to RUN/probe.jsonl.

    python scripts/probe_run.py RUN_DIR [--per_family 6] [--max_tokens 640] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from mtp_core.bench.eval_sets import accuracy_records
from mtp_core.bench.scoring import score
from mtp_core.config import LLMConfig
from mtp_core.llm import LLM
from mtp_core.sampling import SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("run_dir")
ap.add_argument("--per_family", type=int, default=6)
ap.add_argument("--max_tokens", type=int, default=640)
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()
torch.set_num_threads(args.threads)
run = Path(args.run_dir)
state = json.loads((run / "state" / "state.json").read_text())
step = state["step"]
weights = load_file(str(run / "state" / "model.safetensors"))
tmp = Path(tempfile.mkdtemp(prefix="probe-"))
try:
    # a loadable checkpoint directory from the state (the config as the trainer writes it)
    from mtp_factory.trainer import run_model_config
    _, cfg = run_model_config(run)
    cfg["torch_dtype"] = "float32"
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg))
    for f in (run / "tokenizer").iterdir():
        shutil.copy(f, tmp / f.name)
    llm = LLM(LLMConfig(model_dir=str(tmp), dtype="float32", max_batch_size=32, num_threads=args.threads))
    greedy = SamplingParams(max_tokens=3)

    def facts(prompts: list[str], answers: list[int]) -> float:
        outs = llm.generate([llm.tokenizer.encode(p, add_special_tokens=False) for p in prompts], greedy)
        return sum(o.text.strip().startswith(str(a)) and not o.text.strip()[len(str(a)):][:1].isdigit()
                   for o, a in zip(outs, answers)) / len(answers)

    pre = "Digit facts:\n6 + 3 = 9\n"
    t0 = time.perf_counter()
    res = {"step": step, "time": time.strftime("%H:%M:%S", time.gmtime())}
    pairs = [(a, b) for a in range(10) for b in range(10)]
    res["fact_add"] = facts([f"{pre}{a} + {b} = " for a, b in pairs], [a + b for a, b in pairs])
    res["fact_add_carry"] = facts([f"{pre}{a} + {b} + 1 = " for a, b in pairs], [a + b + 1 for a, b in pairs])
    prods = [(a, b) for a in range(2, 10) for b in range(2, 10)]
    res["fact_mul"] = facts([f"{pre}{a} × {b} = " for a, b in prods], [a * b for a, b in prods])
    records = accuracy_records(args.per_family)
    outs = llm.generate([llm.tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records],
                        SamplingParams(max_tokens=args.max_tokens))
    res["accuracy"] = {k: round(v, 3) for k, v in score(records, [o.text for o in outs]).items()}
    res["probe_s"] = round(time.perf_counter() - t0)
    hist = state["history"][-25:]
    res["main_loss_last25"] = round(sum(h["main_loss"] for h in hist) / len(hist), 4)
    print(json.dumps(res))
    with open(run / "probe.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
finally:
    shutil.rmtree(tmp, ignore_errors=True)
