#!/usr/bin/env python3
"""Cost of moving one seq's bytes: shared-memory blocks against a ZeroMQ socket, in one process.

For a 32 KB seq (float32 (100, 80)) and a 1.28 MB seq (float32 (4000, 80)) it times, per seq:

  zmq inproc      header + array frame over a PAIR inproc socket, received as np.frombuffer
  zmq ipc         the same over an ipc:// socket (the kernel copies the bytes twice)
  shm pack+view   ppclient.shm.pack into a Segment, Mapping.arrays on the Ref, drop (release)
  shm + ipc hdr   the same, the Ref and specs travelling as a msgpack header over the ipc socket

Sender and receiver are one thread: --batch seqs are sent, then received and dropped, so
the sockets stream as a credit window lets them (--batch 1: ping-pong, which times
ZeroMQ's wake-up latency more than its copying). `us/seq` is wall time, `cpu/seq` the
process's CPU time (ZeroMQ's I/O thread included), both medians of --repeat runs.
Frames below 64 KB are sent copying, larger ones zero-copy, as ppclient.wire does. The
ratios are the `zmq ipc` row of the same run over the row (above 1: cheaper than the socket).

Usage:  python3 bench/shm_copy.py [--repeat N] [--batch N] [--scale F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import msgpack
import numpy as np
import zmq

from ppclient import shm

ZERO_COPY_MIN_BYTES = 64 * 1024
CASES = [("32 KB", (100, 80), 20000), ("1.28 MB", (4000, 80), 2000)]
Pair = Tuple[zmq.Socket, zmq.Socket]


def socket_batch(pair: Pair, arr: np.ndarray, batch: int) -> Callable[[], None]:
    tx, rx = pair
    header = msgpack.packb({"arrays": [["data", arr.dtype.str, list(arr.shape)]]})
    copy = arr.nbytes < ZERO_COPY_MIN_BYTES
    frame: Any = arr  # numpy arrays are buffers, which pyzmq's hints do not say

    def run() -> None:
        for _ in range(batch):
            tx.send_multipart([header, frame], copy=copy)
        for _ in range(batch):
            frames = rx.recv_multipart(copy=False)
            spec = msgpack.unpackb(frames[0].buffer)["arrays"][0]
            out = np.frombuffer(frames[1].buffer, dtype=spec[1]).reshape(spec[2])
            assert out.nbytes == arr.nbytes

    return run


def shm_batch(segment: shm.Segment, arr: np.ndarray, batch: int, pair: Optional[Pair]) -> Callable[[], None]:
    mapping = shm.Mapping.open(segment.descriptor)

    def run() -> None:
        sent = []
        for _ in range(batch):
            packed = shm.pack(segment, [arr])
            assert packed is not None, "segment full"
            block, offsets = packed
            msg = {"ref": block.ref(), "specs": [("data", arr.dtype.str, arr.shape, offsets[0])]}
            if pair is not None:
                pair[0].send(msgpack.packb(msg))
            else:
                sent.append(msg)
        for i in range(batch):
            msg = msgpack.unpackb(pair[1].recv()) if pair is not None else sent[i]
            out = mapping.arrays(msg["ref"], msg["specs"])
            assert out["data"].nbytes == arr.nbytes  # dropped here: the block is released

    return run


def timed(fn: Callable[[], None], seqs: int, batch: int) -> Tuple[float, float]:
    rounds = max(1, seqs // batch)
    for _ in range(max(1, rounds // 10)):
        fn()
    w0, c0 = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        fn()
    n = rounds * batch
    return (time.perf_counter() - w0) / n * 1e6, (time.process_time() - c0) / n * 1e6


def make_pair(ctx: zmq.Context, address: str) -> Pair:
    rx = ctx.socket(zmq.PAIR)
    rx.bind(address)
    tx = ctx.socket(zmq.PAIR)
    tx.connect(address)
    for s in (rx, tx):
        s.linger = 0
        s.rcvtimeo = s.sndtimeo = 10_000  # a stuck socket fails the run instead of hanging it
    return tx, rx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="runs per row; the median is printed (default 5)")
    ap.add_argument("--batch", type=int, default=16, help="seqs sent before they are received (default 16)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the seq counts (default 1)")
    args = ap.parse_args()
    reason = shm.probe()
    if reason is not None:
        print(f"shared memory unavailable here: {reason}", file=sys.stderr)
        return 1
    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="shm-bench-")
    pairs = {"inproc": make_pair(ctx, "inproc://bench"), "ipc": make_pair(ctx, f"ipc://{tmp}/bench")}
    segment = shm.Segment(max(64 << 20, 2 * args.batch * 1_300_000))
    try:
        print(f"python {sys.version.split()[0]}, numpy {np.__version__}, pyzmq {zmq.__version__}, ", end="")
        print(f"{os.cpu_count()} cpus, batch {args.batch}, median of {args.repeat}")
        print(f"{'seq':>8} {'pipeline':<14} {'us/seq':>8} {'vs ipc':>7} {'cpu/seq':>8} {'vs ipc':>7}")
        for name, shape, seqs in CASES:
            arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
            n = max(args.batch, int(seqs * args.scale))
            rows: Dict[str, Callable[[], None]] = {
                "zmq inproc": socket_batch(pairs["inproc"], arr, args.batch),
                "zmq ipc": socket_batch(pairs["ipc"], arr, args.batch),
                "shm pack+view": shm_batch(segment, arr, args.batch, None),
                "shm + ipc hdr": shm_batch(segment, arr, args.batch, pairs["ipc"]),
            }
            runs: Dict[str, List[Tuple[float, float]]] = {row: [] for row in rows}
            for _ in range(args.repeat):  # rows interleaved, so a drift in load hits all alike
                for row, fn in rows.items():
                    runs[row].append(timed(fn, n, args.batch))
            wall = {row: statistics.median(w for w, _ in v) for row, v in runs.items()}
            cpu = {row: statistics.median(c for _, c in v) for row, v in runs.items()}
            for row in rows:
                print(
                    f"{name:>8} {row:<14} {wall[row]:8.1f} {wall['zmq ipc'] / wall[row]:6.2f}x"
                    f" {cpu[row]:8.1f} {cpu['zmq ipc'] / cpu[row]:6.2f}x"
                )
        assert segment.used() == 0, "a block was not released"
    finally:
        segment.close()
        for tx, rx in pairs.values():
            tx.close()
            rx.close()
        ctx.term()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
