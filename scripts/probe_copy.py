"""Has a training run learned to copy from its context yet? (The phase change every tiny-r1 family waits for.)

Teacher-forced loss of a run's last saved state on held-out traces, split into digit tokens of the question
(random operands: about ln 10 = 2.3 nats whatever the model) and digit tokens of the reasoning (almost all
copied from the question or from earlier lines, or computed from them). Before the model copies, both cost
about the same; after, the reasoning's digits cost a fraction of the question's. Appends one JSON line to
RUN/copy_probe.jsonl.

    python scripts/probe_copy.py RUN_DIR [--per_family 8] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from mtp_core.config import ModelConfig
from mtp_factory.data import FAMILIES
from mtp_factory.data.dataset import sample_example
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_factory.trainer import run_model_config

ap = argparse.ArgumentParser()
ap.add_argument("run_dir")
ap.add_argument("--per_family", type=int, default=8)
ap.add_argument("--threads", type=int, default=1)
args = ap.parse_args()
torch.set_num_threads(args.threads)
run = Path(args.run_dir)
if not (run / "state" / "state.json").is_file():
    raise SystemExit(f"error: {run}/state has no saved training state; give the directory passed to `mtp train --out`")
_, cfg = run_model_config(run)
tok = Tokenizer.from_file(str(run / "tokenizer" / "tokenizer.json"))
model = DeepseekV3ForCausalLM(ModelConfig.from_dict(cfg))
model.load_state_dict(load_file(str(run / "state" / "model.safetensors")))
model.eval()
think = tok.token_to_id("<think>")
rng = random.Random("copy-probe")   # held-out operands: the eval split, never trained on
sums = {"question": [0.0, 0], "reasoning": [0.0, 0]}
per_family = {}
for family in FAMILIES:
    fam = [0.0, 0]
    for _ in range(args.per_family):
        ex = sample_example(family, rng, split="eval")
        enc = tok.encode(ex.prompt + ex.completion, add_special_tokens=False)
        ids = torch.tensor([enc.ids])
        with torch.no_grad():
            logits = model.lm_head(model.forward_dense(ids))[0, :-1].float()
        nll = F.cross_entropy(logits, ids[0, 1:], reduction="none").tolist()
        start = enc.ids.index(think)
        for i, (t, loss) in enumerate(zip(enc.tokens[1:], nll), start=1):
            if t.isdigit():
                part = "question" if i < start else "reasoning"
                sums[part][0] += loss
                sums[part][1] += 1
                if part == "reasoning":
                    fam[0] += loss
                    fam[1] += 1
    per_family[family] = round(fam[0] / max(fam[1], 1), 3)
state = json.loads((run / "state" / "state.json").read_text())
q = sums["question"][0] / max(sums["question"][1], 1)
r = sums["reasoning"][0] / max(sums["reasoning"][1], 1)
res = {"step": state["step"], "question_digit_nll": round(q, 3), "reasoning_digit_nll": round(r, 3),
       "ratio": round(r / q, 3), "reasoning_digit_nll_per_family": per_family}
print(json.dumps(res))
with open(run / "copy_probe.jsonl", "a") as f:
    f.write(json.dumps(res) + "\n")
