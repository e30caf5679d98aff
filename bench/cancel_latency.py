"""How fast a new epoch request takes over: the latency to the new epoch's first seq.

A 2-worker server maps seqs with a 50 ms mapper (buf_size 8, so 16 old seqs are queued).
For each trial: start an epoch, take 5 seqs, then ask for another epoch and time its first
seq. The spec allows 100 ms plus that seq's own processing time; the old seq a worker is in
the middle of (up to 50 ms here) is the only old work that is not dropped.

    python3 bench/cancel_latency.py [--trials 10] [--delay 0.05]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ppclient import Client
from ppserver.cli import wait_ready
from ppserver.worker.pool import stop_process

CONFIG = """
import time
import numpy as np
SEQS = [{{"data": np.ones((10, 8), "float32")}} for _ in range(300)]
dataset = {{"class": "NumpyDataset", "seqs": SEQS}}
def map_seq(seq, **kwargs):
    time.sleep({delay})
    return seq
buf_size = 8
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--delay", type=float, default=0.05, help="seconds the mapper sleeps per seq")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = os.path.join(tmp, "config.py")
        with open(cfg, "w") as f:
            f.write(CONFIG.format(delay=args.delay))
        proc = subprocess.Popen(
            [sys.executable, "-m", "ppserver", "serve", cfg, "--bind", "tcp://127.0.0.1:0", "--workers", "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            with Client(wait_ready(proc, 60), timeout=30) as c:
                list(c.epoch(0, seq_order=[0, 1, 2, 3]))  # workers registered and warm
                lat = []
                for trial in range(1, args.trials + 1):
                    old = c.epoch(trial)
                    for _ in range(5):
                        next(old)
                    start = time.monotonic()
                    new = c.epoch(1000 + trial, seq_order=[7, 8])
                    next(new)
                    lat.append(time.monotonic() - start)
                    list(new)
        finally:
            stop_process(proc, timeout=10)
    ms = sorted(x * 1000 for x in lat)
    bound = 100 + args.delay * 1000
    print(f"first seq of the new epoch after the request, {args.trials} trials, mapper {args.delay * 1000:g} ms:")
    print("  " + " ".join(f"{x:.0f}" for x in ms) + " ms")
    print(
        f"  median {ms[len(ms) // 2]:.0f} ms, max {ms[-1]:.0f} ms; bound 100 ms + own processing "
        f"({bound:.0f} ms) plus the old seq in progress (<= {args.delay * 1000:g} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
