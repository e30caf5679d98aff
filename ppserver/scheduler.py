"""Scheduler state: which seq is where, what may be sent next, what is delivered in order.

No sockets here. The server loop feeds events in (an input from the feeder, a result or a
heartbeat from a worker, client credit, a worker lost) and sends what the scheduler puts
in its outbox. Keeping the state apart from the I/O makes every transition explicit.

Two modes:
- map_seq: every seq is a task; any worker may run it; results wait in a reorder buffer
  and leave in index order. Input frames stay here until their result arrives, so the
  seqs of a worker that dies are sent again elsewhere.
- map_seq_stream: seq i belongs to partition i mod P; a partition is one stream on one
  worker; its outputs are delivered round-robin across partitions. A partition whose
  worker dies restarts elsewhere from its first input (re-read from the dataset), and
  the outputs already received are skipped.

Memory is bounded by credits: a worker holds at most buf_size tasks (or buf_size
unconsumed inputs and undelivered outputs per partition), and the feeder is read only
while fewer than `window` seqs are between the feeder and the client.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

from ppclient import wire

log = logging.getLogger("ppserver.scheduler")

CLIENT_WINDOW_SLACK = 8
MAX_DISPATCH_BATCH = 16
DISPATCH_BYTES = 512 * 1024

Item = Tuple[Dict[str, Any], List[Any]]  # (item header: i, meta, arrays; its buffer frames)


@dataclass
class WorkerState:
    wid: bytes
    host: str
    pid: int
    capacity: int
    joined: float
    last_seen: float
    inflight: Set[int] = field(default_factory=set)
    partitions: Set[int] = field(default_factory=set)
    done: int = 0
    isolating: bool = False  # running one suspect seq alone, so a crash names the right seq

    def free(self) -> int:
        return self.capacity - len(self.inflight)

    def describe(self, now: float) -> Dict[str, Any]:
        return {
            "id": self.wid.decode("utf8", "replace"),
            "host": self.host,
            "pid": self.pid,
            "seqs_done": self.done,
            "in_flight": len(self.inflight) + len(self.partitions),
            "partitions": sorted(self.partitions),
            "last_heartbeat_s": round(now - self.last_seen, 3),
        }


@dataclass
class Partition:
    index: int
    wid: Optional[bytes] = None
    queue: Deque[Item] = field(default_factory=deque)  # inputs not yet sent
    fed: int = 0  # inputs of this partition received from the feeder
    sent: int = 0  # inputs sent to the current worker
    in_credit: int = 0
    replay_until: int = 0  # inputs j < replay_until must be re-read from the dataset
    eof_sent: bool = False
    outputs: Deque[Tuple[Item, bytes]] = field(default_factory=deque)  # (output, worker that made it)
    received: int = 0  # outputs received (in order) across restarts
    skip: int = 0  # outputs the current worker regenerates that were already received
    done: bool = False
    deaths: int = 0
    received_at_death: int = -1
    last_tag: Optional[str] = None


@dataclass
class Run:
    run: int
    epoch: int
    num_seqs: int
    stream_id: bytes
    stream: bool
    partitions: int = 0
    started: float = field(default_factory=time.monotonic)
    fed: int = 0
    feed_done: bool = False
    finished: bool = False
    ended: Optional[float] = None
    failed: Optional[str] = None
    client_granted: int = 0  # cumulative: a lost grant is repaired by the next one
    client_connected: bool = False  # a grant arrived, so the data socket reaches us
    held: List[Dict[str, Any]] = field(default_factory=list)  # end/error waiting for the data socket
    delivered: int = 0
    delivered_bytes: int = 0
    complete_frac: float = 0.0
    check_tags: bool = False
    # map_seq
    pending: Dict[int, Item] = field(default_factory=dict)
    todo: List[int] = field(default_factory=list)  # heap: redo before new
    inflight: Dict[int, bytes] = field(default_factory=dict)
    results: Dict[int, Item] = field(default_factory=dict)
    deaths: Dict[int, int] = field(default_factory=dict)
    # map_seq_stream
    parts: List[Partition] = field(default_factory=list)
    rr: int = 0

    @property
    def client_credit(self) -> int:
        return self.client_granted - self.delivered


class Scheduler:
    def __init__(self, *, buf_size: int, max_seq_retries: int, reread: Callable[[int], Item]):
        self.buf_size = buf_size
        self.max_seq_retries = max_seq_retries
        self.reread = reread  # pos -> input item, for replaying a stream partition
        self.workers: Dict[bytes, WorkerState] = {}
        self.run: Optional[Run] = None
        self.outbox: List[Tuple[str, bytes, List[Any]]] = []
        self.total_delivered = 0
        self.client_batch: List[Item] = []

    # ---- output helpers -------------------------------------------------------------
    def _to_worker(self, wid: bytes, header: Dict[str, Any], bufs: Tuple = ()) -> None:
        self.outbox.append(("worker", wid, [wire.pack(header), *bufs]))

    def _to_client(self, header: Dict[str, Any]) -> None:
        """End and error messages; held until the client's data socket has shown up."""
        run = self.run
        assert run is not None
        self._flush_client()
        if not run.client_connected:
            run.held.append(header)
            return
        self.outbox.append(("client", run.stream_id, [b"", wire.pack(header)]))

    def _flush_client(self) -> None:
        """Seqs ready for the client leave as one message per pump."""
        if self.client_batch:
            run = self.run
            assert run is not None
            frames = wire.pack_batch({"t": "seq", "run": run.run}, self.client_batch)
            self.outbox.append(("client", run.stream_id, [b"", *frames]))
            self.client_batch = []

    # ---- workers ---------------------------------------------------------------------
    def add_worker(self, wid: bytes, host: str, pid: int, now: float) -> WorkerState:
        w = WorkerState(wid=wid, host=host, pid=pid, capacity=self.buf_size, joined=now, last_seen=now)
        self.workers[wid] = w
        run = self.run
        if run is not None and not run.finished:
            self._to_worker(wid, self._run_header(run))
            if run.stream:
                self._assign_partitions()
        self.pump()
        return w

    def touch(self, wid: bytes, now: float) -> bool:
        w = self.workers.get(wid)
        if w is None:
            return False
        w.last_seen = now
        return True

    def remove_worker(self, wid: bytes, reason: str) -> None:
        """Forget a worker (dead, departed or replaced); its work goes back to the queue."""
        w = self.workers.pop(wid, None)
        if w is None:
            return
        run = self.run
        lost = sorted(w.inflight) if run is not None else []
        log.warning(
            "worker %s (host %s pid %d) %s; %d seqs and %d partitions handed back",
            wid.decode("utf8", "replace"), w.host, w.pid, reason, len(lost), len(w.partitions),
        )
        if run is None or run.finished:
            return
        crashed = reason.startswith("lost") or reason.startswith("died")
        if not run.stream:
            # Every seq lost in a crash becomes suspect; suspects later run alone on a worker,
            # so once a seq has been charged max_seq_retries crashes it really is the culprit.
            for pos in lost:
                if run.inflight.get(pos) != wid:
                    continue
                del run.inflight[pos]
                if crashed:
                    run.deaths[pos] = run.deaths.get(pos, 0) + 1
                    if run.deaths[pos] >= self.max_seq_retries:
                        tag = run.pending[pos][0]["meta"].get("seq_tag", f"#{pos}")
                        self.fail_run(
                            f"seq {tag!r} was in flight on {run.deaths[pos]} workers that died processing it",
                            seq_tag=tag, kind="mapper")
                        return
                heapq.heappush(run.todo, pos)
        else:
            for p in sorted(w.partitions):
                part = run.parts[p]
                if crashed:
                    if part.received > part.received_at_death:
                        part.deaths = 0  # progress since the last crash: that one was not its fault
                    part.deaths += 1
                    part.received_at_death = part.received
                    if part.deaths >= self.max_seq_retries:
                        tag = part.last_tag or f"partition {p}"
                        self.fail_run(
                            f"stream partition {p} (last input {tag!r}) killed {part.deaths} workers",
                            seq_tag=tag, kind="mapper")
                        return
                self._reset_partition(part)
            self._assign_partitions()
        self.pump()

    def _reset_partition(self, part: Partition) -> None:
        part.wid = None
        part.replay_until = part.fed - len(part.queue)
        part.sent = 0
        part.in_credit = 0
        part.eof_sent = False
        part.skip = part.received
        part.done = False

    # ---- runs ------------------------------------------------------------------------
    def start_run(self, *, run: int, epoch: int, num_seqs: int, stream_id: bytes, stream: bool,
                  partitions: int, check_tags: bool) -> None:
        self.run = Run(run=run, epoch=epoch, num_seqs=num_seqs, stream_id=stream_id, stream=stream,
                       partitions=partitions, check_tags=check_tags)
        for w in self.workers.values():
            w.inflight.clear()
            w.partitions.clear()
            w.isolating = False
            self._to_worker(w.wid, self._run_header(self.run))
        if stream:
            self.run.parts = [Partition(index=p) for p in range(partitions)]
            self._assign_partitions()
        if num_seqs == 0:
            self.run.feed_done = True
        self.pump()

    @staticmethod
    def _run_header(run: Run) -> Dict[str, Any]:
        """Tells a worker which run is current: everything of other runs is dropped."""
        return {"t": "cancel", "run": run.run, "epoch": run.epoch, "check_tags": run.check_tags}

    def fail_run(self, message: str, *, seq_tag: Optional[str] = None, kind: str = "mapper",
                 traceback: str = "") -> None:
        run = self.run
        if run is None or run.finished:
            return
        log.error("epoch %d (run %d) failed: %s", run.epoch, run.run, message)
        run.failed = message
        run.finished = True
        run.ended = time.monotonic()
        self._to_client({"t": "error", "run": run.run, "kind": kind, "message": message,
                         "seq_tag": seq_tag, "traceback": traceback})
        self._release_run()

    def _release_run(self) -> None:
        run = self.run
        assert run is not None
        for w in self.workers.values():
            w.isolating = False
            if w.inflight or w.partitions:
                self._to_worker(w.wid, {"t": "cancel", "run": run.run + 1_000_000_000})
            w.inflight.clear()
            w.partitions.clear()
        run.pending.clear()
        run.results.clear()
        run.todo.clear()
        run.inflight.clear()
        for part in run.parts:
            part.queue.clear()
            part.outputs.clear()

    def wants_input(self) -> bool:
        """Whether the loop should pull the next seq from the feeder now."""
        run = self.run
        if run is None or run.finished or run.feed_done:
            return False
        if not run.stream:
            capacity = sum(w.capacity for w in self.workers.values())
            if capacity == 0:
                return False
            free = sum(max(w.free(), 0) for w in self.workers.values())
            window = capacity + CLIENT_WINDOW_SLACK
            return len(run.todo) < free and (run.fed - run.delivered) < window
        # stream: pull only when an assigned partition can take an input and has none queued
        for part in run.parts:
            if part.wid is not None and part.in_credit > 0 and not part.queue and part.replay_until <= part.sent:
                return True
        return False

    def on_inputs(self, run_id: int, items: List[Item]) -> None:
        run = self.run
        if run is None or run.run != run_id or run.finished:
            return
        for item in items:
            pos = item[0]["i"]
            run.fed = max(run.fed, pos + 1)
            if not run.stream:
                run.pending[pos] = item
                heapq.heappush(run.todo, pos)
            else:
                part = run.parts[pos % run.partitions]
                part.fed += 1
                if not part.done:  # a stream that ended early never reads its remaining inputs
                    part.queue.append(item)
        self.pump()

    def on_fed(self, run_id: int, count: int) -> None:
        run = self.run
        if run is None or run.run != run_id or run.finished:
            return
        run.feed_done = True
        run.num_seqs = count
        self.pump()

    def on_results(self, wid: bytes, run_id: Any, items: List[Item]) -> None:
        run = self.run
        w = self.workers.get(wid)
        if run is None or w is None or run_id != run.run or run.finished or run.stream:
            return
        for item in items:
            pos = item[0].get("i")
            if not isinstance(pos, int) or run.inflight.get(pos) != wid:
                continue  # late or duplicate: the seq was handed to another worker
            del run.inflight[pos]
            w.inflight.discard(pos)
            w.done += 1
            run.deaths.pop(pos, None)
            run.pending.pop(pos, None)
            run.results[pos] = item
        if not w.inflight:
            w.isolating = False
        self.pump()

    def on_failure(self, wid: bytes, header: Dict[str, Any]) -> None:
        run = self.run
        if run is None or wid not in self.workers or header.get("run") != run.run:
            return
        self.fail_run(str(header.get("message", "mapper failed")), seq_tag=header.get("seq_tag"),
                      traceback=str(header.get("traceback", "")))

    def on_client_credit(self, stream_id: bytes, run_id: Any, total: Any) -> None:
        """The client has granted `total` seqs so far in this run (cumulative)."""
        run = self.run
        if run is None or run.run != run_id or run.stream_id != stream_id or not isinstance(total, int):
            return
        run.client_granted = max(run.client_granted, min(total, run.delivered + (1 << 20)))
        if not run.client_connected:
            run.client_connected = True
            for header in run.held:
                self.outbox.append(("client", run.stream_id, [b"", wire.pack(header)]))
            run.held.clear()
        self.pump()

    # ---- stream mode ----------------------------------------------------------------
    def _assign_partitions(self) -> None:
        run = self.run
        if run is None or run.finished or not self.workers:
            return
        for part in run.parts:
            if part.wid is not None or part.done:
                continue
            w = min(self.workers.values(), key=lambda w: (len(w.partitions), w.joined))
            part.wid = w.wid
            w.partitions.add(part.index)
            part.in_credit = self.buf_size
            self._to_worker(w.wid, {"t": "sopen", "run": run.run, "epoch": run.epoch, "p": part.index,
                                    "skip": part.skip, "credit": self.buf_size})

    def on_stream_ack(self, wid: bytes, header: Dict[str, Any]) -> None:
        part = self._owned_partition(wid, header)
        if part is None:
            return
        n = header.get("n")
        if isinstance(n, int) and n > 0:
            part.in_credit += n
        self.pump()

    def on_stream_outputs(self, wid: bytes, header: Dict[str, Any], items: List[Item]) -> None:
        part = self._owned_partition(wid, header)
        if part is None:
            return
        for item in items:
            if part.skip > 0:
                part.skip -= 1
                self._to_worker(wid, {"t": "scredit", "run": header["run"], "p": part.index, "n": 1})
                continue
            part.outputs.append((item, wid))
            part.received += 1
            self.workers[wid].done += 1
        self.pump()

    def on_stream_done(self, wid: bytes, header: Dict[str, Any]) -> None:
        part = self._owned_partition(wid, header)
        if part is None:
            return
        part.done = True
        part.wid = None
        self.workers[wid].partitions.discard(part.index)
        self.pump()

    def _owned_partition(self, wid: bytes, header: Dict[str, Any]) -> Optional[Partition]:
        run = self.run
        if run is None or run.finished or not run.stream or header.get("run") != run.run:
            return None
        p = header.get("p")
        if not isinstance(p, int) or not 0 <= p < len(run.parts):
            return None
        part = run.parts[p]
        return part if part.wid == wid and wid in self.workers else None

    def _feed_partitions(self) -> None:
        run = self.run
        assert run is not None
        for part in run.parts:
            if part.wid is None:
                continue
            batch: List[Item] = []
            while part.in_credit > 0:
                if part.sent < part.replay_until:
                    try:
                        item = self.reread(part.index + part.sent * run.partitions)
                    except Exception as exc:
                        log.exception("re-reading an input for stream partition %d failed", part.index)
                        self.fail_run(f"dataset failed while replaying partition {part.index}: "
                                      f"{type(exc).__name__}: {exc}", kind="dataset")
                        return
                elif part.queue:
                    item = part.queue.popleft()
                else:
                    break
                part.last_tag = item[0]["meta"].get("seq_tag")
                batch.append(item)
                part.sent += 1
                part.in_credit -= 1
            if batch:
                self.outbox.append(("worker", part.wid,
                                    wire.pack_batch({"t": "sin", "run": run.run, "p": part.index}, batch)))
            if run.feed_done and not part.eof_sent and part.sent >= part.fed and not part.queue:
                part.eof_sent = True
                self._to_worker(part.wid, {"t": "seof", "run": run.run, "p": part.index})

    def _deliver_stream(self) -> None:
        run = self.run
        assert run is not None
        n = len(run.parts)
        while run.client_credit > 0:
            if all(part.done and not part.outputs for part in run.parts):
                self._finish()
                return
            part = run.parts[run.rr]
            if part.outputs:
                item, producer = part.outputs.popleft()
                self._send_seq(item)
                if part.wid is not None and producer == part.wid:  # credit only for the owner's outputs
                    self._to_worker(part.wid, {"t": "scredit", "run": run.run, "p": part.index, "n": 1})
                run.rr = (run.rr + 1) % n
            elif part.done:
                run.rr = (run.rr + 1) % n
            else:
                return

    # ---- delivery --------------------------------------------------------------------
    def _send_seq(self, item: Item) -> None:
        run = self.run
        assert run is not None
        header, bufs = item
        meta = header.get("meta") or {}
        cf = meta.get("complete_frac")
        if isinstance(cf, (int, float)):
            run.complete_frac = max(run.complete_frac, float(cf))
            meta["complete_frac"] = run.complete_frac
        self.client_batch.append(({"i": run.delivered, "meta": meta, "arrays": header.get("arrays", [])}, bufs))
        run.delivered += 1
        run.delivered_bytes += sum(map(wire.nbytes, bufs))
        self.total_delivered += 1

    def _finish(self) -> None:
        run = self.run
        assert run is not None
        run.finished = True
        run.ended = time.monotonic()
        self._to_client({"t": "end", "run": run.run, "count": run.delivered})
        elapsed = max(time.monotonic() - run.started, 1e-9)
        log.info("epoch %d (run %d) done: %d seqs in %.2f s (%.1f seqs/s)",
                 run.epoch, run.run, run.delivered, elapsed, run.delivered / elapsed)
        self._release_run()

    def pump(self) -> None:
        """Send whatever the current state allows: tasks to workers, results to the client."""
        run = self.run
        if run is None or run.finished:
            return
        if run.stream:
            self._feed_partitions()
            self._deliver_stream()
            self._flush_client()
            return
        # dispatch: lowest positions first, to the worker with the most free credit, in chunks of
        # half a worker's credit (or DISPATCH_BYTES), so consecutive seqs spread over the workers
        # and results come back close to delivery order.
        chunk = max(1, min(self.buf_size // 2, MAX_DISPATCH_BATCH))
        while run.todo:
            if run.todo[0] in run.deaths:  # a suspect goes alone to an idle worker
                w = next((w for w in self.workers.values() if not w.inflight), None)
                if w is None:
                    break
                w.isolating = True
                limit = 1
            else:
                w = max((w for w in self.workers.values() if not w.isolating), key=lambda w: w.free(),
                        default=None)
                if w is None or w.free() <= 0:
                    break
                limit = min(w.free(), chunk)
            batch: List[Item] = []
            nbytes = 0
            while run.todo and len(batch) < limit and nbytes < DISPATCH_BYTES:
                pos = run.todo[0]
                if batch and pos in run.deaths:
                    break
                heapq.heappop(run.todo)
                item = run.pending.get(pos)
                if item is None or pos in run.inflight:
                    continue
                run.inflight[pos] = w.wid
                batch.append(item)
                nbytes += sum(map(wire.nbytes, item[1]))
            if batch:
                w.inflight.update(item[0]["i"] for item in batch)
                self.outbox.append(("worker", w.wid, wire.pack_batch({"t": "in", "run": run.run}, batch)))
        while run.client_credit > 0 and run.delivered in run.results:
            self._send_seq(run.results.pop(run.delivered))
        if run.feed_done and run.delivered >= run.num_seqs:
            self._finish()
        self._flush_client()

    # ---- status ------------------------------------------------------------------------
    def status(self, now: float) -> Dict[str, Any]:
        run = self.run
        st: Dict[str, Any] = {
            "workers_alive": len(self.workers),
            "workers": [w.describe(now) for w in self.workers.values()],
            "seqs_delivered_total": self.total_delivered,
        }
        if run is None:
            st.update({"epoch": None, "state": "idle", "seqs_delivered": 0, "num_seqs": None,
                       "seqs_per_sec": 0.0, "queues": {}})
            return st
        elapsed = max(now - run.started, 1e-9)
        state = "failed" if run.failed else "done" if run.finished else "running"
        st.update({
            "epoch": run.epoch,
            "run": run.run,
            "state": state,
            "num_seqs": run.num_seqs if run.feed_done or not run.stream else None,
            "seqs_delivered": run.delivered,
            "seqs_per_sec": round(run.delivered / elapsed, 2) if state == "running" else
            round(run.delivered / max((run.ended or now) - run.started, 1e-9), 2),
            "mb_delivered": round(run.delivered_bytes / 1e6, 3),
            "error": run.failed,
            "queues": {
                "fed": run.fed,
                "waiting_for_worker": len(run.todo) + sum(len(p.queue) for p in run.parts),
                "in_flight": len(run.inflight) + sum(1 for p in run.parts if p.wid is not None),
                "reorder_buffer": len(run.results) + sum(len(p.outputs) for p in run.parts),
                "client_credit": run.client_credit,
            },
        })
        return st
