"""Adaptive draft length on the shipped model: costs, calibration, and alternating timed rounds.

    python3 scripts/adaptive_bench.py --out runs/adaptive [--rounds 3] [--num_threads 1]

One process, the model loaded once, every setting on a fresh Engine (as `mtp sweep`). Each round runs
every setting once, in order; settings of one round are compared with each other (the machine is shared
and noisy), and the report gives per-setting medians over rounds plus the median of the per-round ratios.
Speeds are given twice: wall-clock tokens/s/user (what `mtp sweep` reports) and tokens per CPU-second of
this process (less sensitive to other processes on the machine; one torch thread).

Sections: batch 1 on the held-out task prompts and on general text (fixed K = 0..5 Eagle, 1..3 Vanilla,
adaptive rows), waste (verified drafts per accepted draft), the draft-cost fit (step CPU time against the
number of drafts, from the fixed-K rows), the calibration of the MTP head's confidence (running product
of draft probabilities vs acceptance, from an ungated K=5 run), and batch 16 per-user tokens/s with a
draft_len_schedule vs nextn=0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtp_core.bench.dataset import encode_request, task_requests  # noqa: E402
from mtp_core.bench.metrics import summarize_decoding, summarize_performance  # noqa: E402
from mtp_core.bench.runner import run_requests  # noqa: E402
from mtp_core.bench.sweep import Setting, setting_config  # noqa: E402
from mtp_core.config import KvCacheConfig, LLMConfig  # noqa: E402
from mtp_core.engine.engine import Engine  # noqa: E402
from mtp_core.llm import LLM  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "mtp_core" / "assets" / "tiny-r1"


def timed(model, base, eos, think, s: Setting, prompts, outs, concurrency: int, warmup: int = 1) -> dict:
    eng = Engine(model, setting_config(base, s), eos, think)
    if warmup:
        run_requests(eng, prompts[:warmup], outs[:warmup], concurrency)
    steps0 = eng.num_steps
    c0, w0 = time.process_time(), time.perf_counter()
    recs = run_requests(eng, prompts, outs, concurrency)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    _, perf = summarize_performance(recs)
    dec = summarize_decoding(recs, s.K, s.label)
    tokens = sum(r.num_output_tokens for r in recs)
    return {"label": s.label, "K": s.K, "mode": s.mode, "adaptive": s.adaptive,
            "tok_s_user": perf["per_user_output_throughput_tps"], "tok_s_total": tokens / wall,
            "tok_per_cpu_s": tokens / cpu, "cpu_ms_per_step": 1e3 * cpu / max(eng.num_steps - steps0, 1),
            "steps": eng.num_steps - steps0, "AL": dec["acceptance_length"],
            "accept": dec["draft_acceptance_rate"], "per_position": dec["acceptance_per_position"],
            "accepted_per_position": dec["accepted_per_position"], "proposed_per_position": dec["proposed_per_position"],
            "drafts_hist": dec["drafts_per_step_histogram"], "mean_drafts": dec["mean_drafts_per_step"],
            "waste": dec["waste_verified_per_accepted"], "pauses": dec["num_window_pauses"]}


def rounds(model, base, eos, think, settings, prompts, outs, concurrency, n_rounds) -> dict[str, list[dict]]:
    res: dict[str, list[dict]] = {s.label: [] for s in settings}
    for r in range(n_rounds):
        order = settings if r % 2 == 0 else list(reversed(settings))       # alternate the order
        for s in order:
            res[s.label].append(timed(model, base, eos, think, s, prompts, outs, concurrency))
            print(f"  round {r + 1} {s.label}: {res[s.label][-1]['tok_s_user']:.1f} tok/s/user, "
                  f"{res[s.label][-1]['tok_per_cpu_s']:.1f} tok/cpu-s, AL {res[s.label][-1]['AL']:.3f}",
                  file=sys.stderr, flush=True)
    return res


def med(xs):
    return statistics.median(xs)


def table(res: dict[str, list[dict]], ref_labels: list[str]) -> tuple[str, dict]:
    """Median per setting; ratio of each adaptive row to the best fixed row of the same round (by wall and by
    CPU time), median over rounds."""
    n = len(next(iter(res.values())))
    best_wall = [max(res[l][i]["tok_s_user"] for l in ref_labels) for i in range(n)]
    best_cpu = [max(res[l][i]["tok_per_cpu_s"] for l in ref_labels) for i in range(n)]
    base = res["nextn=0"]
    lines = [f"{'setting':<40}{'AL':>7}{'drafts':>8}{'waste':>7}{'tok/s/user':>12}{'tok/cpu-s':>11}"
             f"{'cpu ms/step':>12}{'vs nextn0':>10}{'vs best fixed (wall/cpu)':>26}"]
    summary = {}
    for label, runs in res.items():
        w = med([r["tok_s_user"] for r in runs])
        c = med([r["tok_per_cpu_s"] for r in runs])
        v0 = med([r["tok_s_user"] / b["tok_s_user"] for r, b in zip(runs, base)])
        rw = med([r["tok_s_user"] / b for r, b in zip(runs, best_wall)])
        rc = med([r["tok_per_cpu_s"] / b for r, b in zip(runs, best_cpu)])
        r0 = runs[0]
        waste = f"{r0['waste']:.2f}" if r0["waste"] else "-"
        lines.append(f"{label:<40}{r0['AL']:>7.3f}{r0['mean_drafts']:>8.2f}{waste:>7}{w:>12.1f}{c:>11.1f}"
                     f"{med([r['cpu_ms_per_step'] for r in runs]):>12.2f}{v0:>9.2f}x{rw:>15.2f}x /{rc:.2f}x")
        summary[label] = {"tok_s_user_median": w, "tok_per_cpu_s_median": c, "vs_nextn0_wall": v0,
                          "vs_best_fixed_wall": rw, "vs_best_fixed_cpu": rc, **{k: r0[k] for k in (
                              "AL", "accept", "per_position", "accepted_per_position", "proposed_per_position",
                              "drafts_hist", "mean_drafts", "waste", "pauses", "K", "mode", "adaptive")},
                          "cpu_ms_per_step_median": med([r["cpu_ms_per_step"] for r in runs])}
    best = max(ref_labels, key=lambda l: summary[l]["tok_per_cpu_s_median"])
    lines.append(f"best fixed by CPU time: {best}; by wall: "
                 f"{max(ref_labels, key=lambda l: summary[l]['tok_s_user_median'])}")
    return "\n".join(lines), summary


def calibration(model, base, eos, think, prompts, outs) -> dict:
    """Ungated Eagle K=5 at batch 1 with the drafts' probabilities recorded: acceptance of draft j against
    the running product of the probabilities of drafts 1..j, in bins."""
    from mtp_core.speculative import drafter as dmod

    probs: list[float] = []
    orig = dmod._MTPRunner.draft

    def draft(self, g, with_prob):
        logits = self.path.logits(g).float()
        p, d = torch.softmax(logits, -1).max(-1)
        probs.extend(p.tolist())
        return d.tolist(), (p.tolist() if with_prob else None)
    dmod._MTPRunner.draft = draft
    pairs: list[tuple[float, bool]] = []
    try:
        eng = Engine(model, setting_config(base, Setting("eagle", 5)), eos, think)
        step = eng.step
        pending: list[float] = []

        def recording():
            nonlocal pending
            before = (eng.stats.num_draft_proposed, eng.stats.num_draft_accepted)
            probs.clear()
            done = step()
            k = eng.stats.num_draft_proposed - before[0]
            m = eng.stats.num_draft_accepted - before[1]
            prod = 1.0
            for j, p in enumerate(pending[:k]):
                prod *= p
                pairs.append((prod, j < m))
            pending = list(probs) if not all(s.is_finished for s in done) else []
            return done
        eng.step = recording
        run_requests(eng, prompts, outs, 1)
    finally:
        dmod._MTPRunner.draft = orig
    edges = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001]
    bins = []
    for lo, hi in zip(edges, edges[1:]):
        sel = [a for p, a in pairs if lo <= p < hi]
        mean_p = [p for p, _ in pairs if lo <= p < hi]
        if sel:
            bins.append({"range": [lo, min(hi, 1.0)], "n": len(sel), "mean_product": sum(mean_p) / len(mean_p),
                         "acceptance": sum(sel) / len(sel)})
    return {"num_drafts": len(pairs), "bins": bins}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/adaptive")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num_threads", type=int, default=1)
    ap.add_argument("--num_requests", type=int, default=9)
    ap.add_argument("--output_tokens", type=int, default=128)
    ap.add_argument("--confidences", default="0.2,0.3,0.4,0.5")
    ap.add_argument("--sections", default="task,general,calibration,batch16")
    ap.add_argument("--schedules", default="1:3,4:0;1:3,2:1,4:0")
    ap.add_argument("--batch16_fixed", type=int, default=1, help="0: leave out the fixed K=3 row at batch 16")
    ap.add_argument("--fixed", default="eagle:1,2,3,4,5;vanilla:1,2,3", help="fixed-K settings, MODE:K,K;...")
    ap.add_argument("--adaptive", default="",
                    help="extra adaptive settings, MODE:K:c=C[,win=N@T];... (besides --confidences)")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM(LLMConfig(model_dir=str(SHIPPED), dtype="auto", max_batch_size=16,
                        kv_cache_config=KvCacheConfig(max_tokens=16 * 640)))
    model, tok = llm.model, llm.tokenizer
    eos, think = sorted(llm.engine.stops.eos_token_ids), llm.engine.stops.think_ids
    del llm.engine
    base = LLMConfig(model_dir=str(SHIPPED), dtype="auto", max_batch_size=16,
                     kv_cache_config=KvCacheConfig(max_tokens=16 * 640))
    confs = [float(c) for c in args.confidences.split(",")]
    report: dict = {"args": vars(args), "torch_threads": torch.get_num_threads()}
    sections = args.sections.split(",")
    for name in ("task", "general"):
        if name not in sections:
            continue
        reqs = task_requests("all" if name == "task" else "general", args.num_requests, args.output_tokens)
        prompts = [encode_request(tok, r) for r in reqs][: args.num_requests]
        outs = [r.output_tokens for r in reqs][: args.num_requests]
        fixed = [Setting("none", 0)] + [Setting(m, int(k)) for part in args.fixed.split(";") if part
                                        for m, ks in [part.split(":")] for k in ks.split(",")]
        adaptive = [Setting("eagle", 5, adaptive=True, confidence=c) for c in confs] + \
            [Setting("vanilla", 3, adaptive=True, confidence=c) for c in confs[1:3]]
        for part in filter(None, args.adaptive.split(";")):
            mode, k, opts = part.split(":")
            kw = dict(o.split("=") for o in opts.split(","))
            win, thr = kw.get("win", "0@0").split("@")
            adaptive.append(Setting(mode, int(k), adaptive=True, confidence=float(kw.get("c", 0)), window=int(win),
                                    window_threshold=float(thr)))
        print(f"== batch 1, {name} prompts", file=sys.stderr)
        res = rounds(model, base, eos, think, fixed + adaptive, prompts, outs, 1, args.rounds)
        text, summary = table(res, [s.label for s in fixed[1:]])
        print(f"\n== batch 1, {name} prompts ({len(prompts)} x {args.output_tokens} tokens, {args.rounds} rounds)\n"
              + text, flush=True)
        # the cost of one more draft: least-squares slope of CPU ms per step over K = 1..5 (Eagle, fixed)
        ks = [k for k in range(1, 6) if f"eagle K={k}" in summary]
        ms = [summary[f"eagle K={k}"]["cpu_ms_per_step_median"] for k in ks]
        kbar, mbar = sum(ks) / len(ks), sum(ms) / len(ms)
        slope = sum((k - kbar) * (m - mbar) for k, m in zip(ks, ms)) / sum((k - kbar) ** 2 for k in ks)
        best = max((s.label for s in fixed[1:]), key=lambda l: summary[l]["tok_per_cpu_s_median"])
        t_tok = 1e3 / summary[best]["tok_per_cpu_s_median"]
        costs = {"cpu_ms_per_step_fixed_eagle": dict(zip(ks, ms)), "nextn0_cpu_ms_per_step":
                 summary["nextn=0"]["cpu_ms_per_step_median"], "marginal_draft_ms": slope,
                 "intercept_ms": mbar - slope * kbar, "best_fixed": best, "ms_per_token_best_fixed": t_tok,
                 "break_even_acceptance": slope / t_tok}
        print(f"cost of one more draft (CPU ms, Eagle K=1..5 fit): {slope:.3f}; intercept {costs['intercept_ms']:.3f}; "
              f"ms/token at the best fixed ({best}): {t_tok:.3f}; break-even acceptance = {slope / t_tok:.3f}",
              flush=True)
        report[name] = {"settings": summary, "rounds": res, "costs": costs}
        if "calibration" in sections:
            cal = calibration(model, base, eos, think, prompts, outs)
            report[f"calibration_{name}"] = cal
            print(f"calibration (ungated Eagle K=5, {name} prompts): running product bin -> acceptance", flush=True)
            for b in cal["bins"]:
                print(f"  [{b['range'][0]:.1f}, {b['range'][1]:.1f}): n={b['n']:>4} mean product "
                      f"{b['mean_product']:.3f} acceptance {b['acceptance']:.3f}", flush=True)
    if "batch16" in sections:
        reqs = task_requests("all", 32, args.output_tokens)
        prompts = [encode_request(tok, r) for r in reqs][:32]
        outs = [r.output_tokens for r in reqs][:32]
        from mtp_core.config.schedule import parse_schedule
        sched = [Setting("eagle", 3, adaptive=True, schedule=tuple(parse_schedule(s).items()))
                 for s in args.schedules.split(";")]
        settings = [Setting("none", 0)] + ([Setting("eagle", 3)] if args.batch16_fixed else []) + sched
        print("== batch 16 (32 requests)", file=sys.stderr)
        res = rounds(model, base, eos, think, settings, prompts, outs, 16, args.rounds)
        text, summary = table(res, ["eagle K=3"] if args.batch16_fixed else ["nextn=0"])
        print(f"\n== batch 16 (concurrency 16, 32 requests x {args.output_tokens} tokens, {args.rounds} rounds)\n"
              + text, flush=True)
        report["batch16"] = {"settings": summary, "rounds": res}
    (out / "adaptive_bench.json").write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
