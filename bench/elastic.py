"""The pool that sizes itself against hand-tuned fixed pools.

A trainer takes at most R seqs/s (a step of 1/R s per seq, never catching up); the mapper
sleeps C s per seq (a cost that models capacity beyond this host's cores). For each fixed pool
size in --fixed, a server with `--workers N` serves the trainer for --seconds and the delivered
rate after --warmup is measured; then a server with `num_workers = "auto"` (starting from one
worker) serves it for as long. Reported: the best fixed pool (the smallest within 2 % of the
highest rate), the time the auto pool took to reach that size, its delivered rate from then
on, and the most workers it ran. Targets: auto rate >= 0.95x the best fixed, reached within
30 s, at most the best fixed size plus one.

    python3 bench/elastic.py [--rate 50] [--cost 0.05] [--fixed 1,2,3,4,5] [--seconds 45]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ppclient import Client
from ppserver.cli import wait_ready
from ppserver.worker.pool import stop_process

CONFIG = """
import time
import numpy as np
SEQS = [{{"data": np.full((20, 8), i, "float32")}} for i in range({n})]
dataset = {{"class": "NumpyDataset", "seqs": SEQS}}
def map_seq(seq, **kwargs):
    time.sleep({cost})
    return seq
buf_size = 2
progress_interval = 0
{extra}
"""


def serve(config: str, workers: str, log: str) -> Tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "ppserver", "serve", config, "--bind", "tcp://127.0.0.1:0", "--workers", workers]
    with open(log, "a") as f:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=f, text=True)
    return proc, wait_ready(proc, 60)


def trainer(address: str, rate: float, seconds: float, sizes: Optional[List[Tuple[float, int]]] = None) -> List[float]:
    """Take seqs at most at `rate` for `seconds`; the time each one arrived. `sizes`: the pool's
    size over time, polled from the status in a thread."""
    stop = threading.Event()

    def watch() -> None:
        with Client(address, timeout=10) as c:
            while not stop.is_set():
                assert sizes is not None
                sizes.append((time.monotonic(), c.status()["pool"]["current"]))
                stop.wait(0.25)

    poller = threading.Thread(target=watch, daemon=True) if sizes is not None else None
    arrived: List[float] = []
    with Client(address, timeout=30) as c:
        list(c.epoch(0, seq_order=[0]))  # the first worker registered and warm
        if poller is not None:
            poller.start()
        start = step_end = time.monotonic()
        for _ in c.epoch(1):
            now = time.monotonic()
            arrived.append(now - start)
            if now - start >= seconds:
                break
            step_end = max(step_end, now) + 1 / rate
            time.sleep(max(step_end - time.monotonic(), 0))
    stop.set()
    if poller is not None:
        poller.join(timeout=10)
        sizes[:] = [(t - start, n) for t, n in sizes]
    return arrived


def rate_after(arrived: List[float], t0: float) -> float:
    later = [t for t in arrived if t >= t0]
    return (len(later) - 1) / (later[-1] - later[0]) if len(later) > 1 and later[-1] > later[0] else 0.0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=50.0, help="seqs/s the trainer takes at most (default 50)")
    p.add_argument("--cost", type=float, default=0.05, help="seconds the mapper sleeps per seq (default 0.05)")
    p.add_argument("--fixed", default="1,2,3,4,5", help="fixed pool sizes to compare with (default 1,2,3,4,5)")
    p.add_argument("--seconds", type=float, default=45.0, help="seconds each pool serves the trainer (default 45)")
    p.add_argument("--warmup", type=float, default=5.0, help="fixed pools: seconds before the rate counts")
    p.add_argument("--max-workers", type=int, default=8, help="max_workers of the auto pool (default 8)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = p.parse_args()
    sizes_fixed = [int(x) for x in args.fixed.split(",")]
    n = int(args.rate * (args.seconds + 10)) + 100
    out: Dict[str, Any] = {"rate": args.rate, "cost": args.cost, "fixed": {}}
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "server.log")
        fixed_cfg = os.path.join(tmp, "fixed.py")
        with open(fixed_cfg, "w") as f:
            f.write(CONFIG.format(n=n, cost=args.cost, extra=""))
        auto_cfg = os.path.join(tmp, "auto.py")
        with open(auto_cfg, "w") as f:
            f.write(CONFIG.format(n=n, cost=args.cost, extra=f'num_workers = "auto"\nmax_workers = {args.max_workers}'))
        for k in sizes_fixed:
            proc, address = serve(fixed_cfg, str(k), log)
            try:
                arrived = trainer(address, args.rate, args.seconds)
            finally:
                stop_process(proc, timeout=10)
            out["fixed"][k] = round(rate_after(arrived, args.warmup), 2)
            print(f"fixed {k}: {out['fixed'][k]:.1f} seqs/s", file=sys.stderr)
        top = max(out["fixed"].values())
        best = min(k for k, r in out["fixed"].items() if r >= 0.98 * top)
        proc, address = serve(auto_cfg, "auto", log)
        sizes: List[Tuple[float, int]] = []
        try:
            arrived = trainer(address, args.rate, args.seconds, sizes)
        finally:
            stop_process(proc, timeout=10)
        reached = next((t for t, k in sizes if k >= best), None)
        out.update(
            {
                "best_fixed": best,
                "best_fixed_rate": out["fixed"][best],
                "auto_reached_s": None if reached is None else round(reached, 1),
                "auto_rate": round(rate_after(arrived, reached), 2) if reached is not None else 0.0,
                "auto_max_workers": max(k for _, k in sizes),
                "auto_final_workers": sizes[-1][1],
            }
        )
        with open(log) as f:
            out["changes"] = [line.split("INFO ", 1)[1].strip() for line in f if "pool: " in line]
    ratio = out["auto_rate"] / out["best_fixed_rate"] if out["best_fixed_rate"] else 0.0
    checks = {
        "rate >= 0.95x best fixed": ratio >= 0.95,
        "reached within 30 s": out["auto_reached_s"] is not None and out["auto_reached_s"] <= 30,
        "workers <= best fixed + 1": out["auto_max_workers"] <= best + 1,
    }
    print(f"trainer {args.rate:g} seqs/s, mapper {args.cost * 1000:g} ms ({args.rate * args.cost:.2f} workers' worth)")
    print("fixed pools: " + ", ".join(f"{k}: {r:.1f}/s" for k, r in out["fixed"].items()) + f"; best {best}")
    print(
        f"auto: reached {best} workers after {out['auto_reached_s']} s, then {out['auto_rate']:.1f} seqs/s "
        f"({ratio:.3f}x best fixed), at most {out['auto_max_workers']} workers, {out['auto_final_workers']} at the end"
    )
    for line in out["changes"]:
        print(f"  {line}")
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'MISS'} {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
