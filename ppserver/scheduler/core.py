"""The scheduler: events in (with the time passed in), instructions out. No sockets, no dataset,
no clock: the server performs what it returns, and tests drive it alone.

It owns the workers (registration, liveness, departures), the runs (an epoch requested by a
client: preparing, then started, then done, failed or superseded) and delivery: outputs
leave in epoch order, at most as many as the client has granted, and the reader reads only
as far as the workers' credit and the client's window allow. What a task is and in what
order outputs come is the business of the run's dispatch: `SeqDispatch` for map_seq,
`StreamDispatch` for map_seq_stream.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Union

from ppclient.protocol import (
    End,
    FailureKind,
    Heartbeat,
    Item,
    Keepalive,
    Message,
    RunClose,
    RunFailed,
    RunOpen,
    Seqs,
    Started,
    Superseded,
    Unknown,
)

from . import events as ev
from .instructions import Instruction, ReadUpTo, StopReading, ToClient, ToWorker
from .seqs import SeqDispatch
from .settings import Failure, Settings
from .streams import StreamDispatch
from .workers import Departure, WorkerState

log = logging.getLogger("ppserver.scheduler")

Dispatch = Union[SeqDispatch, StreamDispatch]
MAX_GRANT_AHEAD = 1 << 20  # a client cannot make the server hold more than this many seqs
UNHEARD_MAX = 64  # ended runs kept for a client that has not connected yet
UNHEARD_S = 60.0


@dataclass
class Run:
    """One epoch for one consumer (the client's data socket)."""

    run: int
    epoch: int
    consumer: bytes
    requested: float
    num_seqs: Optional[int] = None  # inputs, once the reader has set the epoch up
    check_tags: bool = False
    dispatch: Optional[Dispatch] = None  # None while the reader prepares the epoch
    started: Optional[float] = None
    ended: Optional[float] = None
    state: str = "preparing"  # preparing, running, done, failed, superseded
    error: Optional[str] = None
    connected: bool = False  # a credit arrived, so the client's data socket reaches us
    held: List[ToClient] = field(default_factory=list)  # waiting for the data socket
    granted: int = 0  # cumulative: a lost grant is repaired by the next one
    delivered: int = 0
    delivered_bytes: int = 0
    complete_frac: float = 0.0
    ready: Deque[Item] = field(default_factory=deque)  # released, to send in this step
    read_upto: int = 0

    @property
    def live(self) -> bool:
        return self.state in ("preparing", "running")

    @property
    def credit(self) -> int:
        return self.granted - self.delivered


class Scheduler:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.workers: Dict[bytes, WorkerState] = {}
        self.runs: Dict[int, Run] = {}  # live runs
        # Ended runs whose client has not connected yet: their last words wait for it (briefly).
        self.unheard: Dict[int, Run] = {}
        self.last_run: Optional[Run] = None  # the newest run, live or not (for status)
        self.total_delivered = 0
        self.malformed_results = 0
        self.departures: Counter = Counter()
        self.handed_back = 0
        self.last_beat = float("-inf")
        self.reader_busy = ""  # what the reader is doing, as the last Tick said
        self.now = 0.0  # the time of the event being handled
        self._handlers: Dict[type, Callable[[Any, List[Instruction]], None]] = {
            ev.WorkerJoined: self._on_worker_joined,
            ev.HeartbeatReceived: lambda e, out: None,
            ev.WorkerLeft: lambda e, out: self._remove(e.wid, Departure.DEPARTED, out),
            ev.ResultsReceived: self._on_results,
            ev.TaskFailed: self._on_task_failed,
            ev.StreamAcked: self._on_stream_acked,
            ev.StreamOutputsReceived: self._on_stream_outputs,
            ev.StreamFinished: self._on_stream_finished,
            ev.StreamFailed: self._on_stream_failed,
            ev.LocalWorkerExited: self._on_local_exit,
            ev.Tick: self._on_tick,
            ev.RunRequested: self._on_run_requested,
            ev.RunRejected: self._on_run_rejected,
            ev.RunStarted: self._on_run_started,
            ev.InputsRead: self._on_inputs,
            ev.InputsEnded: self._on_inputs_ended,
            ev.ReplayRead: self._on_replay,
            ev.ReadFailed: lambda e, out: self._fail_id(
                e.run, Failure(FailureKind.DATASET, e.message, traceback=e.traceback), out
            ),
            ev.RunFailedElsewhere: lambda e, out: self._fail_id(e.run, Failure(FailureKind.SERVER, e.message), out),
            ev.CreditGranted: self._on_credit,
        }

    # ---- the one entry point -----------------------------------------------------------------
    def handle(self, event: ev.Event) -> List[Instruction]:
        out: List[Instruction] = []
        self.now = event.now
        if isinstance(event, ev.WorkerEvent) and not self._touch(event, out):
            return out
        self._handlers[type(event)](event, out)
        self._pump(event.now, out)
        return out

    def _touch(self, event: ev.WorkerEvent, out: List[Instruction]) -> bool:
        w = self.workers.get(event.wid)
        if w is None:
            if not isinstance(event, ev.WorkerLeft):
                out.append(ToWorker(event.wid, Unknown(), heartbeat=isinstance(event, ev.HeartbeatReceived)))
            return False
        w.last_seen = event.now
        return True

    # ---- workers ------------------------------------------------------------------------------
    def _on_worker_joined(self, e: ev.WorkerJoined, out: List[Instruction]) -> None:
        if e.wid in self.workers:
            self._remove(e.wid, Departure.REREGISTERED, out)
        old = self.workers.get(e.replaces) if e.replaces is not None else None
        if old is not None and old.pid == e.pid and old.host == e.host:
            self._remove(old.wid, Departure.RECONNECTED, out)  # its connection was reset: redo its work now
        w = WorkerState(
            wid=e.wid,
            host=e.host,
            pid=e.pid,
            local_index=e.local_index,
            capacity=self.settings.buf_size,
            joined=e.now,
            last_seen=e.now,
        )
        self.workers[e.wid] = w
        log.info("worker %s joined (host %s pid %d); %d workers", w.name, w.host, w.pid, len(self.workers))
        for run in self._running():
            out.append(ToWorker(w.wid, RunOpen(run=run.run, epoch=run.epoch, check_tags=run.check_tags)))
            assert run.dispatch is not None
            run.dispatch.assign(self.workers, out)

    def _remove(self, wid: bytes, why: Departure, out: List[Instruction]) -> None:
        """Forget a worker; its work goes back to the queue (suspect if it crashed)."""
        w = self.workers.pop(wid, None)
        if w is None:
            return
        self.departures[why] += 1
        self.handed_back += len(w.tasks) + len(w.partitions)
        log_at = logging.INFO if why in (Departure.DEPARTED, Departure.REREGISTERED) else logging.WARNING
        log.log(
            log_at,
            "worker %s (host %s pid %d) %s; %d seqs and %d partitions handed back",
            w.name,
            w.host,
            w.pid,
            why.value,
            len(w.tasks),
            len(w.partitions),
        )
        for run in self._running():
            assert run.dispatch is not None
            failure = run.dispatch.worker_lost(w, why.crashed, self.workers, out)
            if failure is not None:
                self._fail(run, failure, out)

    def _on_local_exit(self, e: ev.LocalWorkerExited, out: List[Instruction]) -> None:
        for w in list(self.workers.values()):
            if w.local_index == e.local_index and w.pid == e.pid:
                log.warning(
                    "local worker %d (pid %d) exited with %s", e.local_index, e.pid, _describe_exit(e.returncode)
                )
                self._remove(w.wid, Departure.EXITED, out)

    def _on_tick(self, e: ev.Tick, out: List[Instruction]) -> None:
        timeout = self.settings.heartbeat_timeout
        for w in list(self.workers.values()):
            if e.now - w.last_seen > timeout:
                log.warning("no heartbeat from worker %s for %.1f s", w.name, e.now - w.last_seen)
                self._remove(w.wid, Departure.LOST, out)
        self.reader_busy = e.reader_busy
        for run_id, run in list(self.unheard.items()):
            if e.now - (run.ended or e.now) > UNHEARD_S:
                del self.unheard[run_id]
        if e.now - self.last_beat < self.settings.heartbeat_interval:
            return
        self.last_beat = e.now
        for wid in self.workers:
            out.append(ToWorker(wid, Heartbeat(), heartbeat=True))
        for run in self.runs.values():
            self._to_client(
                run,
                Keepalive(
                    run=run.run,
                    interval=self.settings.heartbeat_interval,
                    workers=len(self.workers),
                    waiting_for=self._holdup(run),
                ),
                out,
                drop_if_unconnected=True,
            )

    # ---- worker messages ----------------------------------------------------------------------
    def _dispatch_of(self, run_id: int, kind: type) -> Optional[Any]:
        run = self.runs.get(run_id)
        if run is None or not isinstance(run.dispatch, kind):
            return None
        return run.dispatch

    def _on_results(self, e: ev.ResultsReceived, out: List[Instruction]) -> None:
        if e.bad:
            self.malformed_results += len(e.bad)
            log.warning(
                "dropped %d malformed results from worker %s (first: %s)",
                len(e.bad),
                self.workers[e.wid].name,
                e.bad[0].reason,
            )
        d = self._dispatch_of(e.run, SeqDispatch)
        if d is not None:
            self._maybe_fail(e.run, d.results_received(self.workers[e.wid], e.items, e.bad), out)

    def _on_task_failed(self, e: ev.TaskFailed, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, SeqDispatch)
        if d is not None and d.owns_task(self.workers[e.wid], e.pos):  # not a late word on a seq redone elsewhere
            self._fail_id(e.run, Failure(FailureKind.MAPPER, e.message, e.seq_tag, e.traceback), out)

    def _on_stream_acked(self, e: ev.StreamAcked, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None:
            d.acked(self.workers[e.wid], e.partition, e.n)

    def _on_stream_outputs(self, e: ev.StreamOutputsReceived, out: List[Instruction]) -> None:
        if e.bad:
            self.malformed_results += len(e.bad)
            log.warning(
                "dropped %d malformed stream outputs from worker %s (first: %s)",
                len(e.bad),
                self.workers[e.wid].name,
                e.bad[0].reason,
            )
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None:
            failure = d.outputs_received(self.workers[e.wid], e.partition, e.items, e.bad, self.workers, out)
            self._maybe_fail(e.run, failure, out)

    def _on_stream_finished(self, e: ev.StreamFinished, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None:
            d.finished(self.workers[e.wid], e.partition)

    def _on_stream_failed(self, e: ev.StreamFailed, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None and d.owned(self.workers[e.wid], e.partition) is not None:
            self._fail_id(e.run, Failure(FailureKind.MAPPER, e.message, e.seq_tag, e.traceback), out)

    # ---- runs ---------------------------------------------------------------------------------
    def _running(self) -> List[Run]:
        return [r for r in self.runs.values() if r.dispatch is not None]

    def _on_run_requested(self, e: ev.RunRequested, out: List[Instruction]) -> None:
        run = Run(run=e.run, epoch=e.epoch, consumer=e.consumer, requested=e.now)
        self.runs[e.run] = run
        self.last_run = run

    def _on_run_rejected(self, e: ev.RunRejected, out: List[Instruction]) -> None:
        self._fail_id(e.run, Failure(FailureKind.REQUEST, e.message), out)

    def _on_run_started(self, e: ev.RunStarted, out: List[Instruction]) -> None:
        run = self.runs.get(e.run)
        if run is None:
            out.append(StopReading(e.run))  # it was failed or superseded meanwhile
            return
        for other in list(self.runs.values()):
            if other is not run:
                self._supersede(other, run, out)
        s = self.settings
        run.num_seqs = e.num_seqs
        run.check_tags = e.check_tags
        run.started = e.now
        run.state = "running"
        run.dispatch = (
            StreamDispatch(run.run, run.epoch, e.num_seqs, s) if s.stream else SeqDispatch(run.run, e.num_seqs, s)
        )
        log.info("epoch %d started (run %d, %d input seqs)", run.epoch, run.run, e.num_seqs)
        self._to_client(
            run, Started(run=run.run, num_seqs=None if s.stream and not s.preserves_num_seqs else e.num_seqs), out
        )
        for w in self.workers.values():
            out.append(ToWorker(w.wid, RunOpen(run=run.run, epoch=run.epoch, check_tags=run.check_tags)))
        run.dispatch.assign(self.workers, out)
        if e.num_seqs == 0:
            run.dispatch.inputs_ended(0)

    def _supersede(self, run: Run, by: Run, out: List[Instruction]) -> None:
        log.info("epoch %d (run %d) superseded by epoch %d (run %d)", run.epoch, run.run, by.epoch, by.run)
        self._to_client(run, Superseded(run=run.run, epoch=by.epoch), out)
        self._close(run, "superseded", out)

    def _on_inputs(self, e: ev.InputsRead, out: List[Instruction]) -> None:
        run = self.runs.get(e.run)
        if run is not None and run.dispatch is not None:
            run.dispatch.add_inputs(e.items)

    def _on_inputs_ended(self, e: ev.InputsEnded, out: List[Instruction]) -> None:
        run = self.runs.get(e.run)
        if run is not None and run.dispatch is not None:
            run.num_seqs = e.count
            run.dispatch.inputs_ended(e.count)

    def _on_replay(self, e: ev.ReplayRead, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None:
            d.replay_read(e.partition, e.ticket, e.items)

    def _on_credit(self, e: ev.CreditGranted, out: List[Instruction]) -> None:
        run = self.runs.get(e.run) or self.unheard.pop(e.run, None)
        if run is None or run.consumer != e.consumer:
            return
        run.granted = max(run.granted, min(e.total, run.delivered + MAX_GRANT_AHEAD))
        if not run.connected:
            run.connected = True
            out.extend(run.held)
            run.held.clear()

    # ---- failing and finishing ------------------------------------------------------------------
    def _maybe_fail(self, run_id: int, failure: Optional[Failure], out: List[Instruction]) -> None:
        if failure is not None:
            self._fail_id(run_id, failure, out)

    def _fail_id(self, run_id: int, failure: Failure, out: List[Instruction]) -> None:
        run = self.runs.get(run_id)
        if run is not None:
            self._fail(run, failure, out)

    def _fail(self, run: Run, failure: Failure, out: List[Instruction]) -> None:
        log.error("epoch %d (run %d) failed: %s", run.epoch, run.run, failure.message)
        run.error = failure.message
        self._flush(run, out)
        self._to_client(
            run,
            RunFailed(
                run=run.run,
                failure=failure.kind.value,
                message=failure.message,
                seq_tag=failure.seq_tag,
                traceback=failure.traceback,
            ),
            out,
        )
        self._close(run, "failed", out)

    def _finish(self, run: Run, now: float, out: List[Instruction]) -> None:
        self._to_client(run, End(run=run.run, count=run.delivered), out)
        elapsed = max(now - (run.started or run.requested), 1e-9)
        log.info(
            "epoch %d (run %d) done: %d seqs in %.2f s (%.1f seqs/s)",
            run.epoch,
            run.run,
            run.delivered,
            elapsed,
            run.delivered / elapsed,
        )
        self._close(run, "done", out)

    def _close(self, run: Run, state: str, out: List[Instruction]) -> None:
        run.state = state
        run.ended = self.now
        self.runs.pop(run.run, None)
        if run.held:
            self.unheard[run.run] = run
            while len(self.unheard) > UNHEARD_MAX:
                self.unheard.pop(next(iter(self.unheard)))
        out.append(StopReading(run.run))
        if run.dispatch is not None:
            for w in self.workers.values():
                out.append(ToWorker(w.wid, RunClose(run=run.run)))
            run.dispatch.close(self.workers)
        run.ready.clear()

    # ---- the step after every event ---------------------------------------------------------------
    def _pump(self, now: float, out: List[Instruction]) -> None:
        capacity = sum(w.capacity for w in self.workers.values())
        for run in sorted(self._running(), key=lambda r: r.run):
            d = run.dispatch
            assert d is not None
            d.dispatch(self.workers, out)
            while run.credit - len(run.ready) > 0:
                item = d.pop_next(out)
                if item is None:
                    break
                run.ready.append(self._released(run, item))
            self._flush(run, out)
            total = d.total()
            if total is not None and run.delivered >= total:
                self._finish(run, now, out)
                continue
            limit = d.read_limit(capacity)
            # Grants in steps, so the reader wakes once per few seqs rather than once per seq,
            # unless the workers would otherwise wait for it.
            if limit > run.read_upto and (limit - run.read_upto >= self.settings.read_step or d.starving()):
                run.read_upto = limit
                out.append(ReadUpTo(run.run, limit))

    def _released(self, run: Run, item: Item) -> Item:
        """The output at the next epoch position: numbered, with a complete_frac that never decreases."""
        item.pos = run.delivered + len(run.ready)  # the item is the scheduler's alone from here on
        cf = item.meta.get("complete_frac")
        if cf is not None:
            if cf > run.complete_frac:
                run.complete_frac = cf
            elif cf < run.complete_frac:
                item.meta = {**item.meta, "complete_frac": run.complete_frac}
        return item

    def _flush(self, run: Run, out: List[Instruction]) -> None:
        batch = self.settings.max_delivery_batch
        while run.ready:
            items = [run.ready.popleft() for _ in range(min(batch, len(run.ready)))]
            run.delivered += len(items)
            run.delivered_bytes += sum(i.nbytes for i in items)
            self.total_delivered += len(items)
            out.append(ToClient(run.consumer, Seqs(run=run.run), items))

    def _to_client(self, run: Run, msg: Message, out: List[Instruction], *, drop_if_unconnected: bool = False) -> None:
        instr = ToClient(run.consumer, msg)
        if run.connected:
            out.append(instr)
        elif not drop_if_unconnected:
            run.held.append(instr)

    # ---- status ---------------------------------------------------------------------------------
    def _holdup(self, run: Run) -> str:
        """What the run waits for, in words (keepalives and status)."""
        if run.dispatch is None:
            return (
                f"the dataset to set up the epoch ({self.reader_busy})"
                if self.reader_busy
                else "the dataset to set up the epoch"
            )
        if not self.workers:
            return "a worker (none is connected)"
        if run.credit <= 0:
            return "the trainer (no credit)"
        q = run.dispatch.queues()
        if q["in_flight"]:
            return f"the workers ({q['in_flight']} in flight)"
        if self.reader_busy:
            return f"the dataset ({self.reader_busy})"
        return "the dataset"

    def status(self, now: float) -> Dict[str, Any]:
        st: Dict[str, Any] = {
            "workers_alive": len(self.workers),
            "workers": [w.describe(now) for w in self.workers.values()],
            "seqs_delivered_total": self.total_delivered,
            "malformed_results": self.malformed_results,
            "departures": {d.value: n for d, n in self.departures.items()},
            "handed_back": self.handed_back,
        }
        run = self.last_run
        if run is None:
            st.update(
                {
                    "epoch": None,
                    "run": None,
                    "state": "idle",
                    "seqs_delivered": 0,
                    "num_seqs": None,
                    "seqs_per_sec": 0.0,
                    "mb_delivered": 0.0,
                    "error": None,
                    "waiting_for": None,
                    "queues": {},
                }
            )
            return st
        began = run.started if run.started is not None else run.requested
        end = now if run.ended is None else run.ended
        known = run.num_seqs if not self.settings.stream or self.settings.preserves_num_seqs else None
        st.update(
            {
                "epoch": run.epoch,
                "run": run.run,
                "state": run.state,
                "num_seqs": known,
                "seqs_delivered": run.delivered,
                "seqs_per_sec": round(run.delivered / max(end - began, 1e-9), 2),
                "mb_delivered": round(run.delivered_bytes / 1e6, 3),
                "error": run.error,
                "waiting_for": self._holdup(run) if run.live else None,
                "queues": {
                    **(run.dispatch.queues() if run.dispatch is not None and run.live else {}),
                    "client_credit": max(run.credit, 0),
                },
            }
        )
        return st


def _describe_exit(rc: int) -> str:
    import signal

    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"
