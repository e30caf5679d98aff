"""The scheduler: events in (with the time passed in), instructions out. No sockets, no dataset,
no clock: the server performs what it returns, and tests drive it alone.

This module holds the event table, the workers (registration, liveness, departures, graceful
retirement) and the step after every event. What the scheduler holds is one `SchedulerState`
(`state`, read by the server as `Scheduler.state`). The rest is by job, each part built here over
that state and the parts it calls (none holds the Scheduler or imports this module): `requests`
(refusals, the job, new runs, readers coming and going), `runs` (a run's life: the reader's
answers, failing, ending), `delivery` (release in epoch order into the lanes within credit,
ends), `skips` (seqs map_seq skipped), `status` (what a run waits for, keepalives, the typed
status), `invariants` (what `validate` checks). What a task is and in what order outputs come is
the business of the run's dispatch (`dispatch.Dispatch`, with a part
per mapper style): `SeqDispatch` for map_seq,
`StreamDispatch` for map_seq_stream; a worker's message goes to a run's dispatch only if it is
of the message's style (`_route`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Union

from ppclient.protocol import FailureKind, Heartbeat, Retire, Unknown
from ppserver.exits import describe_exit
from ppserver.scheduler import events as ev
from ppserver.scheduler import invariants, status
from ppserver.scheduler.delivery import Delivery
from ppserver.scheduler.dispatch import D, Dispatch, Drop, SeqWork, StreamWork
from ppserver.scheduler.instructions import Instruction, Read, StopReading, ToWorker
from ppserver.scheduler.jobs import ReadState, Run
from ppserver.scheduler.requests import MAX_READERS, Requests
from ppserver.scheduler.runs import Lifecycle, run_open
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.skips import Skips
from ppserver.scheduler.state import SchedulerState
from ppserver.scheduler.status import SchedulerStatus
from ppserver.scheduler.story import Entry, parse_key
from ppserver.scheduler.workers import RETIRING, SERVING, TOLD, Departure, WorkerState

log = logging.getLogger("ppserver.scheduler")
_STOPPED = ReadState.STOPPED  # (the enum's own lookup is slow on the hot path)

__all__ = ["MAX_READERS", "Scheduler"]

Handler = Callable[[Any, List[Instruction]], None]
Of = Callable[[Optional[Dispatch]], Optional[D]]  # a run's dispatch if it is of a style (Dispatch.of)


class Scheduler:
    """`strict`: check every seq's move against its table (tests; the server's hot path skips it).
    `first_run`: the id of the first run (the server's is random, so a restart never reuses one).
    `state` is everything it holds between events (state.py); the parts work on it."""

    def __init__(self, settings: Settings, strict: bool = False, first_run: int = 1):
        self.state = state = SchedulerState(settings, strict, next_run=first_run)
        self.skips = Skips(state)
        self.lifecycle = Lifecycle(state, self.skips)
        self.delivery = Delivery(state, self.lifecycle)
        self.requests = Requests(state, self.lifecycle)
        req, life, deliv = self.requests, self.lifecycle, self.delivery
        self._handlers: Dict[type, Handler] = {
            ev.WorkerJoined: self._joined,
            ev.HeartbeatReceived: self._heartbeat,
            ev.InputsShared: self._inputs_shared,
            ev.RunDropped: self._run_dropped,
            ev.WorkerLeft: self._left,
            ev.RetireWorker: self._retire,
            ev.ResultsReceived: self._results,
            ev.WorkerMessageMalformed: self._malformed_message,
            ev.TaskFailed: self._task_failed,
            ev.MappingReported: self._mapping,
            ev.StreamAcked: self._stream_acked,
            ev.StreamOutputsReceived: self._stream_outputs,
            ev.StreamFinished: self._stream_finished,
            ev.StreamFailed: self._stream_failed,
            ev.LocalWorkerExited: self._local_exit,
            ev.Tick: self._tick,
            ev.EpochRequested: req.request,
            ev.RunChecked: req.checked,
            ev.RunRejected: life.rejected,
            ev.RunStarted: life.started,
            ev.InputsRead: life.inputs,
            ev.InputsEnded: life.inputs_ended,
            ev.ReplayRead: life.replayed,
            ev.CompletedReceived: self._completed,
            ev.InputsLost: self._inputs_lost,
            ev.MessageDropped: self._dropped,
            ev.MissingReported: deliv.missing,
            ev.ReadFailed: lambda e, out: life.fail_id(
                e.run, Failure(FailureKind.DATASET, e.message, traceback=e.traceback), out
            ),
            ev.RunFailedElsewhere: lambda e, out: life.fail_id(e.run, Failure(FailureKind.SERVER, e.message), out),
            ev.CreditGranted: deliv.credit,
            ev.ConsumerAlive: req.alive,
            ev.ConsumerClosed: req.closed,
        }

    # ---- the one entry point -----------------------------------------------------------------
    def handle(self, event: ev.Event) -> List[Instruction]:
        """The instructions `event` causes, each carrying its stimulus id. A handler that raises
        halfway is an internal error (`_contain`): what it built is kept and its run fails, so
        no client waits for what will not come (with `strict`, tests, it raises)."""
        out: List[Instruction] = []
        state = self.state
        stimulus = event.stimulus or state.stimuli.next(ev.kind_of(type(event)))
        state.begin(event.now, stimulus)
        try:
            if not isinstance(event, ev.WorkerEvent) or self._touch(event, out):
                self._handlers[type(event)](event, out)
                self._pump(out)
        except Exception as exc:
            if state.strict:
                raise
            self._contain(event, exc, out)
        for instr in out:
            object.__setattr__(instr, "stimulus", stimulus)
        return out

    def _contain(self, event: ev.Event, exc: Exception, out: List[Instruction]) -> None:
        """A handler raised: the instructions it built stay (the state moved with them), and the
        event's run, or every live run if it names none, fails as a server failure through the
        normal path; the log names the stimulus and what was built."""
        stimulus = self.state.stimulus
        self.state.internal_errors += 1
        built = ", ".join(type(i).__name__ for i in out) or "nothing"
        log.exception("internal error handling %s (%s); built before it: %s", stimulus, type(event).__name__, built)
        run_id = event.run if isinstance(event, ev.RunEvent) else None
        targets = [run_id] if run_id is not None and run_id in self.state.runs else list(self.state.runs)
        failure = Failure(FailureKind.SERVER, f"internal server error handling {stimulus}: {type(exc).__name__}: {exc}")
        for run in targets:
            try:
                self.lifecycle.fail_id(run, failure, out)
            except Exception:
                log.exception("failing run %d after an internal error failed too", run)

    def story(self, *keys: Union[int, str]) -> List[Entry]:
        """The moves kept about `keys` (positions; "batch:K", "partition:P", "run:R", "lane:R/I", "worker:NAME"),
        oldest first, each with its stimulus id (story.py). ValueError names a key that is none."""
        return self.state.story_log.select([parse_key(k) for k in keys])[0]

    def _touch(self, event: ev.WorkerEvent, out: List[Instruction]) -> bool:
        w = self.state.workers.get(event.wid)
        if w is None:
            if not isinstance(event, ev.WorkerLeft):
                out.append(ToWorker(event.wid, Unknown(), heartbeat=isinstance(event, ev.HeartbeatReceived)))
            return False
        w.last_seen = event.now
        return True

    def _pump(self, out: List[Instruction]) -> None:
        """The step after every event: work to the workers, outputs to the lanes, reading on, and
        retiring workers that hold nothing told to exit (found by a scan: workers are few)."""
        workers = self.state.workers
        capacity = 0
        retiring = False
        for w in workers.values():
            if w.retirement is SERVING:
                capacity += w.capacity
            elif w.retirement is RETIRING:
                retiring = True
        for run in self._running():
            d = run.dispatch
            assert d is not None
            d.dispatch(workers, out)
            self.delivery.deliver(run, out)
            if not run.live or run.reading is _STOPPED:
                continue
            positions = d.requests(capacity)
            if positions:
                out.append(Read(run.run, positions))
            if d.reading_done() and run.stop_reading():
                out.append(StopReading(run.run))
        if retiring:
            for w in workers.values():
                if w.retirement is RETIRING and w.holds_nothing:
                    w.tell_to_retire(self.state.story_log)
                    out.append(ToWorker(w.wid, Retire()))

    def _running(self) -> List[Run]:
        return [r for r in self.state.runs.values() if r.dispatch is not None]

    def dispatch_of(self, run_id: int) -> Optional[Dispatch]:
        """The live run's dispatch (None: not live, or still preparing)."""
        run = self.state.runs.get(run_id)
        return run.dispatch if run is not None else None

    # ---- what it tells ------------------------------------------------------------------------
    def status(self, now: float) -> SchedulerStatus:
        return status.status(self.state, now)

    def validate(self) -> None:
        """Check every invariant the docstrings state (AssertionError naming the first that does
        not hold). It costs what the state holds: tests call it after every event, the server never."""
        invariants.validate(self.state)

    def lanes(self, run_id: int) -> Dict[int, str]:
        """The lanes of a live run that have state of their own, and the word of each one's state
        (jobs.LaneState): "reading", "done", "gone" or "awaited" (no reader yet). A lane gets state
        when its reader comes or leaves (jobs.py), so a job's world_size costs nothing by itself."""
        run = self.state.runs.get(run_id)
        if run is None:
            return {}
        return {index: lane.state.value for index, lane in sorted(run.lanes.items())}

    def held_inputs(self, run_id: int) -> List[int]:
        """The positions of a run whose inputs the server holds: to map, in flight (also for a seq
        no rank wants any more, and, once the run ended, until each worker dropped it), kept for
        a direct consumer. A worker that reads the server's memory may read any of these."""
        d = self.dispatch_of(run_id)
        held = set(d.holds()) if d is not None else set()
        held.update(item.pos for w in self.state.workers.values() for item in w.retained.get(run_id, ()))
        return sorted(held)

    # ---- workers ------------------------------------------------------------------------------
    def _joined(self, e: ev.WorkerJoined, out: List[Instruction]) -> None:
        if e.wid in self.state.workers:
            self._remove(e.wid, Departure.REREGISTERED, out)
        old = self.state.workers.get(e.replaces) if e.replaces is not None else None
        if old is not None and old.pid == e.pid and old.host == e.host:
            self._remove(old.wid, Departure.RECONNECTED, out)  # its connection was reset: redo its work now
        w = WorkerState(
            wid=e.wid,
            host=e.host,
            pid=e.pid,
            local_index=e.local_index,
            capacity=self.state.settings.buf_size,
            joined=e.now,
            last_seen=e.now,
        )
        state = self.state
        state.workers[e.wid] = w
        w.join(state.story_log)
        log.info("worker %s joined (host %s pid %d); %d workers", w.name, w.host, w.pid, len(state.workers))
        if state.job is not None:
            for client in state.job.clients.values():
                if client.route is not None:
                    out.append(ToWorker(w.wid, client.route))
        for run in self._running():
            out.append(ToWorker(w.wid, run_open(run)))

    def _remove(self, wid: bytes, why: Departure, out: List[Instruction]) -> None:
        """Forget a worker; its work goes back to the queue (suspect if it crashed)."""
        state = self.state
        w = state.workers.pop(wid, None)
        if w is None:
            return
        state.departures[why] += 1
        state.handed_back += len(w.tasks) + len(w.partitions)
        quiet = (Departure.DEPARTED, Departure.REREGISTERED, Departure.RETIRED)
        log_at = logging.INFO if why in quiet else logging.WARNING
        what = (w.name, w.host, w.pid, why.value, len(w.tasks), len(w.partitions))
        log.log(log_at, "worker %s (host %s pid %d) %s; %d seqs and %d partitions handed back", *what)
        handed = f"{len(w.tasks)} tasks, {len(w.partitions)} partitions handed back"
        for run in self._running():
            assert run.dispatch is not None
            self.lifecycle.fail_id(run.run, run.dispatch.worker_lost(w, why.crashed), out)
        # last, after its work went back (and with it any isolation): a departed worker's story ends here
        w.leave(state.story_log, why, handed)

    def _left(self, e: ev.WorkerLeft, out: List[Instruction]) -> None:
        w = self.state.workers[e.wid]
        self._remove(e.wid, Departure.RETIRED if w.retirement is TOLD else Departure.DEPARTED, out)

    def _retire(self, e: ev.RetireWorker, out: List[Instruction]) -> None:
        """The worker gets no new work from now on (workers.Retirement: placement gives a retiring
        one nothing); _pump tells it to exit once it holds nothing, so whatever it holds is
        finished, not redone."""
        w = self.state.workers.get(e.wid)
        if w is not None and w.retirement is SERVING:
            w.retire(self.state.story_log)
            log.info(
                "retiring worker %s (host %s pid %d) once its %d tasks are done",
                w.name,
                w.host,
                w.pid,
                len(w.tasks) + len(w.partitions),
            )

    def _local_exit(self, e: ev.LocalWorkerExited, out: List[Instruction]) -> None:
        for w in list(self.state.workers.values()):
            if w.local_index == e.local_index and w.pid == e.pid:
                if w.retirement is TOLD:
                    self._remove(w.wid, Departure.RETIRED, out)  # its bye is still on its way
                    continue
                how = describe_exit(e.returncode)
                log.warning("local worker %d (pid %d) exited with %s", e.local_index, e.pid, how)
                self._remove(w.wid, Departure.EXITED, out)

    def _tick(self, e: ev.Tick, out: List[Instruction]) -> None:
        state = self.state
        for w in list(state.workers.values()):
            if e.now - w.last_seen > state.settings.heartbeat_timeout:
                log.warning("no heartbeat from worker %s for %.1f s", w.name, e.now - w.last_seen)
                self._remove(w.wid, Departure.LOST, out)
        state.reader_busy = e.reader_busy
        self.requests.expire(e.now, out)
        self.lifecycle.forget_unheard(e.now)
        if e.now - state.last_beat < state.settings.heartbeat_interval:
            return
        state.last_beat = e.now
        for wid in state.workers:
            out.append(ToWorker(wid, Heartbeat(), heartbeat=True))
        status.keepalives(state, out)

    def _heartbeat(self, e: ev.HeartbeatReceived, out: List[Instruction]) -> None:
        """A worker mapping a batch says how many of its seqs it has mapped: more than it said last
        is progress of the batch's run (its keepalives carry it), though no result came yet. Only
        a task the worker holds counts, so a stuck mapper shows none."""
        w = self.state.workers[e.wid]
        last, w.progress = w.progress, e.mapping
        if e.mapping is None:
            return
        run_id, pos, done = e.mapping
        before = last[2] if last is not None and last[:2] == (run_id, pos) else 0
        run = self.state.runs.get(run_id)
        if done > before and run is not None and (run_id, pos) in w.tasks:
            run.mapped += done - before

    def _inputs_shared(self, e: ev.InputsShared, out: List[Instruction]) -> None:
        self.state.workers[e.wid].inputs = e.path

    def _run_dropped(self, e: ev.RunDropped, out: List[Instruction]) -> None:
        self.state.workers[e.wid].retained.pop(e.run, None)  # the inputs it may have been reading can go

    def _mapping(self, e: ev.MappingReported, out: List[Instruction]) -> None:
        self.state.workers[e.wid].mapping = (e.run, e.pos, e.seq_tag)

    # ---- worker messages: to the run's dispatch ------------------------------------------------
    def _route(self, run_id: int, of: Of[D], call: Callable[[D], Optional[Failure]], out: List[Instruction]) -> bool:
        """Hand a worker's message of a run to the run's dispatch if it is of the message's style
        (`of`: SeqWork.of, StreamWork.of, or Dispatch.of for either), and fail the run with the
        failure `call` returns. False if it is not: the run is not live (or still preparing), or
        it maps in the other style (a late or stray message): nothing to it."""
        d = of(self.dispatch_of(run_id))
        if d is None:
            return False
        self.lifecycle.fail_id(run_id, call(d), out)
        return True

    def _results(self, e: ev.ResultsReceived, out: List[Instruction]) -> None:
        if e.bad:
            self._malformed(len(e.bad), "results", e.wid, e.bad[0].reason)
        w = self.state.workers[e.wid]
        if self._route(e.run, SeqWork.of, lambda d: d.results_received(w, e.items, e.bad), out):
            self._skipped(e.run, out)

    def _skipped(self, run_id: int, out: List[Instruction]) -> None:
        """Count the seqs the mapper skipped that the run's dispatch accepted; too many fail it."""
        run = self.state.runs.get(run_id)
        if run is not None:
            self.lifecycle.fail_id(run_id, self.skips.taken(run, self.state.now), out)

    def _malformed(self, n: int, what: str, wid: bytes, first: str) -> None:
        self.state.malformed_results += n
        log.warning("dropped %d malformed %s from worker %s (first: %s)", n, what, self.state.workers[wid].name, first)

    def _holding(self, w: WorkerState) -> List[int]:
        """The live runs `w` holds tasks or stream partitions of."""
        return [run_id for run_id in self.state.runs if any(r == run_id for r, _ in w.tasks | w.partitions)]

    def _malformed_message(self, e: ev.WorkerMessageMalformed, out: List[Instruction]) -> None:
        w = self.state.workers[e.wid]
        held = self._holding(w)
        if not held:
            return
        self.state.malformed_results += 1
        log.warning(
            "a message from worker %s did not decode (%s): its %d seqs and %d stream partitions are redone elsewhere",
            w.name,
            e.reason,
            len(w.tasks),
            len(w.partitions),
        )
        for run_id in held:  # (an earlier run's failure may have ended a later one)
            self._route(run_id, Dispatch.of, lambda d: d.malformed_message(w, e.reason), out)

    def _dropped(self, e: ev.MessageDropped, out: List[Instruction]) -> None:
        """A message the worker could not take: the tasks or stream partition it carried are redone
        elsewhere, charged to their seqs; one it could not read at all charges everything the
        worker holds. Other messages (a route, say) carried no work: the worker goes on without."""
        w = self.state.workers[e.wid]
        self.state.dropped_by_workers += 1
        kind = "unreadable" if e.what is None else repr(e.what)
        of_run = f" of run {e.run}" if e.run is not None else ""
        log.warning("worker %s dropped a %s message%s from the server: %s", w.name, kind, of_run, e.reason)
        if e.carried is ev.Carried.NOTHING:
            return
        if e.carried is not ev.Carried.UNKNOWN and e.run is not None:
            targets, drop = [e.run], Drop(e.carried, e.positions, e.partition, e.reason)
        else:  # which run it was is not known: everything the worker holds
            targets, drop = self._holding(w), Drop(e.carried, (), None, e.reason)
        style = _CARRIED_TO[drop.carried]
        for run_id in targets:  # (a run that ended has nothing to redo)
            self._route(run_id, style, lambda d: d.dropped(w, drop), out)

    def _completed(self, e: ev.CompletedReceived, out: List[Instruction]) -> None:
        w = self.state.workers[e.wid]
        if self._route(e.run, SeqWork.of, lambda d: d.completed(w, e), out):
            self._skipped(e.run, out)

    def _inputs_lost(self, e: ev.InputsLost, out: List[Instruction]) -> None:
        self._route(e.run, SeqWork.of, lambda d: self._lost(d, e), out)

    def _lost(self, d: SeqWork, e: ev.InputsLost) -> Optional[Failure]:
        """Count and log the tasks whose inputs a worker could not read that are redone."""
        w = self.state.workers[e.wid]
        redone, failure = d.inputs_lost(w, e.positions)
        self.state.lost_inputs += redone
        if redone:
            epoch = self.state.runs[e.run].epoch
            log.warning("worker %s could not read %d inputs of epoch %d (%s): redone", w.name, redone, epoch, e.reason)
        return failure

    def _task_failed(self, e: ev.TaskFailed, out: List[Instruction]) -> None:
        w = self.state.workers[e.wid]
        self._route(e.run, SeqWork.of, lambda d: _mapper_failure(e) if d.task_failed(w, e.pos) else None, out)

    def _stream_acked(self, e: ev.StreamAcked, out: List[Instruction]) -> None:
        w = self.state.workers[e.wid]
        self._route(e.run, StreamWork.of, lambda d: d.stream_acked(w, e.partition, e.incarnation, e.n), out)

    def _stream_outputs(self, e: ev.StreamOutputsReceived, out: List[Instruction]) -> None:
        if e.bad:
            self._malformed(len(e.bad), "stream outputs", e.wid, e.bad[0].reason)
        w = self.state.workers[e.wid]
        self._route(
            e.run, StreamWork.of, lambda d: d.stream_outputs(w, e.partition, e.incarnation, e.items, e.bad), out
        )

    def _stream_finished(self, e: ev.StreamFinished, out: List[Instruction]) -> None:
        w = self.state.workers[e.wid]
        self._route(e.run, StreamWork.of, lambda d: d.stream_finished(w, e.partition, e.incarnation), out)

    def _stream_failed(self, e: ev.StreamFailed, out: List[Instruction]) -> None:
        w = self.state.workers[e.wid]
        self._route(
            e.run,
            StreamWork.of,
            lambda d: _mapper_failure(e) if d.stream_failed(w, e.partition, e.incarnation) else None,
            out,
        )


# The dispatches a dropped message's work is redone by: its style's (either, if it is not known).
_CARRIED_TO: Dict[ev.Carried, Of[Dispatch]] = {
    ev.Carried.TASKS: SeqWork.of,
    ev.Carried.STREAM: StreamWork.of,
    ev.Carried.UNKNOWN: Dispatch.of,
}


def _mapper_failure(e: Union[ev.TaskFailed, ev.StreamFailed]) -> Failure:
    """The run's failure when its mapper raised, as the worker reports it."""
    return Failure(FailureKind.MAPPER, e.message, e.seq_tag, e.traceback)
