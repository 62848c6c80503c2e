"""Issue 30's goal table for `mtp serve`, measured on this machine (run it on a quiet one).

    python3 scripts/serve_bench.py [--model_dir DIR] [--out runs/serve_bench] [--repeats 2]

1. HTTP / offline output tokens/s at concurrency 8 and 32: `mtp bench` offline and `mtp bench --base_url`
   against `mtp serve`, the same dataset (40 requests x 256 tokens, the shipped model's held-out prompts),
   the same engine settings (MTP K=3, max_batch_size = concurrency, no chunked prefill on either side, so
   only the HTTP path differs), alternating offline / HTTP, `--repeats` times.
2. TTFT over HTTP / offline at concurrency 1 (the same runs at concurrency 1).
3. /health latency while a 10 MB prompt arrives (polled every 5 ms from another connection).
4. The longest stall of another stream during a 1 MB prompt (8 streams decoding meanwhile; serve's
   defaults, chunked prefill on).
Prints one table and writes every report under --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
ENGINE = ["--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "3"]     # + --num_threads from the flags


def mtp(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=REPO, env=env, check=True, **kw)


class Server:
    def __init__(self, args: list[str], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", "0", *args], cwd=REPO, env=env,
                                     stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        deadline = time.monotonic() + 300
        while True:
            m = re.search(r"serving \S+ on (http://\S+) ", log.read_text())
            if m:
                self.url = m.group(1)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit(f"mtp serve did not start:\n{log.read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def throughput(args, out: Path) -> list[str]:
    ds = out / "ds.jsonl"
    mtp("prepare-dataset", "--output", str(ds), "--num_requests", "40", "--output_tokens", "256",
        *(["--model_dir", args.model_dir] if args.model_dir else []))
    model = ["--model_dir", args.model_dir] if args.model_dir else []
    rows = []
    for conc in (1, 8, 32):
        batch = ["--max_batch_size", str(max(conc, 1))]
        server = Server([*model, *ENGINE, *batch, "--disable_chunked_prefill"], out / f"serve_c{conc}.log")
        try:
            res = {"offline": [], "http": []}
            for rep in range(args.repeats):
                for side in ("offline", "http"):
                    rj = out / f"{side}_c{conc}_{rep}.json"
                    where = ["--base_url", server.url] if side == "http" else [*model, *ENGINE, *batch]
                    mtp("bench", "--dataset", str(ds), "--concurrency", str(conc), "--warmup", "2",
                        "--report_json", str(rj), *where, stdout=subprocess.DEVNULL)
                    res[side].append(json.loads(rj.read_text())["performance"])
        finally:
            server.stop()
        tps = {s: sum(p["total_output_throughput_tps"] for p in v) / len(v) for s, v in res.items()}
        ttft = {s: sum(p["ttft_ms"] for p in v) / len(v) for s, v in res.items()}
        rows.append(f"| concurrency {conc} | HTTP {tps['http']:.0f} / offline {tps['offline']:.0f} tok/s = "
                    f"{tps['http'] / tps['offline']:.2f}x | TTFT HTTP {ttft['http']:.1f} / offline "
                    f"{ttft['offline']:.1f} ms = {ttft['http'] / ttft['offline']:.2f}x |")
    return rows


def big_prompts(args, out: Path) -> list[str]:
    model = ["--model_dir", args.model_dir] if args.model_dir else []
    server = Server([*model, *ENGINE, "--max_batch_size", "16"], out / "serve_big.log")
    words = "the capital of France is Paris and 347 plus 285 is 632 so".split()
    text = lambda n: " ".join(words[i % len(words)] for i in range(n // 4))[:n]  # noqa: E731
    rows = []
    try:
        # /health while a 10 MB prompt arrives
        body = json.dumps({"model": "x", "prompt": text(10_000_000)}).encode()
        model_id = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        body = body.replace(b'"model": "x"', json.dumps({"model": model_id})[1:-1].encode())
        lat: list[float] = []
        done = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=60) as c:
                while not done.is_set():
                    t = time.perf_counter()
                    c.get(server.url + "/health")
                    lat.append(time.perf_counter() - t)
                    time.sleep(0.005)
        th = threading.Thread(target=poll)
        th.start()
        t = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=300)
        took = time.perf_counter() - t
        done.set()
        th.join()
        rows.append(f"| /health while a 10 MB prompt arrives | max {1e3 * max(lat):.1f} ms over {len(lat)} polls; the "
                    f"prompt answered {r.status_code} in {1e3 * took:.0f} ms |")

        # the longest stall of 8 streams while a 1 MB prompt arrives
        big = json.dumps({"model": model_id, "prompt": text(1_000_000), "max_tokens": 8}).encode()

        async def stream(c: httpx.AsyncClient) -> list[float]:
            ts = []
            async with c.stream("POST", server.url + "/v1/completions", json={
                    "model": model_id, "prompt": "What is 347 + 285?", "max_tokens": 900, "ignore_eos": True,
                    "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        ts.append(time.perf_counter())
            return ts

        async def main():
            async with httpx.AsyncClient(timeout=300) as c:
                tasks = [asyncio.create_task(stream(c)) for _ in range(8)]
                await asyncio.sleep(0.3)          # the streams are decoding (900 tokens last a few s)
                t0 = time.perf_counter()
                await c.post(server.url + "/v1/completions", content=big, headers={"Content-Type": "application/json"})
                return await asyncio.gather(*tasks), t0, time.perf_counter()
        streams, t0, t1 = asyncio.run(main())
        gaps = [b - a for ts in streams for a, b in zip(ts, ts[1:]) if b >= t0 and a <= t1]
        if not gaps:
            raise RuntimeError("the streams ended before the 1 MB prompt arrived; raise their max_tokens")
        all_gaps = sorted(b - a for ts in streams for a, b in zip(ts, ts[1:]))
        rows.append(f"| longest stall of another stream during a 1 MB prompt | {1e3 * max(gaps):.1f} ms (their median "
                    f"inter-token {1e3 * all_gaps[len(all_gaps) // 2]:.1f} ms; the prompt answered in "
                    f"{1e3 * (t1 - t0):.0f} ms) |")
    finally:
        server.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model_dir", default=None)
    ap.add_argument("--out", default=str(REPO / "runs" / "serve_bench"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip_throughput", action="store_true")
    ap.add_argument("--num_threads", type=int, default=None,
                    help="The engine's threads, offline and in serve alike (default: torch's choice).")
    args = ap.parse_args()
    if args.num_threads:
        ENGINE.extend(["--num_threads", str(args.num_threads)])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [] if args.skip_throughput else throughput(args, out)
    rows += big_prompts(args, out)
    print(f"load average before/after: {os.getloadavg()[0]:.2f}")
    print("\n".join(["| metric | measured |", "| --- | --- |", *rows]))


if __name__ == "__main__":
    main()
