"""How many distinct routed experts the tokens of one verify forward really pick, per MoE layer.

A K=3 verify scores K+1 consecutive tokens; the roofline (mtp_core/bench/roofline.py) models them as routed
independently, n * (1 - (1 - k/n)^W) distinct experts for a window of W tokens. This runs the main model over
real model output (an eval JSON from scripts/eval_model.py --json, or plain texts) and counts the distinct
experts of every W-token window at every MoE layer of the main model.

    python scripts/moe_window_experts.py mtp_core/assets/tiny-r1 runs/eval_strict.json [--windows 1,2,4,6]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mtp_core.bench.roofline import distinct_experts
from mtp_core.loader import load_model
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.model.moe import Gate
from mtp_core.tokenizer import Tokenizer


def window_experts(model, texts_ids: list[list[int]], windows: list[int]) -> dict[int, float]:
    """Mean number of distinct experts per (MoE layer, W-token window) over every window of every text."""
    L = model.config.num_hidden_layers
    picked: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: picked.append(out[1].detach().clone()))
             for name, m in model.named_modules() if isinstance(m, Gate) and int(name.split(".")[2]) < L]
    total = {w: 0 for w in windows}
    count = {w: 0 for w in windows}
    try:
        for ids in texts_ids:
            picked.clear()
            with torch.no_grad():
                model.forward_dense(torch.tensor([ids]))
            for idx in picked:                                            # [T, top_k] per MoE layer
                for w in windows:
                    for s in range(idx.shape[0] - w + 1):
                        total[w] += len(set(idx[s:s + w].flatten().tolist()))
                        count[w] += 1
    finally:
        for h in hooks:
            h.remove()
    return {w: total[w] / count[w] for w in windows if count[w]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("texts", help="eval JSON (its generations' text) or a JSON list of strings")
    ap.add_argument("--windows", default="1,2,4,6")
    ap.add_argument("--max_texts", type=int, default=50)
    ap.add_argument("--max_tokens", type=int, default=256)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    data = json.loads(Path(a.texts).read_text())
    texts = [g["text"] for g in data["generations"]] if isinstance(data, dict) else list(data)
    texts = texts[::max(1, len(texts) // a.max_texts)][:a.max_texts]
    model, _ = load_model(a.model_dir, make_model=DeepseekV3ForCausalLM)
    tok = Tokenizer.from_dir(a.model_dir)
    windows = [int(w) for w in a.windows.split(",")]
    got = window_experts(model, [tok.encode(t)[:a.max_tokens] for t in texts], windows)
    n, k = int(model.config.n_routed_experts), int(model.config.num_experts_per_tok)
    for w, v in got.items():
        print(f"window {w} tokens: {v:.2f} distinct experts per MoE layer "
              f"(independent routing: {distinct_experts(n, k, w):.2f}; {n} experts, top-{k})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
