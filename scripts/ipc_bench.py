"""The transports considered between `mtp serve`'s API process and its engine process, measured.

For each: the round trip of a small command (API -> engine -> API: what a submit + first output costs on
top of the step) and the one-way rate of a step's output batch (64 requests, 1-4 tokens each, plus the
engine's statistics snapshot), both between two processes on this machine.

    python3 scripts/ipc_bench.py [--rounds 2000]

zmq+msgspec  ZeroMQ PUSH/PULL over ipc:// sockets, messages encoded with msgspec (MessagePack)
pipe+msgspec multiprocessing.Pipe, send_bytes/recv_bytes of the same msgspec encoding
pipe+pickle  multiprocessing.Pipe, send/recv (pickle of plain objects)
mp.Queue     multiprocessing.Queue (pickle, a feeder thread)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import tempfile
import time

import msgspec


class Out(msgspec.Struct, array_like=True):
    rid: int
    token_ids: list[int]
    finish_reason: str | None = None


class Batch(msgspec.Struct, array_like=True):
    outputs: list[Out]
    stats: list[int]


def make_batch(i: int) -> Batch:
    return Batch([Out(r, [100 + (i + r) % 900] * (1 + (i + r) % 4)) for r in range(64)], list(range(40)))


ENC, DEC = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Batch)


# ---- echo servers (the "engine" side) --------------------------------------------------------------
def zmq_child(a: str, b: str, n_bulk: int) -> None:
    import zmq
    ctx = zmq.Context()
    rx, tx = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    rx.connect(a)
    tx.connect(b)
    while True:
        m = rx.recv()
        if m == b"bulk":
            for i in range(n_bulk):
                tx.send(ENC.encode(make_batch(i)), copy=False)
            continue
        if m == b"quit":
            return
        tx.send(m)


def pipe_child(conn, n_bulk: int, use_pickle: bool) -> None:
    while True:
        m = conn.recv() if use_pickle else conn.recv_bytes()
        if m in (b"bulk", "bulk"):
            for i in range(n_bulk):
                b = make_batch(i)
                if use_pickle:
                    conn.send([(o.rid, o.token_ids, o.finish_reason) for o in b.outputs] + [b.stats])
                else:
                    conn.send_bytes(ENC.encode(b))
            continue
        if m in (b"quit", "quit"):
            return
        conn.send(m) if use_pickle else conn.send_bytes(m)


def queue_child(qin, qout, n_bulk: int) -> None:
    while True:
        m = qin.get()
        if m == "bulk":
            for i in range(n_bulk):
                b = make_batch(i)
                qout.put([(o.rid, o.token_ids, o.finish_reason) for o in b.outputs] + [b.stats])
            continue
        if m == "quit":
            return
        qout.put(m)


def report(name: str, rtt: list[float], bulk_s: float, n_bulk: int) -> None:
    rtt_us = sorted(1e6 * x for x in rtt)
    p99 = rtt_us[int(0.99 * (len(rtt_us) - 1))]
    print(f"{name:13s} round trip median {statistics.median(rtt_us):6.1f} us, p99 {p99:7.1f} us; "
          f"64-request output batches {n_bulk / bulk_s:8.0f}/s ({1e6 * bulk_s / n_bulk:5.1f} us each, decoded)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--bulk", type=int, default=5000)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    small = b"x" * 64

    # zmq + msgspec (pyzmq is not a dependency of mtp: `pip install pyzmq` to include it)
    try:
        import zmq
    except ImportError:
        zmq = None
        print("zmq+msgspec   skipped: pyzmq is not installed")
    if zmq is not None:
        zmq_run(ctx, args, small)
    pipes_and_queue(ctx, args, small)


def zmq_run(ctx, args, small: bytes) -> None:
    import zmq
    d = tempfile.mkdtemp(prefix="mtp-ipc-")
    a, b = f"ipc://{d}/a", f"ipc://{d}/b"
    zc = zmq.Context()
    tx, rx = zc.socket(zmq.PUSH), zc.socket(zmq.PULL)
    tx.bind(a)
    rx.bind(b)
    p = ctx.Process(target=zmq_child, args=(a, b, args.bulk))
    p.start()
    tx.send(b"warm"); rx.recv()
    rtt = []
    for _ in range(args.rounds):
        t = time.perf_counter(); tx.send(small); rx.recv(); rtt.append(time.perf_counter() - t)
    tx.send(b"bulk")
    t = time.perf_counter()
    for _ in range(args.bulk):
        DEC.decode(rx.recv(copy=False).buffer)
    report("zmq+msgspec", rtt, time.perf_counter() - t, args.bulk)
    tx.send(b"quit"); p.join()


def pipes_and_queue(ctx, args, small: bytes) -> None:
    # pipes
    for name, use_pickle in (("pipe+msgspec", False), ("pipe+pickle", True)):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=pipe_child, args=(child, args.bulk, use_pickle))
        p.start()
        send = parent.send if use_pickle else parent.send_bytes
        recv = parent.recv if use_pickle else parent.recv_bytes
        send(b"warm"); recv()
        rtt = []
        for _ in range(args.rounds):
            t = time.perf_counter(); send(small); recv(); rtt.append(time.perf_counter() - t)
        send("bulk" if use_pickle else b"bulk")
        t = time.perf_counter()
        for _ in range(args.bulk):
            m = recv()
            if not use_pickle:
                DEC.decode(m)
        report(name, rtt, time.perf_counter() - t, args.bulk)
        send("quit" if use_pickle else b"quit"); p.join()

    # mp.Queue
    qin, qout = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=queue_child, args=(qin, qout, args.bulk))
    p.start()
    qin.put(small); qout.get()
    rtt = []
    for _ in range(args.rounds):
        t = time.perf_counter(); qin.put(small); qout.get(); rtt.append(time.perf_counter() - t)
    qin.put("bulk")
    t = time.perf_counter()
    for _ in range(args.bulk):
        qout.get()
    report("mp.Queue", rtt, time.perf_counter() - t, args.bulk)
    qin.put("quit"); p.join()
    print(f"(msgspec encode of one batch: {1e6 * min(_t(lambda: ENC.encode(make_batch(1))) for _ in range(5)):.1f} us; "
          f"pickle: {1e6 * min(_t(lambda: pickle.dumps([(o.rid, o.token_ids, o.finish_reason) for o in make_batch(1).outputs])) for _ in range(5)):.1f} us, "
          f"both including building the batch; load {os.getloadavg()[0]:.2f})")


def _t(fn, n: int = 2000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


if __name__ == "__main__":
    main()
