#!/usr/bin/env python3
"""The scheduler alone: CPU time per seq of `Scheduler.handle`, without sockets or processes.

The server's loop thread spends most of its time in the scheduler; this measures that share
alone, so a change to the scheduler can be compared with the code before it to within a few
per cent, which the end-to-end benchmarks (bench/throughput.py, bench/dispatch.py) cannot tell
from machine noise. A simulated cluster answers every instruction at once: the reader reads
what it is asked, each worker returns its tasks' results as soon as it gets them, the client
grants credit as it takes seqs. Only `handle` is timed (process CPU time), not the simulation.

Cases:
  seqs      map_seq, one seq per task, results through the server (the ppserver default)
  direct    map_seq, results sent straight to the client (`Completed` counts)
  stream    map_seq_stream, one output per input, over --partitions partitions

Usage:  python3 bench/scheduler.py [--seqs 20000] [--workers 4] [--repeat 5] [--cases seqs,direct,stream]
Compare two checkouts back to back:
  PYTHONPATH=OLD:OLD/client python3 bench/scheduler.py; PYTHONPATH=NEW:NEW/client python3 bench/scheduler.py
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from typing import Any, Deque, Dict, List, Tuple

import numpy as np

from ppclient import protocol
from ppserver.scheduler import Read, Scheduler, Settings, ToClient, ToWorker
from ppserver.scheduler import events as ev

CONSUMER = b"client-1"
CASES = ("seqs", "direct", "stream")


def _items(n: int) -> List[protocol.Item]:
    data = np.zeros((100, 80), dtype="float32")
    return [
        protocol.seq_to_item({"data": data, "seq_tag": f"s{p}", "seq_idx": p, "complete_frac": 0.0}, p)
        for p in range(n)
    ]


class Stream:
    """A simulated worker's run of one stream partition: one output per input, sent within its credit."""

    def __init__(self, wid: bytes, partition: int, incarnation: int, credit: int, made: List[protocol.Item]):
        self.wid, self.partition, self.incarnation = wid, partition, incarnation
        self.credit = credit  # outputs it may send
        self.made = made  # its outputs, in stream order
        self.sent = 0
        self.owed = 0  # inputs taken whose outputs are not sent yet
        self.ended = False  # no more inputs come

    def answer(self, now: float, run: int) -> List[Any]:
        """The events its worker sends now: outputs within credit, then its end once all are out."""
        events: List[Any] = []
        n = min(self.credit, self.owed)
        if n:
            items = self.made[self.sent : self.sent + n]
            self.sent += n
            self.owed -= n
            self.credit -= n
            events.append(ev.StreamOutputsReceived(now, self.wid, run, self.partition, self.incarnation, items))
        if self.ended and not self.owed:
            self.ended = False
            events.append(ev.StreamFinished(now, self.wid, run, self.partition, self.incarnation))
        return events


class Cluster:
    """One scheduler and everything around it, answering at once."""

    def __init__(self, case: str, seqs: int, workers: int, partitions: int):
        stream = case == "stream"
        settings = Settings(buf_size=10, stream=stream, partitions=partitions, direct=case == "direct")
        self.sched = Scheduler(settings)
        self.case, self.seqs, self.partitions = case, seqs, partitions
        self.wids = [b"w%d" % k for k in range(workers)]
        self.cpu = 0.0
        self.events = 0
        self.now = 0.0
        self.epoch = 0
        self.pending: Deque[Any] = deque()  # instructions not answered yet
        for k, wid in enumerate(self.wids):
            self.handle(ev.WorkerJoined(self.now, wid, "host", 1000 + k))

    def handle(self, event: Any) -> None:
        t = time.process_time()
        out = self.sched.handle(event)
        self.cpu += time.process_time() - t
        self.events += 1
        self.pending.extend(out)

    def run_epoch(self) -> Tuple[float, int]:
        """Play one epoch; (CPU seconds in handle, events handled)."""
        self.epoch += 1
        self.cpu, self.events = 0.0, 0
        inputs, results = _items(self.seqs), _items(self.seqs)
        self.delivered = 0
        self.run = 0
        self.pending = deque()
        req = ev.EpochRequested(
            self.now, b"req", CONSUMER, self.epoch, direct="ipc://@x" if self.case == "direct" else ""
        )
        self.handle(req)
        accepted = [i.msg for i in self.pending if isinstance(getattr(i, "msg", None), protocol.EpochAccepted)]
        self.run = accepted[-1].run
        self.pending.clear()
        self.handle(ev.RunChecked(self.now, self.run))
        self.handle(ev.CreditGranted(self.now, CONSUMER, self.run, 256))
        self.handle(ev.RunStarted(self.now, self.run, self.epoch, self.seqs))
        streams: Dict[Tuple[bytes, int], Stream] = {}  # (worker, partition) -> what it runs
        end = -1  # the count the epoch's End gives
        guard = 0
        while self.pending:
            guard += 1
            if guard > 50 * self.seqs + 10_000:
                raise RuntimeError("the simulated epoch did not end")
            instr = self.pending.popleft()
            if isinstance(instr, Read):
                self.handle(ev.InputsRead(self.now, self.run, [inputs[p] for p in instr.positions]))
            elif isinstance(instr, ToWorker):
                msg, wid = instr.msg, instr.wid
                if isinstance(msg, protocol.Tasks) and msg.run == self.run:
                    positions = [it.pos for it in instr.items]
                    if self.case == "direct":
                        sizes = [results[p].nbytes for p in positions]
                        self.handle(ev.CompletedReceived(self.now, wid, self.run, positions, sizes))
                        self.delivered += len(positions)  # the client took them from the worker
                        self.handle(
                            ev.CreditGranted(self.now, CONSUMER, self.run, self.delivered + 256, self.delivered)
                        )
                    else:
                        self.handle(ev.ResultsReceived(self.now, wid, self.run, [results[p] for p in positions]))
                elif isinstance(msg, protocol.StreamOpen) and msg.run == self.run:
                    made = _items(-(-self.seqs // self.partitions))  # the merge renumbers what it takes
                    streams[wid, msg.partition] = Stream(wid, msg.partition, msg.incarnation, msg.credit, made)
                elif isinstance(msg, (protocol.StreamInputs, protocol.StreamCredit, protocol.StreamEnd)):
                    stream = streams[wid, msg.partition]
                    if isinstance(msg, protocol.StreamInputs):
                        acked = ev.StreamAcked(
                            self.now, wid, self.run, msg.partition, stream.incarnation, len(instr.items)
                        )
                        self.handle(acked)
                        stream.owed += len(instr.items)
                    elif isinstance(msg, protocol.StreamCredit):
                        stream.credit += msg.n
                    else:
                        stream.ended = True
                    for event in stream.answer(self.now, self.run):
                        self.handle(event)
            elif isinstance(instr, ToClient) and isinstance(instr.msg, protocol.End):
                end = instr.msg.count
            elif isinstance(instr, ToClient) and isinstance(instr.msg, protocol.Seqs):
                self.delivered += len(instr.items)
                self.handle(ev.CreditGranted(self.now, CONSUMER, self.run, self.delivered + 256, self.delivered))
        if end != self.seqs or self.delivered != self.seqs:
            raise RuntimeError(f"{self.case}: {self.delivered} of {self.seqs} seqs delivered, end says {end}")
        return self.cpu, self.events


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seqs", type=int, default=20000, help="seqs per epoch (default 20000)")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    p.add_argument("--partitions", type=int, default=4, help="stream partitions (default 4)")
    p.add_argument("--repeat", type=int, default=5, help="epochs per case; the fastest counts (default 5)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = p.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        p.error(f"--cases: unknown case {bad[0]!r}; choose from {','.join(CASES)}")
    if args.seqs < 1 or args.workers < 1 or args.partitions < 1 or args.repeat < 1:
        p.error("--seqs, --workers, --partitions and --repeat must be at least 1")
    found: Dict[str, Dict[str, float]] = {}
    for case in cases:
        cluster = Cluster(case, args.seqs, args.workers, args.partitions)
        cluster.run_epoch()  # warm-up
        runs = [cluster.run_epoch() for _ in range(args.repeat)]
        cpu, events = min(runs)
        found[case] = {"us_per_seq": cpu / args.seqs * 1e6, "us_per_event": cpu / events * 1e6, "events": events}
    if args.json:
        print(json.dumps(found))
        return 0
    print(f"scheduler alone, {args.seqs} seqs, {args.workers} workers, fastest of {args.repeat} epochs")
    print(f"{'case':8} {'us/seq':>8} {'us/event':>9} {'events':>8}")
    for case, r in found.items():
        print(f"{case:8} {r['us_per_seq']:8.2f} {r['us_per_event']:9.2f} {int(r['events']):8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
