#!/usr/bin/env python3
"""The server's dispatch capacity: how many seqs per second one server can deal out.

No-op map_seq (returns its input) on remote workers, so the workers cost as little as
possible and the server's own share shows. Topology (tests/netns.py): the server in its own
network namespace with `ppserver serve --workers 0 --insecure` (no local workers), --hosts
worker-host namespaces each running `ppserver worker --procs N`, and the client (this
process) in the root namespace, linked to the server namespace by a veth pair.

Two seq sizes, float32 arrays in a NumpyDataset npz (as bench/throughput.py builds them):
32 KB (100, 80) and 1.28 MB (4000, 80). Per size and worker count: start the server and the
hosts, wait until every worker is registered, run one warm-up epoch, then time --epochs
epochs (each from the epoch request to the last seq). Over the timed epochs the CPU time of
the server process (and of each of its threads), of the workers and of this client is read
from /proc/PID/stat (utime + stime), and the machine's busy time from /proc/stat.

Reported: seqs/s and MB/s; CPU us per seq of the server (loop thread, ZeroMQ I/O thread,
others), of the workers and of the client; cores each used; which one was the bottleneck;
and the projection: with a 2 ms-per-seq mapper one worker core handles 500 seqs/s, so one
server feeds about (server capacity) / 500 worker cores.

`--max-seqs N` asks for batches of N seqs instead (`batching={"max_seqs": N}`: the server
cuts each epoch, a task is a batch, the workers pad it, one result message per batch); a
comma-separated list runs each, 0 meaning one seq at a time. Target: batches of 16 x 32 KB
at >= 25,000 seqs/s.

Needs root and iproute2 (network namespaces); exits 2 with the reason when they cannot be made.

Usage:  sudo python3 bench/dispatch.py [--quick] [--hosts 2] [--procs 2[,4]] [--seqs 5000,500]
        [--epochs 3] [--max-seqs 0,16] [--json PATH|-]
See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from netns import Lab, NetnsError, wait_for  # noqa: E402

NCPU = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
TICK = os.sysconf("SC_CLK_TCK")
MAPPER_MS = 2.0  # the projection's mapper: CPU per seq of one worker core
SATURATED = 0.9  # a process using this share of a core (or a thread never idle this long) is the bottleneck
MACHINE_SATURATED = 0.85  # the machine with this share of all its cores busy is (many busy processes never reach 1)
OTHER_CPU_WARN = 0.10  # warn when CPU used outside the benchmark exceeds this share of the machine
MIN_CPU_TICKS = 50  # fewer ticks of server CPU than this: the us-per-seq figures are coarse
PORT = 5555  # the server namespace is ours: nothing else listens there
BATCH_TARGET = ("32KB", 16, 25000.0)  # (size, max_seqs, minimum seqs/s): the batched mode's target

CONFIG = """\
dataset = {{"class": "NumpyDataset", "path": {path!r}}}


def map_seq(seq, **kwargs):
    return seq


buf_size = {buf_size}
seed = 0
heartbeat_interval = 1.0
heartbeat_timeout = 10.0
direct_results = {direct}
"""


@dataclass(frozen=True)
class Size:
    key: str
    title: str
    shape: Tuple[int, int]
    seqs_full: int
    seqs_quick: int

    @property
    def seq_bytes(self) -> int:
        return int(np.prod(self.shape)) * 4


SIZES = [
    Size("32KB", "32 KB", (100, 80), 5000, 2500),
    Size("1.28MB", "1.28 MB", (4000, 80), 500, 250),
]


def log(msg: str) -> None:
    print(f"[dispatch {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- CPU accounting -----------------------------------------------------------------------
def _stat(path: str) -> Optional[Tuple[str, List[str]]]:
    """(comm, fields after comm) of a /proc stat file, or None if it is gone."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    head, _, rest = raw.rpartition(")")
    return head.partition("(")[2], rest.split()


def proc_cpu(pid: int) -> float:
    """utime + stime of a process (all its threads, also finished ones), in seconds; 0 if gone."""
    st = _stat(f"/proc/{pid}/stat")
    if st is None:
        return 0.0
    return (int(st[1][11]) + int(st[1][12])) / TICK


THREAD_ROLES = ("loop", "zmq_io", "other")
THREAD_FIELDS = ("utime", "stime", "run", "wait")


def thread_role(pid: int, tid: int, comm: str) -> str:
    if tid == pid:
        return "loop"  # the main thread runs the server's poll loop and the scheduler
    if comm.startswith("ZMQbg/IO"):
        return "zmq_io"  # libzmq's I/O thread: the sockets' reads and writes
    return "other"  # the dataset reader thread (shares the GIL with the loop), pyzmq's gc thread, ZMQbg/Reaper


def thread_stats(pid: int) -> Dict[str, Dict[str, float]]:
    """Per thread role of one process (live threads only), in seconds: utime, stime (from
    /proc/PID/task/TID/stat) and the scheduler's run and run-queue wait times (schedstat)."""
    out = {role: dict.fromkeys(THREAD_FIELDS, 0.0) for role in THREAD_ROLES}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return out
    for tid in tids:
        st = _stat(f"/proc/{pid}/task/{tid}/stat")
        if st is None:
            continue
        acc = out[thread_role(pid, tid, st[0])]
        acc["utime"] += int(st[1][11]) / TICK
        acc["stime"] += int(st[1][12]) / TICK
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, wait_ns = f.read().split()[:2]
            acc["run"] += int(run_ns) / 1e9
            acc["wait"] += int(wait_ns) / 1e9
        except (OSError, ValueError):
            pass
    return out


def kernel_softirq_pids() -> List[int]:
    """The ksoftirqd threads: softirq work (network receive) the kernel defers to them."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(f"/proc/{entry}/stat")
            if st is not None and st[0].startswith("ksoftirqd/"):
                out.append(int(entry))
    return out


def machine_busy() -> float:
    """Busy plus stolen CPU seconds of the whole machine, summed over its cores."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / TICK


class Snapshot:
    def __init__(self, server_pid: int, worker_pids: List[int], softirq_pids: List[int]):
        self.t = time.monotonic()
        self.softirq = sum(proc_cpu(p) for p in softirq_pids)
        self.server = proc_cpu(server_pid)
        self.threads = thread_stats(server_pid)
        self.workers = [proc_cpu(p) for p in worker_pids]
        t = os.times()
        self.client = t.user + t.system
        self.machine = machine_busy()


class Totals:
    """Seconds summed over the timed epochs (wall time and CPU time)."""

    def __init__(self, n_workers: int):
        self.wall = 0.0
        self.server = 0.0
        self.threads = {role: dict.fromkeys(THREAD_FIELDS, 0.0) for role in THREAD_ROLES}
        self.workers = [0.0] * n_workers
        self.client = 0.0
        self.softirq = 0.0
        self.machine = 0.0

    def add(self, a: Snapshot, b: Snapshot) -> None:
        self.wall += b.t - a.t
        self.server += b.server - a.server
        for role, acc in self.threads.items():
            for k in acc:
                acc[k] += b.threads[role][k] - a.threads[role][k]
        self.workers = [s + (y - x) for s, x, y in zip(self.workers, a.workers, b.workers)]
        self.client += b.client - a.client
        self.softirq += b.softirq - a.softirq
        self.machine += b.machine - a.machine


# ---- one measurement ----------------------------------------------------------------------
def check_seq(seq: Dict[str, Any], data: List[np.ndarray]) -> Optional[str]:
    """The no-op mapper hands the dataset's array back: compare it with the npz's."""
    tag = seq.get("seq_tag")
    try:
        want = data[int(str(tag).rpartition("-")[2])]
    except (ValueError, IndexError):
        return f"unexpected seq_tag {tag!r}"
    got = seq.get("data")
    if not isinstance(got, np.ndarray) or got.dtype != want.dtype or not np.array_equal(got, want):
        return f"seq {tag}: data differs from the dataset's"
    return None


def check_batch(batch: Dict[str, Any], data: List[np.ndarray]) -> Optional[str]:
    """Every row of a batch (all seqs of a size: no padding) is its seq's array from the npz."""
    tags = batch.get("seq_tag") or []
    rows = batch.get("data")
    if not isinstance(rows, np.ndarray) or len(rows) != len(tags):
        return f"batch of {len(tags)} tags has no matching data array"
    for tag, row in zip(tags, rows):
        problem = check_seq({"seq_tag": tag, "data": row}, data)
        if problem:
            return problem
    return None


def consume(
    client, epoch: int, expect: int, data: List[np.ndarray], batched: bool = False
) -> Tuple[int, int, float, Optional[str]]:
    """One epoch: (seqs, array bytes, seconds from request to last seq, first mismatch or None).
    `batched`: the epoch comes in batches; seqs are counted by their tags."""
    start = time.monotonic()
    n = nbytes = 0
    first = last = None
    for last in client.epoch(epoch):
        if first is None:
            first = last
        n += len(last["seq_tag"]) if batched else 1
        nbytes += last["data"].nbytes
    elapsed = time.monotonic() - start
    problem = None if n == expect else f"epoch {epoch}: {n} seqs delivered, {expect} expected"
    for seq in (first, last):
        if problem is None and seq is not None:
            problem = check_batch(seq, data) if batched else check_seq(seq, data)
    return n, nbytes, elapsed, problem


def client_for(srv, max_seqs: int):
    """The benchmark's client of the server: one seq at a time, or batches of max_seqs."""
    if not max_seqs:
        return srv.client(timeout=60.0)
    from ppclient import Client

    return Client(srv.address, timeout=60.0, batching={"max_seqs": max_seqs})


def worker_pids_of(hosts, procs: int) -> List[int]:
    def ready():
        pids = [h.children() for h in hosts]
        return pids if all(len(p) == procs for p in pids) else None

    return [p for pids in wait_for(ready, 120.0, f"{procs} worker processes per host") for p in pids]


def run_case(
    lab: Lab,
    cfg: str,
    size: Size,
    path: str,
    seqs: int,
    n_hosts: int,
    procs: int,
    epochs: int,
    data: List[np.ndarray],
    max_seqs: int = 0,
) -> Dict[str, Any]:
    tag = f"{size.key}-{path}-{n_hosts}x{procs}" + (f"-b{max_seqs}" if max_seqs else "")
    srv = lab.start_server(cfg, port=PORT, name=f"server-{tag}")
    hosts: List[Any] = []
    result: Dict[str, Any] = {
        "size": size.key,
        "path": path,
        "seq_bytes": size.seq_bytes,
        "hosts": n_hosts,
        "procs": procs,
        "max_seqs": max_seqs or None,
    }
    try:
        for h in range(1, n_hosts + 1):
            hosts.append(lab.start_workers(h, cfg, port=PORT, procs=procs, name=f"host{h}-{tag}"))
        n_workers = n_hosts * procs
        t0 = time.monotonic()
        pids = worker_pids_of(hosts, procs)
        srv.wait_pids(pids, timeout=120.0)
        result["startup_s"] = round(time.monotonic() - t0, 1)
        totals = Totals(n_workers)
        ksoftirqd = kernel_softirq_pids()
        delivered = nbytes = 0
        epoch_s: List[float] = []
        with client_for(srv, max_seqs) as c:
            n, _, warm, problem = consume(c, 0, seqs, data, bool(max_seqs))
            result["warmup_s"] = round(warm, 3)
            if problem:
                raise RuntimeError(f"warm-up: {problem}")
            for epoch in range(1, epochs + 1):
                before = Snapshot(srv.proc.pid, pids, ksoftirqd)
                n, b, took, problem = consume(c, epoch, seqs, data, bool(max_seqs))
                after = Snapshot(srv.proc.pid, pids, ksoftirqd)
                if problem:
                    raise RuntimeError(problem)
                totals.add(before, after)
                delivered += n
                nbytes += b
                epoch_s.append(took)
            st = c.status()
        alive = {w["pid"] for w in st["workers"]}
        if not set(pids) <= alive:
            raise RuntimeError(f"workers {sorted(set(pids) - alive)} were lost during the run")
        done = [w["seqs_done"] for w in st["workers"] if w["pid"] in set(pids)]
        result.update(summarise(totals, delivered, nbytes, epoch_s))
        result["per_worker_seqs"] = [min(done), max(done)]
        return result
    finally:
        for h in hosts:
            h.terminate()
        for h in hosts:
            lab.stop(h)
        srv.stop()


def summarise(t: Totals, seqs: int, nbytes: int, epoch_s: List[float]) -> Dict[str, Any]:
    seconds = sum(epoch_s)
    rate = seqs / seconds
    wall = max(t.wall, 1e-9)
    th = t.threads
    cpu = {role: th[role]["utime"] + th[role]["stime"] for role in THREAD_ROLES}
    us = {
        "server": t.server / seqs * 1e6,
        **{role: cpu[role] / seqs * 1e6 for role in THREAD_ROLES},
        "workers": sum(t.workers) / seqs * 1e6,
        "client": t.client / seqs * 1e6,
    }
    us["all"] = us["server"] + us["workers"] + us["client"]
    cores = {
        "server": t.server / wall,
        "loop": cpu["loop"] / wall,
        "zmq_io": cpu["zmq_io"] / wall,
        "workers": sum(t.workers) / wall,
        "worker_max": max(t.workers) / wall,
        "client": t.client / wall,
        "ksoftirqd": t.softirq / wall,
        "machine": t.machine / wall,
    }
    ours = cores["server"] + cores["workers"] + cores["client"] + cores["ksoftirqd"]
    cores["other"] = max(cores["machine"] - ours, 0.0)
    # share of the wall time each server thread was on a CPU or waiting in a run queue for one
    demand = {role: (th[role]["run"] + th[role]["wait"]) / wall for role in ("loop", "zmq_io")}
    bottleneck, server_bound = verdict(cores, demand)
    server_capacity = 1e6 / us["server"] if us["server"] > 0 else None
    # the loop and the reader thread share the GIL; ZeroMQ's I/O thread runs beside them
    serial_us = max(us["loop"] + us["other"], us["zmq_io"])
    capacity = server_capacity if server_bound and server_capacity else rate
    return {
        "seqs": seqs,
        "seconds": round(seconds, 3),
        "epoch_seconds": [round(s, 3) for s in epoch_s],
        "seqs_per_s": round(rate, 1),
        "mb_per_s": round(nbytes / seconds / 1e6, 1),
        "cpu_us_per_seq": {k: round(v, 1) for k, v in us.items()},
        "server_sys_share": round(sum(th[r]["stime"] for r in THREAD_ROLES) / max(sum(cpu.values()), 1e-9), 3),
        "server_threads": {
            role: {
                "utime_us_per_seq": round(th[role]["utime"] / seqs * 1e6, 1),
                "stime_us_per_seq": round(th[role]["stime"] / seqs * 1e6, 1),
                "run_cores": round(th[role]["run"] / wall, 3),
                "runqueue_wait_cores": round(th[role]["wait"] / wall, 3),
            }
            for role in THREAD_ROLES
        },
        "cores": {k: round(v, 3) for k, v in cores.items()},
        "server_thread_demand": {k: round(v, 3) for k, v in demand.items()},
        "server_cpu_ticks": round(t.server * TICK),
        "machine_bound_seqs_per_s": round(NCPU * 1e6 / us["all"], 1),
        "bottleneck": bottleneck,
        "server_bound": server_bound,
        "server_cpu_capacity_seqs_per_s": None if server_capacity is None else round(server_capacity, 1),
        "server_threads_capacity_seqs_per_s": round(1e6 / serial_us, 1) if serial_us > 0 else None,
        "capacity_seqs_per_s": round(capacity, 1),
        "capacity_from": "1e6 / server CPU us per seq" if server_bound else "measured rate",
        "worker_cores_fed": round(capacity * MAPPER_MS / 1e3, 1),
    }


def verdict(cores: Dict[str, float], demand: Dict[str, float]) -> Tuple[str, bool]:
    """Which part set the rate: (text, whether it was the server's CPU)."""
    if cores["server"] >= SATURATED or cores["loop"] >= SATURATED:
        return f"server: CPU-bound ({cores['server']:.2f} cores, loop thread {cores['loop']:.2f})", True
    role, busiest = max(demand.items(), key=lambda kv: kv[1])
    if busiest >= SATURATED:
        # never idle: it ran or waited for a core the whole time, so it was the serial stage
        name = "loop" if role == "loop" else "zmq-io"
        return f"server: {name} thread never idle ({busiest:.0%} on CPU or in the run queue)", True
    if cores["client"] >= SATURATED:
        return f"client ({cores['client']:.2f} cores)", False
    if cores["worker_max"] >= SATURATED:
        return f"workers (busiest {cores['worker_max']:.2f} cores)", False
    if cores["machine"] >= MACHINE_SATURATED * NCPU:
        return f"machine: all {NCPU} cores busy (server {cores['server']:.2f})", False
    return f"none saturated (machine {cores['machine']:.2f} of {NCPU} cores)", False


# ---- report -------------------------------------------------------------------------------
LEGEND = [
    "server: the whole server process; loop: its main thread (poll loop, scheduler, message headers);",
    "zmq-io: libzmq's I/O thread (socket reads and writes); other: the dataset reader thread (it shares the",
    "GIL with the loop), pyzmq's garbage-collector thread, ZeroMQ's reaper; sys %: the server's CPU in the kernel.",
    "(max1): the busiest worker process; ksirq: the kernel's ksoftirqd threads (deferred network receive work);",
    "other: CPU used by anything else on the machine; all: the machine's busy cores.",
    "on CPU + run queue: share of the time the thread was running or waiting for a core (schedstat; waiting",
    "for the GIL counts as idle); near 1 the thread is never idle.",
]


def _path(r: Dict[str, Any]) -> str:
    """The data path, and the batch size where the row's epochs came in batches."""
    return r.get("path", "") + (f" b{r['max_seqs']}" if r.get("max_seqs") else "")


def _label(r: Dict[str, Any]) -> str:
    return f"{r['size']} {_path(r)} {r['hosts']}x{r['procs']}"


def batch_targets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The batched mode's target for every row it applies to (BATCH_TARGET's size and batch size)."""
    size, max_seqs, want = BATCH_TARGET
    out = []
    for r in rows:
        if r["size"] != size or r.get("max_seqs") != max_seqs:
            continue
        got = r.get("seqs_per_s")
        out.append(
            {
                "target": f"{_label(r)}: >= {want:.0f} seqs/s",
                "seqs_per_s": got,
                "verdict": "FAILED run" if got is None else ("PASS" if got >= want else "FAIL"),
            }
        )
    return out


def _n(x: float) -> str:
    return f"{x:.1f}" if x < 10 else f"{x:.0f}"


def print_report(rows: List[Dict[str, Any]], header: str) -> None:
    ok = [r for r in rows if "error" not in r]
    print()
    print(header)
    print()
    print(f"{'':55}{'CPU us per seq':<56}")
    print(
        f"{'size':>7} {'path':>14} "
        f"{'workers':>7} {'seqs':>6} {'seqs/s':>7} {'MB/s':>6} | {'server':>6} {'(loop':>6} "
        f"{'zmq-io':>6} {'other)':>6} {'sys %':>5} {'workers':>7} {'client':>6} {'all':>6}"
    )
    for r in rows:
        hw = f"{r['hosts']}x{r['procs']}"
        if "error" in r:
            print(f"{r['size']:>7} {_path(r):>14} {hw:>7} FAILED: {r['error']}")
            continue
        us = r["cpu_us_per_seq"]
        print(
            f"{r['size']:>7} {_path(r):>14} "
            f"{hw:>7} {r['seqs']:>6} {r['seqs_per_s']:>7.0f} {r['mb_per_s']:>6.0f} | "
            f"{us['server']:>6.0f} {us['loop']:>6.0f} {us['zmq_io']:>6.0f} {us['other']:>6.0f} "
            f"{100 * r['server_sys_share']:>5.0f} {us['workers']:>7.0f} {us['client']:>6.0f} {us['all']:>6.0f}"
        )
    print()
    print(f"{'':33}{'cores busy, timed epochs':<50}{'on CPU + run queue':<20}")
    print(
        f"{'size':>7} {'path':>14} "
        f"{'workers':>7} | {'server':>6} {'workers':>7} {'(max1)':>6} {'client':>6} {'ksirq':>5} "
        f"{'other':>5} {'all':>5} | {'loop':>5} {'zmq-io':>6} | bottleneck"
    )
    for r in ok:
        co, de = r["cores"], r["server_thread_demand"]
        print(
            f"{r['size']:>7} {_path(r):>14} "
            f"{str(r['hosts']) + 'x' + str(r['procs']):>7} | {co['server']:>6.2f} "
            f"{co['workers']:>7.2f} {co['worker_max']:>6.2f} {co['client']:>6.2f} {co['ksoftirqd']:>5.2f} "
            f"{co['other']:>5.2f} {co['machine']:>5.2f} | {de['loop']:>5.2f} {de['zmq_io']:>6.2f} | {r['bottleneck']}"
        )
    busy = [r for r in ok if r["cores"]["other"] > OTHER_CPU_WARN * NCPU]
    if busy:
        print(
            f"WARNING: something else used more than {OTHER_CPU_WARN:.0%} of the machine during "
            f"{', '.join(_label(r) for r in busy)} (column other): those rows are not reliable"
        )
    coarse = [r for r in ok if r["server_cpu_ticks"] < MIN_CPU_TICKS]
    if coarse:
        print(
            f"(coarse: the server used fewer than {MIN_CPU_TICKS} CPU ticks of 1/{TICK} s in "
            f"{', '.join(_label(r) for r in coarse)}; use more --seqs or --epochs)"
        )
    for line in LEGEND:
        print(line)
    print()
    per_core = 1e3 / MAPPER_MS
    for line in textwrap.wrap(
        f"projection: a {MAPPER_MS:g} ms-per-seq mapper keeps one worker core at {per_core:.0f} seqs/s, so one "
        f"server feeds about (server capacity) / {per_core:.0f} worker cores. Every seq passes the server's "
        f"single loop thread and ZeroMQ's single I/O thread, so the capacity follows from the server's CPU "
        f"per seq: 1e6 / server us per seq when the server is the bottleneck, else the measured rate (a "
        f"lower bound; 1e6 / server us beside it). Last column: the ceiling if the loop (with the reader, "
        f"which shares its GIL) and the I/O thread each had a core: 1e6 / max(loop + other, zmq-io).",
        width=104,
    ):
        print(line)
    print()
    print(
        f"{'size':>7} {'path':>14} "
        f"{'workers':>7} | {'capacity':>8} {'from':<22} {'worker cores':>12} | "
        f"{'1e6/server us':>13} {'cores':>5} | {'threads own cores':>17} {'cores':>5}"
    )
    for r in ok:
        us = r["cpu_us_per_seq"]["server"]
        cap, alt, thr = (
            r["capacity_seqs_per_s"],
            r["server_cpu_capacity_seqs_per_s"],
            r["server_threads_capacity_seqs_per_s"],
        )
        source = f"1e6 / {us:.0f} us" if r["server_bound"] else "measured (lower bound)"
        print(
            f"{r['size']:>7} {_path(r):>14} "
            f"{str(r['hosts']) + 'x' + str(r['procs']):>7} | {cap:>8.0f} {source:<22} "
            f"{_n(r['worker_cores_fed']):>12} | {alt:>13.0f} {_n(alt / per_core):>5} | {thr:>17.0f} "
            f"{_n(thr / per_core):>5}"
        )
    if ok:
        print()
        for line in textwrap.wrap(
            f"note: server, workers and client all share this machine's {NCPU} cores, so the measured seqs/s "
            f"is bounded by the total CPU per seq ({NCPU} cores / all us per seq: "
            + ", ".join(f"{_label(r)} {r['machine_bound_seqs_per_s']:.0f}" for r in ok)
            + " seqs/s). The server's CPU us per seq is the number that carries over to bigger machines.",
            width=104,
        ):
            print(line)
    targets = batch_targets(rows)
    if targets:
        print()
        print("target (batched mode):")
        for t in targets:
            got = "" if t["seqs_per_s"] is None else f"{t['seqs_per_s']:.0f} seqs/s  "
            print(f"  {t['target']:<44} {got}{t['verdict']}")


def parse_seqs(text: Optional[str], quick: bool) -> List[int]:
    if text is None:
        return [s.seqs_quick if quick else s.seqs_full for s in SIZES]
    vals = [int(x) for x in text.split(",") if x.strip()]
    if len(vals) == 1:
        vals.append(max(vals[0] // 10, 1))
    if len(vals) != len(SIZES) or min(vals) < 1:
        raise ValueError("--seqs: N (32 KB; 1.28 MB gets N/10) or N32,N1280, each >= 1")
    return vals


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="half the seqs, 2 timed epochs (about 15 s)")
    p.add_argument("--hosts", type=int, default=2, help="worker-host namespaces (default %(default)s)")
    p.add_argument("--procs", default="2", help="worker processes per host, comma-separated counts (default 2)")
    p.add_argument("--seqs", default=None, help="seqs per epoch: N32,N1280 or N (1.28 MB gets N/10); default 5000,500")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs per run (default 3, --quick 2)")
    p.add_argument("--sizes", default="32KB,1.28MB", help="seq sizes to run (default %(default)s)")
    p.add_argument("--buf-size", type=int, default=10, help="buf_size of the config (default %(default)s)")
    p.add_argument(
        "--paths",
        default="direct,via-server",
        help="data paths of results: direct (worker to client) and/or via-server (default %(default)s)",
    )
    p.add_argument(
        "--max-seqs",
        default="0",
        help="batches of N seqs (batching={'max_seqs': N}); a comma-separated list runs each, 0 meaning one "
        "seq at a time (default %(default)s; the batched target: --max-seqs 16, 32 KB)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (npz, config, logs)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (- for stdout)")
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.procs.split(",") if x.strip()]
        batch_sizes = [int(x) for x in args.max_seqs.split(",") if x.strip()]
        seqs = dict(zip([s.key for s in SIZES], parse_seqs(args.seqs, args.quick)))
    except ValueError as exc:
        p.error(str(exc))
    if not counts or min(counts) < 1 or args.hosts < 1:
        p.error("--hosts and every --procs count must be >= 1")
    if not batch_sizes or min(batch_sizes) < 0:
        p.error("--max-seqs: counts >= 1, or 0 for one seq at a time")
    sizes = [s for s in SIZES if s.key in args.sizes.split(",")]
    if not sizes:
        p.error(f"--sizes: choose from {','.join(s.key for s in SIZES)}")
    epochs = args.epochs or (2 if args.quick else 3)
    paths = [x for x in args.paths.split(",") if x]
    if not paths or set(paths) - {"direct", "via-server"}:
        p.error("--paths: direct and/or via-server, comma-separated")

    def _term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _term)
    tmp = tempfile.mkdtemp(prefix="ppdispatch-")
    lab = Lab(hosts=args.hosts, log_dir=tmp)
    try:
        lab.create()
    except NetnsError as exc:  # NetnsUnavailable: not root, no iproute2, no permission
        print(f"dispatch: cannot create network namespaces: {exc}", file=sys.stderr)
        shutil.rmtree(tmp, ignore_errors=True)
        return 2
    rows: List[Dict[str, Any]] = []
    failed = False
    load = os.getloadavg()[0]
    try:
        from ppserver.datasets import save_npz

        for size in sizes:
            n = seqs[size.key]
            log(f"{size.title}: writing {n} seqs of {size.shape} float32")
            rng = np.random.RandomState(0)
            data = [rng.randn(*size.shape).astype("float32") for _ in range(n)]
            path = os.path.join(tmp, f"data-{size.key}.npz")
            save_npz(path, [{"data": a} for a in data])
            for data_path in paths:
                cfg = os.path.join(tmp, f"config-{size.key}-{data_path}.py")
                with open(cfg, "w") as f:
                    f.write(CONFIG.format(path=path, buf_size=args.buf_size, direct=data_path == "direct"))
                for batch in batch_sizes:
                    for procs in counts:
                        what = f"batches of {batch}" if batch else "one seq at a time"
                        log(
                            f"{size.title}, {data_path}, {what}: {args.hosts} hosts x {procs} procs, "
                            f"{epochs} timed epochs of {n} seqs"
                        )
                        try:
                            rows.append(run_case(lab, cfg, size, data_path, n, args.hosts, procs, epochs, data, batch))
                        except Exception as exc:
                            failed = True
                            log(f"  failed: {type(exc).__name__}: {exc}")
                            rows.append(
                                {
                                    "size": size.key,
                                    "path": data_path,
                                    "hosts": args.hosts,
                                    "procs": procs,
                                    "max_seqs": batch or None,
                                    "error": f"{type(exc).__name__}: {exc}",
                                }
                            )
            del data
    finally:
        lab.destroy()
        if failed or args.keep:
            print(f"dispatch: npz, configs and server/worker logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    header = (
        f"dispatch: {args.hosts} worker hosts (network namespaces), server `--workers 0`, client in the "
        f"root namespace; no-op map_seq; buf_size {args.buf_size} (tasks: seqs or batches); {epochs} timed "
        f"epochs per row; {NCPU} CPUs, load average {load:.2f} at start"
        + ("; path b<N>: batches of N seqs (batching={'max_seqs': N}), seqs counted" if any(batch_sizes) else "")
    )
    print_report(rows, header)
    if args.json:
        doc = json.dumps(
            {
                "cpus": NCPU,
                "hosts": args.hosts,
                "buf_size": args.buf_size,
                "epochs": epochs,
                "mapper_ms_for_projection": MAPPER_MS,
                "results": rows,
                "targets": batch_targets(rows),
            },
            indent=2,
        )
        if args.json == "-":
            print(doc)
        else:
            with open(args.json, "w") as f:
                f.write(doc + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
