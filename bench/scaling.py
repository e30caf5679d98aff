#!/usr/bin/env python3
"""How the scheduler scales with the number of remote worker processes.

A map_seq that sleeps 5 ms and uses no CPU, on small seqs ((10, 8) float32), so the ideal
rate is procs / 5 ms and anything below it is the service's overhead (server loop, transport,
client). Topology (tests/netns.py): the server in its own network namespace with
`--workers 0 --insecure`, two worker-host namespaces each running `ppserver worker --procs
N/2`, the client in the root namespace.

For each process count: start the server and both worker hosts, run a warm-up epoch, wait
until all processes are registered, then time one epoch of about --seconds at the ideal
rate (from the epoch request to the last seq). Also measured in the same run: the same
mapper applied in one process in a plain loop.

Reported per count: seqs/s, the ideal, % of ideal, and where CPU went during the timed epoch
(server process, all workers, this client process, anything else on the machine), in
cores. No target: on a small machine the workers' own CPU, not the scheduler, sets the rate
at high counts; the server's capacity is measured by bench/dispatch.py.

Needs root and iproute2 (network namespaces).

Usage:  sudo python3 bench/scaling.py [--procs 8,16,32] [--seconds 4] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))

from netns import Lab, NetnsUnavailable, children_of  # noqa: E402

DELAY = 0.005
NCPU = os.cpu_count() or 1
TICK = os.sysconf("SC_CLK_TCK")

CONFIG = """\
import time
import numpy as np

_N = {n}
_R = np.random.RandomState(0)
SEQS = [{{"data": _R.randn(10, 8).astype("float32")}} for _ in range(_N)]
dataset = {{"class": "NumpyDataset", "seqs": SEQS}}


def map_seq(seq, **kwargs):
    time.sleep({delay})
    return seq


buf_size = {buf_size}
heartbeat_interval = 1.0
heartbeat_timeout = 10.0
"""


# ---- CPU accounting -----------------------------------------------------------------------
def proc_cpu(pid: int) -> float:
    """utime + stime of one process, in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine since boot (all cores; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    total = sum(vals[:8])  # user nice system idle iowait irq softirq steal
    return (total - vals[3] - vals[4]) / TICK


class CpuSnapshot:
    def __init__(self, server_pid: int, worker_pids: List[int]):
        self.t = time.monotonic()
        self.server = proc_cpu(server_pid)
        self.workers = sum(proc_cpu(p) for p in worker_pids)
        times = os.times()
        self.client = times.user + times.system
        self.machine = machine_busy()


# ---- one measurement ----------------------------------------------------------------------
def run_count(lab: Lab, cfg: str, procs: int, seqs: int, warmup_seqs: int, port: int) -> Dict[str, Any]:
    srv = lab.start_server(cfg, port=port, name=f"server-{procs}")
    hosts = [lab.start_workers(h, cfg, port=port, procs=procs // 2, name=f"host{h}-{procs}") for h in (1, 2)]
    try:
        t0 = time.monotonic()
        srv.wait_count(procs, timeout=300.0)
        startup = time.monotonic() - t0
        with srv.client(timeout=60.0) as c:
            n = sum(1 for _ in c.epoch(0, seq_order=list(range(warmup_seqs))))
            assert n == warmup_seqs, (n, warmup_seqs)
            st = srv.wait_count(procs, timeout=120.0)
            assert st["workers_alive"] == procs, st["workers_alive"]
            worker_pids = [p for h in hosts for p in children_of(h.pid)]
            before = CpuSnapshot(srv.proc.pid, worker_pids)
            start = time.monotonic()
            it = c.epoch(1, seq_order=list(range(seqs)))
            n = 0
            for _ in it:
                n += 1
            elapsed = time.monotonic() - start
            after = CpuSnapshot(srv.proc.pid, worker_pids)
            st = c.status()
        assert n == seqs, (n, seqs)
        done = [w["seqs_done"] for w in st["workers"]]
        wall = after.t - before.t
        cores = {
            "server": (after.server - before.server) / wall,
            "workers": (after.workers - before.workers) / wall,
            "client": (after.client - before.client) / wall,
        }
        cores["other"] = max((after.machine - before.machine) / wall - sum(cores.values()), 0.0)
        rate = seqs / elapsed
        ours = cores["server"] + cores["workers"] + cores["client"]
        ideal = procs / DELAY
        return {
            "procs": procs,
            "seqs": seqs,
            "seconds": round(elapsed, 3),
            "seqs_per_s": round(rate, 1),
            "ideal_seqs_per_s": round(ideal, 1),
            "pct_of_ideal": round(100 * rate / ideal, 1),
            "startup_s": round(startup, 1),
            "workers_alive": st["workers_alive"],
            "per_worker_seqs_min": min(done) if done else 0,
            "per_worker_seqs_max": max(done) if done else 0,
            "cores": {k: round(v, 2) for k, v in cores.items()},
            # CPU time per delivered seq (ms) and the rate this machine's cores allow at that cost
            "cpu_ms_per_seq": {
                "server": round(cores["server"] / rate * 1e3, 3),
                "workers": round(cores["workers"] / rate * 1e3, 3),
                "all": round(ours / rate * 1e3, 3),
            },
            "cpu_bound_seqs_per_s": round(NCPU / (ours / rate), 1),
        }
    finally:
        for h in hosts:
            h.terminate()
        for h in hosts:
            lab.stop(h)
        srv.stop()


def in_process_baseline(cfg_path: str, seconds: float) -> Dict[str, Any]:
    """The same map_seq, applied in this process in a loop (what one worker can do alone)."""
    from ppserver.config.mappers import output_templates
    from ppserver.config.settings import load_config
    from ppserver.datasets import make_dataset
    from ppserver.mappers.apply import apply_map_seq

    cfg = load_config(cfg_path)
    ds = make_dataset(cfg.dataset, order_seed=cfg.seed)
    templates = output_templates(cfg, ds.data_keys())
    ds.init_seq_order(1)
    n, start, cpu = 0, time.monotonic(), time.process_time()
    while time.monotonic() - start < seconds:
        apply_map_seq(cfg.map_seq, ds.get_seq(n % ds.num_seqs), epoch=1, seed=cfg.seed, templates=templates)
        n += 1
    elapsed = time.monotonic() - start
    cpu = time.process_time() - cpu
    return {
        "seqs": n,
        "seconds": round(elapsed, 3),
        "seqs_per_s": round(n / elapsed, 1),
        "ideal_seqs_per_s": round(1 / DELAY, 1),
        "pct_of_ideal": round(100 * n / elapsed * DELAY, 1),
        "cpu_ms_per_seq": round(cpu / n * 1e3, 3),
    }


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", default="8,16,32", help="comma-separated worker process counts (even numbers)")
    p.add_argument("--seconds", type=float, default=4.0, help="length of each timed epoch at the ideal rate")
    p.add_argument("--buf-size", type=int, default=4, help="buf_size of the config (tasks per worker)")
    p.add_argument("--port", type=int, default=5555, help="control port inside the server namespace")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (config, logs)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (- for stdout)")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.procs.split(",") if x.strip()]
    if any(c < 2 or c % 2 for c in counts):
        p.error("--procs: every count must be an even number >= 2 (split over two hosts)")

    def _term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    seqs_for = {c: round(c / DELAY * args.seconds) for c in counts}
    results: List[Dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="ppscaling-")
    completed = False
    try:
        cfg = os.path.join(tmp, "config.py")
        with open(cfg, "w") as f:
            f.write(CONFIG.format(n=max(seqs_for.values()), delay=DELAY, buf_size=args.buf_size))
        print(
            f"machine: {NCPU} CPUs, load average {os.getloadavg()[0]:.2f} at start; map_seq sleeps "
            f"{DELAY * 1000:g} ms on (10, 8) float32 seqs; buf_size {args.buf_size}",
            flush=True,
        )
        baseline = in_process_baseline(cfg, seconds=2.0)
        lab = Lab(hosts=2, log_dir=tmp)
        try:
            lab.create()
        except NetnsUnavailable as exc:
            print(f"scaling: cannot create network namespaces: {exc}", file=sys.stderr)
            return 2
        try:
            for c in counts:
                print(f"... {c} worker processes ({c // 2} per host), {seqs_for[c]} seqs", file=sys.stderr, flush=True)
                results.append(
                    run_count(lab, cfg, c, seqs_for[c], warmup_seqs=min(20 * c, seqs_for[c]), port=args.port)
                )
        finally:
            lab.destroy()
        completed = True
    finally:
        if completed and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"scaling: server and worker logs kept in {tmp}", file=sys.stderr)

    print()
    print(f"{'':43}{'cores busy, timed epoch':<31}{'CPU ms per seq':<23}")
    print(
        f"{'procs':>5} {'seqs':>6} {'time s':>6} {'seqs/s':>6} {'ideal':>6} {'%ideal':>6} | "
        f"{'server':>6} {'workers':>7} {'client':>6} {'other':>6} | {'server':>6} {'workers':>7} "
        f"{'all':>5} | {'CPU-bound seqs/s':>16}"
    )
    for r in results:
        cores, ms = r["cores"], r["cpu_ms_per_seq"]
        print(
            f"{r['procs']:>5} {r['seqs']:>6} {r['seconds']:>6.2f} {r['seqs_per_s']:>6.0f} "
            f"{r['ideal_seqs_per_s']:>6.0f} {r['pct_of_ideal']:>5.1f}% | {cores['server']:>6.2f} "
            f"{cores['workers']:>7.2f} {cores['client']:>6.2f} {cores['other']:>6.2f} | {ms['server']:>6.3f} "
            f"{ms['workers']:>7.3f} {ms['all']:>5.3f} | {r['cpu_bound_seqs_per_s']:>16.0f}"
        )
    print(
        f"baseline: the same map_seq in one process in a loop: {baseline['seqs_per_s']:.0f} seqs/s "
        f"({baseline['pct_of_ideal']:.1f}% of {baseline['ideal_seqs_per_s']:.0f}), "
        f"{baseline['cpu_ms_per_seq']:.3f} ms CPU per seq"
    )
    print(
        f"(CPU-bound seqs/s = {NCPU} cores / CPU ms per seq of server + workers + client: the most "
        f"this machine allows at the measured per-seq cost)"
    )
    if args.json:
        doc = json.dumps(
            {
                "delay_s": DELAY,
                "cpus": NCPU,
                "buf_size": args.buf_size,
                "results": results,
                "baseline": baseline,
            },
            indent=2,
        )
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w") as f:
                f.write(doc + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
