"""Peers measured in the same run: Hugging Face transformers `generate` on the same checkpoint.

Greedy, same prompts, exactly the same number of new tokens (min_new_tokens = max_new_tokens), batch 1,
same thread count. Two settings: plain decoding, and prompt-lookup decoding (`prompt_lookup_num_tokens`),
transformers' lossless speculative method that needs no second model. Assisted generation is not run:
it needs a separate small draft model sharing the tokenizer, and none exists for this checkpoint.
transformers is an optional extra (`pip install transformers` or `.[peers]`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

ASSISTED_NOTE = ("assisted generation (a separate small draft model) not run: no draft model with this "
                 "checkpoint's tokenizer exists")


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ValueError("--peers needs Hugging Face transformers, which is not installed; run "
                         "`pip install transformers` (or `pip install -e '.[peers]'`)") from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def load_hf_model(model_dir: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    transformers = require_transformers()
    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                             dtype=dtype).eval()


@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompt: list[int], n: int, pad_id: int, **kw) -> tuple[list[int], float]:
    """-> (new token ids, seconds) for one greedy request of exactly n new tokens."""
    ids = torch.tensor([prompt])                                               # [1, P]
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=pad_id, **kw)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def run_hf_peers(model_dir: str | Path, prompts: list[list[int]], output_tokens: list[int], dtype: torch.dtype,
                 pad_id: int, prompt_lookup_num_tokens: int = 10, warmup: int = 1,
                 reference: Optional[list[list[int]]] = None,
                 on_finish: Optional[Callable[..., None]] = None) -> list[dict]:
    """One row per peer setting: per-user output tokens/s (tokens / request latency, averaged) and how many
    outputs start with `reference[i]` token for token (our nextn=0 greedy output, cut at its first EOS:
    min_new_tokens forbids EOS in transformers, while our ignore_eos emits it and goes on)."""
    model = load_hf_model(model_dir, dtype)
    lookup = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}
    settings = [("hf-generate", {}), (f"hf-prompt-lookup({prompt_lookup_num_tokens})", lookup)]
    rows = []
    for name, kw in settings:
        for i in range(min(warmup, len(prompts))):
            hf_generate(model, prompts[i], output_tokens[i], pad_id, **kw)
        speeds, total_s, same = [], 0.0, 0
        for i, (p, n) in enumerate(zip(prompts, output_tokens)):
            out, secs = hf_generate(model, p, n, pad_id, **kw)
            speeds.append(len(out) / secs)
            total_s += secs
            same += int(reference is not None and out[:len(reference[i])] == reference[i])
            if on_finish:
                on_finish()
        rows.append({"name": name, "per_user_output_throughput_tps": sum(speeds) / len(speeds),
                     "total_s": total_s, "num_requests": len(prompts),
                     "identical_to_ours": same if reference is not None else None})
    return rows
