#!/usr/bin/env python3
"""Several ranks pulling one epoch at once from one 2-worker server, against one rank.

Each rank is its own client process (as DDP ranks are), reading its strided shard; all of
them read epoch e together, and the whole epoch is timed from the first rank's request to
the last rank's last seq (CLOCK_MONOTONIC is shared by the processes). The 1-rank run of the
same data in the same invocation is the baseline. Per run: total seqs/s, and CPU per
delivered seq of the server process, the workers and the clients (from /proc).

Usage:  python3 bench/ranks.py [--ranks 1,4] [--seqs 5000] [--epochs 3] [--frames 100] [--json PATH|-]
See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TICK = os.sysconf("SC_CLK_TCK")

CONFIG = """\
from ppserver.mappers.builtin import double

dataset = {{"class": "NumpyDataset", "path": {path!r}}}
map_seq = double
buf_size = 10
num_workers = 2
"""

# One rank: its shard of each epoch, timed, as JSON on stdout.
RANK = """
import json, sys, time
import ppclient
address, rank, world, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with ppclient.Client(address, rank=rank, world_size=world, job="bench-%d" % world, timeout=60) as c:
    out = []
    for epoch in range(1, epochs + 2):
        t0, c0 = time.monotonic(), time.process_time()
        n = sum(1 for _ in c.epoch(epoch))
        out.append({"epoch": epoch, "start": t0, "end": time.monotonic(), "seqs": n, "cpu": time.process_time() - c0})
print(json.dumps({"epochs": out}))
"""


def cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> List[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def run(world: int, config: str, epochs: int) -> Dict[str, Any]:
    sys.path.insert(0, REPO)
    from ppserver.cli import wait_ready
    from ppserver.worker.pool import stop_process

    server = subprocess.Popen(
        [sys.executable, "-m", "ppserver", "serve", config, "--bind", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    try:
        address = wait_ready(server, 60)
        import ppclient

        with ppclient.Client(address) as c:
            while c.status()["workers_alive"] < 2:
                time.sleep(0.05)
        workers = children(server.pid)
        cpu0 = cpu_of(server.pid), sum(cpu_of(w) for w in workers)
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, address, str(r), str(world), str(epochs)],
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            for r in range(world)
        ]
        reports = [json.loads(p.communicate(timeout=600)[0]) for p in ranks]
        cpu1 = cpu_of(server.pid), sum(cpu_of(w) for w in workers)
    finally:
        stop_process(server, timeout=10)
    timed = range(1, epochs + 1)  # epoch 1 (index 0) is the warm-up
    seqs = sum(r["epochs"][i]["seqs"] for r in reports for i in timed)
    took = sum(
        max(r["epochs"][i]["end"] for r in reports) - min(r["epochs"][i]["start"] for r in reports) for i in timed
    )
    # the CPU counters cover the warm-up epoch too: charge per seq over all epochs
    all_seqs = sum(e["seqs"] for r in reports for e in r["epochs"])
    return {
        "ranks": world,
        "seqs": seqs,
        "seconds": took,
        "seqs_per_sec": seqs / took,
        "server_us_per_seq": (cpu1[0] - cpu0[0]) / all_seqs * 1e6,
        "workers_us_per_seq": (cpu1[1] - cpu0[1]) / all_seqs * 1e6,
        "clients_us_per_seq": sum(r["epochs"][i]["cpu"] for r in reports for i in timed) / seqs * 1e6,
    }


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,4", help="rank counts to run, the first is the baseline (default 1,4)")
    ap.add_argument("--seqs", type=int, default=5000)
    ap.add_argument("--frames", type=int, default=100, help="frames per seq of 80 float32 (100: 32 KB)")
    ap.add_argument("--epochs", type=int, default=3, help="timed epochs after one warm-up")
    ap.add_argument("--json", default=None, help="also write the results as JSON (- for stdout)")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",")]
    sys.path.insert(0, REPO)
    from ppserver.datasets import save_npz

    tmp = tempfile.mkdtemp(prefix="ppranks-")
    rng = np.random.RandomState(0)
    path = os.path.join(tmp, "data.npz")
    save_npz(path, [{"data": rng.randn(args.frames, 80).astype("float32")} for _ in range(args.seqs)])
    config = os.path.join(tmp, "config.py")
    with open(config, "w") as f:
        f.write(CONFIG.format(path=path))
    rows = []
    for world in counts:
        print(f"[ranks] {world} rank(s) ...", file=sys.stderr, flush=True)
        rows.append(run(world, config, args.epochs))
    base = rows[0]["seqs_per_sec"]
    kb = args.frames * 80 * 4 / 1000
    print(f"{args.seqs} seqs of {kb:.0f} KB, 2 workers, buf_size 10, {args.epochs} timed epochs, {os.cpu_count()} CPUs")
    print(f"{'ranks':>5} {'seqs/s':>8} {'vs ' + str(counts[0]):>7} {'server us/seq':>14} {'workers':>8} {'clients':>8}")
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['seqs_per_sec']:>8.0f} {r['seqs_per_sec'] / base:>6.2f}x "
            f"{r['server_us_per_seq']:>14.1f} {r['workers_us_per_seq']:>8.1f} {r['clients_us_per_seq']:>8.1f}"
        )
    if args.json:
        text = json.dumps(rows, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
