"""The scheduler: events in (with the time passed in), instructions out. No sockets, no dataset,
no clock: the server performs what it returns, and tests drive it alone.

It owns the workers (registration, liveness, departures), the job (its ranks, their runs)
and delivery. A run is one epoch of the job: outputs are released in epoch order into the
lane of the rank that gets them (position i goes to rank i % world_size), never more than
that rank has granted, and the reader reads only as far as the workers' credit allows.
What a task is and in what order outputs come is the business of the run's dispatch:
`SeqDispatch` for map_seq, `StreamDispatch` for map_seq_stream.

Requests (see `_on_request`): a rank joins the job's run of its epoch, or starts it. A rank
that asks for the epoch it is in again, from index k of its shard (a restarted trainer),
takes its lane over if nothing from k on has been released to it yet; otherwise a solo run
serves its shard from k, read and mapped again, and the main run drops that rank's seqs.
One job at a time: another job is refused while any of this one's clients lives.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ppclient.protocol import (
    BadItem,
    Batch,
    ConsumerGone,
    ConsumerRoute,
    End,
    EpochAccepted,
    ErrorReply,
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
    Tasks,
    Unknown,
)
from ppserver.datasets.cut import Cutter
from ppserver.scheduler import events as ev
from ppserver.scheduler.instructions import Instruction, Prepare, Read, Reply, StopReading, ToClient, ToWorker
from ppserver.scheduler.jobs import Client, Job, Lane, Run
from ppserver.scheduler.seqs import SeqDispatch
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.streams import StreamDispatch
from ppserver.scheduler.workers import Departure, WorkerState

log = logging.getLogger("ppserver.scheduler")

MAX_GRANT_AHEAD = 1 << 20  # a client cannot make the server hold more than this many seqs
UNHEARD_MAX = 64  # ended lanes kept for a client that has not connected yet
UNHEARD_S = 60.0
MAX_EPOCHS = 2  # a job's runs span at most this many epochs (one being finished, the next one)
# A job may have at most this many readers (world_size * readers per rank): each holds a connection
# of its own to the server, so a job above it could never have them all connected. (Below it, a
# reader costs nothing until it comes: see jobs.py.)
MAX_READERS = 1 << 16


class Scheduler:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.workers: Dict[bytes, WorkerState] = {}
        self.job: Optional[Job] = None
        self.runs: Dict[int, Run] = {}  # live runs (of the job)
        # Ended lanes whose client has not connected yet: their last words wait for it (briefly).
        self.unheard: Dict[Tuple[int, bytes], Tuple[Run, Lane]] = {}
        self.last_run: Optional[Run] = None  # the newest run, live or not (for status)
        self.next_run = 0  # run ids: the server sets the first one (random, so a restart never reuses ids)
        self.total_delivered = 0
        self.malformed_results = 0
        self.lost_direct = 0  # direct results a consumer reported missing (made again)
        self.lost_inputs = 0  # inputs a worker could not read (made again)
        self.dropped_by_workers = 0  # messages workers dropped unread (what they carried redone)
        self.departures: Counter = Counter()
        self.handed_back = 0
        self.last_beat = float("-inf")
        self.reader_busy = ""  # what the reader is doing, as the last Tick said
        self.now = 0.0  # the time of the event being handled
        self._handlers: Dict[type, Callable[[Any, List[Instruction]], None]] = {
            ev.WorkerJoined: self._on_worker_joined,
            ev.HeartbeatReceived: lambda e, out: None,
            ev.InputsShared: self._on_inputs_shared,
            ev.RunDropped: self._on_run_dropped,
            ev.WorkerLeft: lambda e, out: self._remove(e.wid, Departure.DEPARTED, out),
            ev.ResultsReceived: self._on_results,
            ev.WorkerMessageMalformed: self._on_malformed_message,
            ev.TaskFailed: self._on_task_failed,
            ev.MappingReported: self._on_mapping,
            ev.StreamAcked: self._on_stream_acked,
            ev.StreamOutputsReceived: self._on_stream_outputs,
            ev.StreamFinished: self._on_stream_finished,
            ev.StreamFailed: self._on_stream_failed,
            ev.LocalWorkerExited: self._on_local_exit,
            ev.Tick: self._on_tick,
            ev.EpochRequested: self._on_request,
            ev.RunChecked: self._on_checked,
            ev.RunRejected: self._on_run_rejected,
            ev.RunStarted: self._on_run_started,
            ev.InputsRead: self._on_inputs,
            ev.InputsEnded: self._on_inputs_ended,
            ev.ReplayRead: self._on_replay,
            ev.CompletedReceived: self._on_completed,
            ev.InputsLost: self._on_inputs_lost,
            ev.MessageDropped: self._on_dropped,
            ev.MissingReported: self._on_missing,
            ev.ReadFailed: lambda e, out: self._fail_id(
                e.run, Failure(FailureKind.DATASET, e.message, traceback=e.traceback), out
            ),
            ev.RunFailedElsewhere: lambda e, out: self._fail_id(e.run, Failure(FailureKind.SERVER, e.message), out),
            ev.CreditGranted: self._on_credit,
            ev.ConsumerAlive: self._on_alive,
            ev.ConsumerClosed: lambda e, out: self._consumer_gone(e.consumer, "closed", out, closed=True),
        }

    # ---- the one entry point -----------------------------------------------------------------
    def handle(self, event: ev.Event) -> List[Instruction]:
        out: List[Instruction] = []
        self.now = event.now
        if isinstance(event, ev.WorkerEvent) and not self._touch(event, out):
            return out
        self._handlers[type(event)](event, out)
        self._pump(out)
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
    def _on_inputs_shared(self, e: ev.InputsShared, out: List[Instruction]) -> None:
        self.workers[e.wid].input_bytes = e.max_bytes

    def _on_run_dropped(self, e: ev.RunDropped, out: List[Instruction]) -> None:
        self.workers[e.wid].retained.pop(e.run, None)

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
        if self.job is not None:
            for client in self.job.clients.values():
                if client.route is not None:
                    out.append(ToWorker(w.wid, client.route))
        for run in self._running():
            out.append(ToWorker(w.wid, _run_open(run)))
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
        for w in list(self.workers.values()):
            if e.now - w.last_seen > self.settings.heartbeat_timeout:
                log.warning("no heartbeat from worker %s for %.1f s", w.name, e.now - w.last_seen)
                self._remove(w.wid, Departure.LOST, out)
        self.reader_busy = e.reader_busy
        if self.job is not None:
            for consumer, client in list(self.job.clients.items()):
                if e.now - client.alive_at > client.timeout:
                    self._consumer_gone(consumer, f"silent for {e.now - client.alive_at:.1f} s", out)
        for key, (ended_run, _) in list(self.unheard.items()):
            if e.now - (ended_run.ended or e.now) > UNHEARD_S:
                del self.unheard[key]
        if e.now - self.last_beat < self.settings.heartbeat_interval:
            return
        self.last_beat = e.now
        for wid in self.workers:
            out.append(ToWorker(wid, Heartbeat(), heartbeat=True))
        for run in self.runs.values():
            for lane in run.lanes.values():
                if lane.consumer is not None and lane.connected and not lane.settled:
                    out.append(ToClient(lane.consumer, self._keepalive(run.run, *self._holdup(run, lane))))

    def _keepalive(self, run: int, waiting_for: str, on_readers: bool) -> Keepalive:
        return Keepalive(
            run=run,
            interval=self.settings.heartbeat_interval,
            workers=len(self.workers),
            waiting_for=waiting_for,
            waits_on_readers=on_readers,
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

    def _on_malformed_message(self, e: ev.WorkerMessageMalformed, out: List[Instruction]) -> None:
        w = self.workers[e.wid]
        held = [run_id for run_id in self.runs if any(r == run_id for r, _ in w.tasks | w.partitions)]
        if not held:
            return
        self.malformed_results += 1
        log.warning(
            "a message from worker %s did not decode (%s): its %d seqs and %d stream partitions are redone elsewhere",
            w.name,
            e.reason,
            len(w.tasks),
            len(w.partitions),
        )
        for run_id in held:
            run = self.runs.get(run_id)
            d = run.dispatch if run is not None else None  # (an earlier run's failure may have ended it)
            if isinstance(d, SeqDispatch):
                failure = d.results_received(w, [], [BadItem(None, e.reason)])
            elif isinstance(d, StreamDispatch):
                failure = d.malformed_message(w, e.reason, self.workers, out)
            else:
                continue
            self._maybe_fail(run_id, failure, out)

    def _on_dropped(self, e: ev.MessageDropped, out: List[Instruction]) -> None:
        """A message the worker could not take: the tasks or stream partition it carried are redone
        elsewhere, charged to their seqs; one it could not read at all charges everything the
        worker holds. Other messages (a route, say) carried no work: the worker goes on without."""
        w = self.workers[e.wid]
        self.dropped_by_workers += 1
        log.warning(
            "worker %s dropped a %s message%s from the server: %s",
            w.name,
            repr(e.what) if e.what else "unreadable",
            f" of run {e.run}" if e.run is not None else "",
            e.reason,
        )
        if e.what not in ("", Tasks.kind) and not e.what.startswith("stream_"):
            return  # it carried no work
        if e.what and e.run is not None:
            targets, positions, partition = [e.run], e.positions, e.partition
        else:  # which run it was is not known: everything the worker holds
            targets = [run_id for run_id in self.runs if any(r == run_id for r, _ in w.tasks | w.partitions)]
            positions, partition = [], None
        for run_id in targets:
            run = self.runs.get(run_id)  # (None: a run that ended: nothing to redo)
            d = run.dispatch if run is not None else None
            if isinstance(d, SeqDispatch) and e.what in ("", Tasks.kind):
                failure = d.dropped(w, positions, e.reason)
            elif isinstance(d, StreamDispatch) and e.what != Tasks.kind:
                failure = d.dropped(w, partition, e.reason, self.workers, out)
            else:
                continue
            self._maybe_fail(run_id, failure, out)

    def _on_completed(self, e: ev.CompletedReceived, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, SeqDispatch)
        if d is not None:
            d.completed(self.workers[e.wid], e.positions, e.nbytes)

    def _on_inputs_lost(self, e: ev.InputsLost, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, SeqDispatch)
        if d is not None:
            redone, failure = d.inputs_lost(self.workers[e.wid], e.positions)
            self.lost_inputs += redone
            if redone:
                log.warning(
                    "worker %s could not read %d inputs of epoch %d (%s): redone",
                    self.workers[e.wid].name,
                    redone,
                    self.runs[e.run].epoch,
                    e.reason,
                )
            self._maybe_fail(e.run, failure, out)

    def _on_mapping(self, e: ev.MappingReported, out: List[Instruction]) -> None:
        self.workers[e.wid].mapping = (e.run, e.pos, e.seq_tag)

    def _on_task_failed(self, e: ev.TaskFailed, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, SeqDispatch)
        if d is not None and d.task_failed(self.workers[e.wid], e.pos):  # not a late word, not a dropped seq
            self._fail_id(e.run, Failure(FailureKind.MAPPER, e.message, e.seq_tag, e.traceback), out)

    def _on_stream_acked(self, e: ev.StreamAcked, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None:
            d.acked(self.workers[e.wid], e.partition, e.incarnation, e.n)

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
            failure = d.outputs_received(
                self.workers[e.wid], e.partition, e.incarnation, e.items, e.bad, self.workers, out
            )
            self._maybe_fail(e.run, failure, out)

    def _on_stream_finished(self, e: ev.StreamFinished, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None:
            d.finished(self.workers[e.wid], e.partition, e.incarnation)

    def _on_stream_failed(self, e: ev.StreamFailed, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None and d.owned(self.workers[e.wid], e.partition, e.incarnation) is not None:
            self._fail_id(e.run, Failure(FailureKind.MAPPER, e.message, e.seq_tag, e.traceback), out)

    # ---- requests -------------------------------------------------------------------------------
    def _on_request(self, e: ev.EpochRequested, out: List[Instruction]) -> None:
        refusal = self._refusal(e)
        if refusal is not None:
            log.warning("refused epoch %d for rank %d of job %r: %s", e.epoch, e.rank, e.job, refusal)
            out.append(Reply(e.requester, ErrorReply(error=refusal, reason="job")))
            return
        job = self._job_for(e, out)
        main = self._main_run(job, e.epoch)
        if main is not None and self._can_attach(main, e):
            self._attach(main, e, out)
            target = main
        else:
            target = self._new_run(job, e, solo=e.lane if main is not None else None, out=out)
        accepted = EpochAccepted(run=target.run, instance=self.settings.instance, fingerprint=self.settings.fingerprint)
        out.append(Reply(e.requester, accepted))

    def _refusal(self, e: ev.EpochRequested) -> Optional[str]:
        """Why the request cannot be served (one line), or None."""
        if not 0 <= e.rank < e.world_size:
            return f"rank {e.rank} is not below world_size {e.world_size}"
        if not 0 <= e.subshard < e.subshards:
            return f"reader {e.subshard} of a rank is not below its number of readers {e.subshards}"
        if e.world_size * e.subshards > MAX_READERS:
            return _too_many(e.world_size, e.subshards)
        job = self.job
        others = [client for consumer, client in job.clients.items() if consumer != e.consumer] if job else []
        if job is None or not others:
            return None  # no job, or one whose clients are all gone: this request starts a new one
        if e.job_key != job.key:
            clients = f"{len(others)} live client{'s' if len(others) != 1 else ''}"
            one = len(others) == 1
            timeout = max(c.timeout for c in others)
            gone = f"closed, or silent for {'its' if one else 'their'} client timeout of {timeout:g} s"
            if e.job != job.name:
                return (
                    f"job {job.name!r} is running with {clients} (world_size {job.world}, "
                    f"drop_last {job.drop_last}, {_readers(job.subshards)}); a request of job {e.job!r} must "
                    f"wait until {'it is' if one else 'they are'} gone ({gone})"
                )
            mine = {"world_size": job.world, "drop_last": job.drop_last, "readers": job.subshards}
            asked = {"world_size": e.world_size, "drop_last": e.drop_last, "readers": e.subshards}
            conflicts = [
                f"{_readers(asked[k])}, where the job has {_readers(mine[k])}"
                if k == "readers"
                else f"{k} {asked[k]}, where the job has {k} {mine[k]}"
                for k in mine
                if mine[k] != asked[k]
            ]
            if e.batching != job.batching:
                conflicts.append(f"{_batching(e.batching)}, where the job has {_batching(job.batching)}")
            return (
                f"this request of job {job.name!r} conflicts with the job's {clients}: "
                f"{'; '.join(conflicts)}. Every rank of a job must use the same world_size, drop_last, "
                f"DataLoader num_workers and batching; the job keeps its settings until "
                f"{'that client is' if one else 'they are'} gone ({gone})"
            )
        main = self._main_run(job, e.epoch)
        if main is not None:
            if (main.seq_list, main.seq_order) != (e.seq_list, e.seq_order):
                return f"epoch {e.epoch} of job {job.name!r} runs with another seq_list/seq_order"
            return None
        # Only what other ranks still read constrains this one: it leaves its own runs anyway.
        epochs = {
            run.epoch
            for run in job.runs.values()
            if run.expecting(besides=e.lane)
            or any(lane.rank != e.lane and not lane.gone and not lane.done for lane in run.lanes.values())
        }
        if epochs and e.epoch < max(epochs):
            return (
                f"epoch {e.epoch} is over for job {job.name!r} (it runs epoch "
                f"{', '.join(map(str, sorted(epochs)))}); a dataset holds one epoch at a time"
            )
        if epochs and (e.epoch > max(epochs) + 1 or len(epochs | {e.epoch}) > MAX_EPOCHS):
            return (
                f"job {job.name!r} runs epochs {', '.join(map(str, sorted(epochs)))}; rank {e.rank} asked for "
                f"epoch {e.epoch}: ranks may be at most one epoch apart"
            )
        return None

    def _job_for(self, e: ev.EpochRequested, out: List[Instruction]) -> Job:
        job = self.job
        if job is not None and job.key == e.job_key:
            return job
        if job is not None:
            log.info(
                "job %r (world_size %d) replaced by job %r (world_size %d): its clients are gone",
                job.name,
                job.world,
                e.job,
                e.world_size,
            )
            for run in list(job.runs.values()):
                self._supersede(run, e.epoch, out)
        self.job = Job(e.job, e.world_size, e.drop_last, e.subshards, e.batching)
        log.info(
            "job %r: world_size %d, drop_last %s, %s, %s",
            e.job,
            e.world_size,
            e.drop_last,
            _readers(e.subshards),
            _batching(e.batching),
        )
        return self.job

    @staticmethod
    def _main_run(job: Job, epoch: int) -> Optional[Run]:
        for run in job.runs.values():
            if run.epoch == epoch and run.solo is None and run.live:
                return run
        return None

    @staticmethod
    def _can_attach(run: Run, e: ev.EpochRequested) -> bool:
        """Whether the run will still read, map and release the rank's seqs from `start` on."""
        lane = run.view(e.lane)
        if run.dispatch is None:
            return not lane.gone  # nothing read yet: the lane may start anywhere
        if lane.gone:
            return False  # its seqs were not read since it left
        if lane.consumer is None:
            return e.start >= lane.start  # seqs before the expected start were never read
        return e.start >= lane.released

    def _attach(self, run: Run, e: ev.EpochRequested, out: List[Instruction]) -> None:
        lane = run.lane(e.lane)
        if lane.consumer is not None and lane.consumer != e.consumer and not lane.gone:
            self._to_lane(run, lane, Superseded(run=run.run, epoch=run.epoch), out)
        lane.attach(e.consumer, e.start, e.now, run.width)
        known = run.job.clients.get(e.consumer)
        client = run.job.clients[e.consumer] = Client(e.lane, e.timeout, e.now)
        if e.direct and self.settings.direct:
            client.route = ConsumerRoute(consumer=e.consumer, endpoint=e.direct, key=e.direct_key, host=e.host)
            if known is None or known.route != client.route:
                for wid in self.workers:
                    out.append(ToWorker(wid, client.route))
        lane.direct = client.route is not None
        log.info(
            "%s of job %r reads epoch %d (run %d) from seq %d of its shard",
            run.job.who(e.lane),
            run.job.name,
            run.epoch,
            run.run,
            e.start,
        )
        if run.checked:
            self._leave_others(run, e.lane, out)
        if run.dispatch is not None:
            self._to_lane(run, lane, self._started(run, lane), out)

    def _new_run(self, job: Job, e: ev.EpochRequested, *, solo: Optional[int], out: List[Instruction]) -> Run:
        self.next_run += 1
        run = Run(
            run=self.next_run,
            job=job,
            epoch=e.epoch,
            requested=e.now,
            seq_list=e.seq_list,
            seq_order=e.seq_order,
            solo=solo,
            base=e.start,
        )
        # Ranks that have not come yet are expected where this one starts (DDP ranks resume
        # together), unless they are done with this epoch (in a solo run, none is): a lane gets
        # state of its own only when its reader comes, or here if it is not expected.
        if solo is None:
            for r in job.unexpected(e.epoch) - {e.lane}:
                run.lanes[r] = Lane(rank=r, start=e.start, gone=True)
        job.runs[run.run] = run
        self.runs[run.run] = run
        self.last_run = run
        self._attach(run, e, out)
        out.append(Prepare(run.run, e.epoch, e.seq_list, e.seq_order, None if self.settings.stream else job.batching))
        if solo is not None:
            log.info(
                "%s of job %r resumes epoch %d at seq %d of its shard, behind the job's run: "
                "run %d reads and maps its shard again",
                job.who(solo),
                job.name,
                e.epoch,
                e.start,
                run.run,
            )
        return run

    def _leave_others(self, run: Run, rank: int, out: List[Instruction]) -> None:
        """Rank `rank` now reads `run`: its lanes in the job's other runs are dropped."""
        for other in list(run.job.runs.values()):
            if other is run or other.view(rank).gone:
                continue
            lane = other.lane(rank)
            if lane.consumer is not None and not lane.done:
                self._to_lane(other, lane, Superseded(run=other.run, epoch=run.epoch), out)
            lane.gone = True
            self._check_finished(other, out)

    def _consumer_gone(self, consumer: bytes, why: str, out: List[Instruction], closed: bool = False) -> None:
        """A client closed or went silent: its lanes are dropped (the rank may resume later).
        `closed`: it said so, and takes nothing more: the workers free the blocks it never took."""
        job = self.job
        client = job.clients.pop(consumer, None) if job is not None else None
        if job is None or client is None:
            return
        if client.route is not None:
            for wid in self.workers:
                out.append(ToWorker(wid, ConsumerGone(consumer=consumer, closed=closed)))
        for run, lane in job.lanes_of(consumer):
            if lane.gone:
                continue
            log.warning(
                "%s of job %r (epoch %d, run %d) gone: client %s", job.who(lane.rank), job.name, run.epoch, run.run, why
            )
            lane.gone = True
            self._check_finished(run, out)

    # ---- the reader's answers ---------------------------------------------------------------
    def _on_checked(self, e: ev.RunChecked, out: List[Instruction]) -> None:
        run = self.runs.get(e.run)
        if run is None:
            return
        run.checked = True
        for lane in list(run.lanes.values()):
            if lane.consumer is not None and not lane.gone:
                self._leave_others(run, lane.rank, out)

    def _on_run_rejected(self, e: ev.RunRejected, out: List[Instruction]) -> None:
        self._fail_id(e.run, Failure(FailureKind.REQUEST, e.message), out)

    def _on_run_started(self, e: ev.RunStarted, out: List[Instruction]) -> None:
        run = self.runs.get(e.run)
        if run is None:
            out.append(StopReading(e.run))  # it ended meanwhile
            return
        s = self.settings
        run.checked = True
        run.num_seqs = e.num_seqs
        run.started = e.now
        run.state = "running"
        if not s.stream or s.preserves_num_seqs:
            run.total = e.num_seqs
        if s.stream:
            run.dispatch = StreamDispatch(run.run, run.epoch, e.num_seqs, s)
            if run.job.batching is not None:
                run.cutter = Cutter(run.job.batching)
                run.total = None  # batches: known once the merged outputs are all cut
        else:
            first = run.next_wanted(0)
            run.dispatch = SeqDispatch(
                run.run,
                e.num_seqs,
                s,
                wanted=run.wanted,
                next_wanted=run.next_wanted,
                end=run.end(),
                first=first or 0,
                route=self._router(run) if s.direct else None,
                width=run.width,
            )
        count = "an unknown number of" if e.num_seqs is None else str(e.num_seqs)
        log.info("epoch %d started (run %d, %s %s)", run.epoch, run.run, count, _inputs(run, s.stream))
        for lane in run.lanes.values():
            if lane.consumer is not None and not lane.gone:
                self._to_lane(run, lane, self._started(run, lane), out)
        for w in self.workers.values():
            out.append(ToWorker(w.wid, _run_open(run)))
        run.dispatch.assign(self.workers, out)

    def _started(self, run: Run, lane: Lane) -> Started:
        size = run.shard_size(lane.rank)
        batching = run.job.batching
        return Started(
            run=run.run,
            num_seqs=None if size is None else max(size - lane.start, 0),
            fingerprint=self.settings.fingerprint,
            batching=None if batching is None else batching.to_dict(),
        )

    def _on_inputs(self, e: ev.InputsRead, out: List[Instruction]) -> None:
        run = self.runs.get(e.run)
        if run is not None and run.dispatch is not None:
            run.dispatch.add_inputs(e.items)  # type: ignore[arg-type]  # (Batches only for a SeqDispatch)

    def _on_inputs_ended(self, e: ev.InputsEnded, out: List[Instruction]) -> None:
        run = self.runs.get(e.run)
        if run is None or run.dispatch is None or run.num_seqs is not None:
            return  # the first end the reader found stands
        s = self.settings
        run.num_seqs = e.count
        if isinstance(run.dispatch, StreamDispatch):
            run.dispatch.inputs_ended(e.count)
            if s.preserves_num_seqs and run.cutter is None:
                run.total = e.count
        else:
            run.total = e.count
            end = run.end()
            assert end is not None
            run.dispatch.inputs_ended(e.count, end)
        log.info("epoch %d (run %d) has %d %s", run.epoch, run.run, e.count, _inputs(run, s.stream))

    def _on_replay(self, e: ev.ReplayRead, out: List[Instruction]) -> None:
        d = self._dispatch_of(e.run, StreamDispatch)
        if d is not None:
            d.replay_read(e.partition, e.ticket, e.items)

    # ---- clients --------------------------------------------------------------------------------
    def _lane_of(self, consumer: bytes, run_id: int) -> Optional[Tuple[Run, Lane]]:
        run = self.runs.get(run_id)
        if run is not None:
            for lane in run.lanes.values():
                if lane.consumer == consumer:
                    return run, lane
        return self.unheard.pop((run_id, consumer), None)  # keyed by consumer: a stranger pops nothing

    def _on_credit(self, e: ev.CreditGranted, out: List[Instruction]) -> None:
        found = self._lane_of(e.consumer, e.run)
        if found is None:
            return
        run, lane = found
        self._on_alive(ev.ConsumerAlive(e.now, e.consumer), out)
        lane.granted = max(lane.granted, min(e.total, lane.delivered + MAX_GRANT_AHEAD))
        if e.consumed > lane.consumed:
            lane.consumed = min(e.consumed, lane.delivered)
            if isinstance(run.dispatch, SeqDispatch):
                run.dispatch.forget(lane.rank, lane.start + lane.consumed)
            if lane.done:
                self._check_finished(run, out)
        if not lane.connected:
            lane.connected = True
            out.extend(lane.held)
            lane.held.clear()

    def _on_missing(self, e: ev.MissingReported, out: List[Instruction]) -> None:
        found = self._lane_of(e.consumer, e.run)
        if found is None:
            return
        run, lane = found
        if run.lane_of(e.pos) is lane and isinstance(run.dispatch, SeqDispatch) and run.dispatch.lost(e.pos):
            self.lost_direct += 1
            log.warning(
                "%s of job %r did not get seq %d of epoch %d sent to it directly: made again, sent by the server",
                run.job.who(lane.rank),
                run.job.name,
                e.pos,
                run.epoch,
            )

    def _router(self, run: Run) -> Callable[[int], bytes]:
        """Where a position's result goes directly: its lane's consumer, if that one takes direct results."""
        lanes, width = run.lanes, run.width

        def route(pos: int) -> bytes:
            lane = lanes.get(pos % width)
            if lane is None or not lane.direct or lane.consumer is None or lane.gone:
                return b""
            return lane.consumer

        return route

    def _on_alive(self, e: ev.ConsumerAlive, out: List[Instruction]) -> None:
        client = self.job.clients.get(e.consumer) if self.job is not None else None
        if client is not None:
            client.alive_at = e.now

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
        for lane in run.lanes.values():
            if lane.consumer is not None and not lane.gone and not lane.done:
                self._flush(run, lane, out)
                self._to_lane(
                    run,
                    lane,
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

    def _supersede(self, run: Run, epoch: int, out: List[Instruction]) -> None:
        log.info("epoch %d (run %d) superseded", run.epoch, run.run)
        for lane in run.lanes.values():
            if lane.consumer is not None and not lane.gone and not lane.done:
                self._to_lane(run, lane, Superseded(run=run.run, epoch=epoch), out)
        self._close(run, "superseded", out)

    def _check_finished(self, run: Run, out: List[Instruction]) -> None:
        """A run ends when every lane has settled: ended (its direct seqs all taken) or left."""
        if run.live and not run.expecting() and all(lane.settled for lane in run.lanes.values()):
            self._close(run, "done" if any(lane.done for lane in run.lanes.values()) else "superseded", out)

    def _close(self, run: Run, state: str, out: List[Instruction]) -> None:
        if state == "done":
            elapsed = max(self.now - (run.started or run.requested), 1e-9)
            delivered = sum(lane.delivered for lane in run.lanes.values())
            unit = "batches" if run.job.batching is not None else "seqs"
            log.info(
                "epoch %d (run %d) done: %d %s in %.2f s (%.1f %s/s)",
                run.epoch,
                run.run,
                delivered,
                unit,
                elapsed,
                delivered / elapsed,
                unit,
            )
        run.state = state
        run.ended = self.now
        self.runs.pop(run.run, None)
        run.job.runs.pop(run.run, None)
        for lane in run.lanes.values():
            if lane.consumer is not None and lane.held:
                self.unheard[(run.run, lane.consumer)] = (run, lane)
            lane.ready.clear()
        while len(self.unheard) > UNHEARD_MAX:
            self.unheard.pop(next(iter(self.unheard)))
        if not run.reading_stopped:
            run.reading_stopped = True
            out.append(StopReading(run.run))
        if run.dispatch is not None:
            for w in self.workers.values():
                out.append(ToWorker(w.wid, RunClose(run=run.run)))
            run.dispatch.close(self.workers)

    # ---- the step after every event ---------------------------------------------------------------
    def _running(self) -> List[Run]:
        return [r for r in self.runs.values() if r.dispatch is not None]

    def _pump(self, out: List[Instruction]) -> None:
        capacity = sum(w.capacity for w in self.workers.values())
        for run in self._running():
            d = run.dispatch
            assert d is not None
            d.dispatch(self.workers, out)
            if isinstance(d, SeqDispatch) and d.late:
                self._send_late(run, d, out)
            self._release(run, out)
            for lane in run.lanes.values():
                self._flush(run, lane, out)
            self._finish_lanes(run, out)
            if not run.live:
                continue
            if not run.reading_stopped:
                positions = d.requests(capacity)
                if positions:
                    out.append(Read(run.run, positions))
                if d.reading_done():
                    run.reading_stopped = True
                    out.append(StopReading(run.run))

    def _send_late(self, run: Run, d: SeqDispatch, out: List[Instruction]) -> None:
        """Lost direct results made again go to their consumer at once (they were released)."""
        for item in d.late:
            lane = run.lane_of(item.pos)
            if lane is not None and lane.consumer is not None and not lane.gone:
                out.append(ToClient(lane.consumer, Seqs(run=run.run), [item]))
        d.late.clear()

    def _room(self, run: Run) -> Callable[[int], bool]:
        """Whether the output at a position may be released now (outputs no one wants always may:
        they are dropped)."""
        width = run.width
        lanes = run.lanes
        group = run.group
        absent_gone, base = run.absent_gone, run.base

        def room(pos: int) -> bool:
            lane = lanes.get(pos % width)
            if lane is None:  # its reader has not come
                if absent_gone or pos // width < base:
                    return True
                run.held_by = pos % width
                return False
            if lane.gone or pos // width < lane.start:
                return True
            run.held_by = lane.rank  # (until it has room: then the release goes on past it)
            if lane.consumer is None:
                return False  # the rank has not come yet: its seqs wait (and so does the epoch)
            waiting = len(lane.ready)
            if group:
                waiting += sum(1 for it in group if it.pos % width == lane.rank)
            if lane.credit - waiting > 0:
                run.held_by = None
                return True
            return False

        return room

    def _release(self, run: Run, out: List[Instruction]) -> None:
        """Move outputs in epoch order into their ranks' lanes, as far as their credit allows."""
        d = run.dispatch
        assert d is not None
        room = self._room(run)
        run.held_by = None
        world = run.job.world  # drop_last works in groups of the ranks
        stream = isinstance(d, StreamDispatch)
        # with drop_last and the count not known yet, a group of W goes out only once complete
        hold = run.job.drop_last and world > 1 and run.total is None
        end = run.end()
        while True:
            item: Optional[Union[Item, Batch]]
            if run.cutter is not None:
                item = self._pop_batch(run, out, room)
            else:
                item = d.pop_next(out, room)
                if item is not None and stream:
                    self._clamp(run, item)
            if item is None:
                break
            if hold:
                run.group.append(item)
                if len(run.group) == world:
                    for it in run.group:
                        self._to_ready(run, it, end)
                    run.group.clear()
            else:
                self._to_ready(run, item, end)
        if stream and run.total is None and run.cutter is None:
            run.total = d.total()
        if run.total is not None and run.group:
            end = run.end()
            for it in run.group:  # the epoch's count is known: the group is in end() or dropped
                self._to_ready(run, it, end)
            run.group.clear()

    def _pop_batch(self, run: Run, out: List[Instruction], room: Callable[[int], bool]) -> Optional[Batch]:
        """map_seq_stream with batching: the next batch cut from the merged outputs, if its lane
        has room. Outputs are taken (in merged order) only while no cut batch waits, so the run
        holds at most one bucket window of them beyond what the lanes' credit allows."""
        d, cutter = run.dispatch, run.cutter
        assert isinstance(d, StreamDispatch) and cutter is not None
        key = run.job.batching.length_key if run.job.batching is not None else None
        while not run.cut:
            item = d.pop_next(out, lambda pos: True)
            if item is None:
                if run.total is None and d.total() is not None:  # every output is out: cut the rest
                    self._add_batches(run, cutter.finish())
                    run.total = cutter.count
                    continue
                return None
            self._clamp(run, item)
            run.uncut[item.pos] = item
            self._add_batches(run, cutter.add(item.pos, _length(item, key)))
        batch = run.cut[0]
        if not room(batch.pos):
            return None
        return run.cut.popleft()

    @staticmethod
    def _add_batches(run: Run, cut: List[List[int]]) -> None:
        for positions in cut:
            items = [run.uncut.pop(p) for p in positions]
            for item in items:
                item.batch, item.size = run.batches_cut, len(items)
            run.cut.append(Batch(run.batches_cut, items))
            run.batches_cut += 1

    @staticmethod
    def _to_ready(run: Run, item: Union[Item, Batch], end: Optional[int]) -> None:
        """Into its rank's lane (`end`: run.end(), passed in: this runs once per seq)."""
        width = run.job.lanes
        lane = run.lanes.get(item.pos % width)
        if lane is None:
            return  # its reader has not come: only outputs no one wants are released for it
        index = item.pos // width
        if index >= lane.released:
            lane.released = index + 1
        if lane.gone or index < lane.start or (end is not None and item.pos >= end):
            return  # no one wants it
        lane.ready.append(item)

    @staticmethod
    def _clamp(run: Run, item: Item) -> None:
        """A stream's merged complete_frac never decreases (each partition's does on its own)."""
        cf = item.meta.get("complete_frac")
        if cf is not None:
            if cf > run.complete_frac:
                run.complete_frac = cf
            elif cf < run.complete_frac:
                item.meta = {**item.meta, "complete_frac": run.complete_frac}

    def _flush(self, run: Run, lane: Lane, out: List[Instruction]) -> None:
        batch = self.settings.max_delivery_batch
        while lane.ready:
            items = [lane.ready.popleft() for _ in range(min(batch, len(lane.ready)))]
            lane.delivered += len(items)
            lane.delivered_bytes += sum(i.nbytes for i in items)
            self.total_delivered += sum(i.seqs for i in items)
            sent: List[Item] = []
            for i in items:
                if isinstance(i, Batch):
                    sent += i.items  # cut, not padded: the seqs name their batch, the client pads them
                elif not i.direct:  # direct ones are at the consumer already
                    sent.append(i)
            if sent:
                out.append(ToClient(lane.consumer, Seqs(run=run.run), sent))  # type: ignore[arg-type]

    def _finish_lanes(self, run: Run, out: List[Instruction]) -> None:
        for lane in run.lanes.values():
            if lane.done or lane.gone or lane.consumer is None:
                continue
            size = run.shard_size(lane.rank)
            if size is not None and not lane.ready and max(lane.released, lane.start) >= size:
                lane.done = True
                run.job.finish(run.epoch, lane.rank)
                self._to_lane(run, lane, End(run=run.run, count=lane.delivered), out)
                log.info(
                    "%s of job %r finished epoch %d (run %d): %d %s",
                    run.job.who(lane.rank),
                    run.job.name,
                    run.epoch,
                    run.run,
                    lane.delivered,
                    "batches" if run.job.batching is not None else "seqs",
                )
        self._check_finished(run, out)

    def _to_lane(self, run: Run, lane: Lane, msg: Message, out: List[Instruction]) -> None:
        if lane.consumer is None:
            return
        instr = ToClient(lane.consumer, msg)
        if lane.connected:
            out.append(instr)
        else:
            lane.held.append(instr)

    # ---- status ---------------------------------------------------------------------------------
    def _holdup(self, run: Run, lane: Optional[Lane] = None) -> Tuple[str, bool]:
        """What the run (or a rank of it) waits for, in words (keepalives and status), and whether
        that is other readers whose clients live (their batch sizes, or room for their seqs)."""
        if run.dispatch is None:
            busy = f" ({self.reader_busy})" if self.reader_busy else ""
            return f"the dataset to set up the epoch{busy}", False
        job = run.job
        if not self.workers:
            return "a worker (none is connected)", False
        if any(ln.credit <= 0 and ln.live for ln in ([lane] if lane is not None else run.lanes.values())):
            return "the trainer (no credit)", False
        held = run.lanes.get(run.held_by) if run.held_by is not None else None
        if held is not None and held is not lane and held.consumer in job.clients:
            return f"{job.who(held.rank)} of job {job.name!r} to take its seqs (the next one waits for credit)", True
        missing = run.awaited(8)
        if missing:
            return f"rank(s) {', '.join(map(str, missing[:8]))} of job {run.job.name!r} to connect", False
        q = run.dispatch.queues()
        if q["in_flight"]:
            return f"the workers ({q['in_flight']} in flight)", False
        if self.reader_busy:
            return f"the dataset ({self.reader_busy})", False
        return "the dataset", False

    def status(self, now: float) -> Dict[str, Any]:
        st: Dict[str, Any] = {
            "workers_alive": len(self.workers),
            "workers": [w.describe(now) for w in self.workers.values()],
            "seqs_delivered_total": self.total_delivered,
            "malformed_results": self.malformed_results,
            "lost_direct_results": self.lost_direct,
            "lost_inputs": self.lost_inputs,
            "dropped_by_workers": self.dropped_by_workers,
            "departures": {d.value: n for d, n in self.departures.items()},
            "handed_back": self.handed_back,
            "job": None,
            "ranks": [],
        }
        job = self.job
        if job is not None:
            st["job"] = {
                **job.describe(),
                "runs": sorted(job.runs),
                "epochs": sorted({r.epoch for r in job.runs.values()}),
            }
            for run in sorted(job.runs.values(), key=lambda r: r.run):
                for _, lane in sorted(run.lanes.items()):
                    if lane.consumer is None or lane.gone:
                        continue
                    size = run.shard_size(lane.rank)
                    took = max(now - lane.attached_at, 1e-9)
                    st["ranks"].append(
                        {
                            "rank": lane.rank % job.world,
                            "subshard": lane.rank // job.world,
                            "epoch": run.epoch,
                            "run": run.run,
                            "solo": run.solo is not None,
                            "position": lane.start + lane.delivered,
                            "shard_size": size,
                            "seqs_per_sec": round(lane.delivered / took, 2),
                            "done": lane.done,
                            "last_heard_s": round(now - job.clients[lane.consumer].alive_at, 1)
                            if lane.consumer in job.clients
                            else None,
                            "credit": max(lane.credit, 0),
                        }
                    )
        last = self.last_run
        if last is None:
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
        began = last.started if last.started is not None else last.requested
        end = now if last.ended is None else last.ended
        delivered = sum(lane.delivered for lane in last.lanes.values())
        st.update(
            {
                "epoch": last.epoch,
                "run": last.run,
                "state": last.state,
                "num_seqs": last.total,
                "seqs_delivered": delivered,
                "seqs_per_sec": round(delivered / max(end - began, 1e-9), 2),
                "mb_delivered": round(sum(lane.delivered_bytes for lane in last.lanes.values()) / 1e6, 3),
                "error": last.error,
                "waiting_for": self._holdup(last)[0] if last.live else None,
                "queues": {
                    **(last.dispatch.queues() if last.dispatch is not None and last.live else {}),
                    "client_credit": sum(max(lane.credit, 0) for lane in last.lanes.values() if lane.live),
                },
            }
        )
        return st


def _readers(n: int) -> str:
    """A rank's number of readers, in the words of a PyTorch user."""
    if n == 1:
        return "1 reader per rank, i.e. DataLoader num_workers 0 or 1"
    return f"{n} readers per rank, i.e. DataLoader num_workers {n}"


def _inputs(run: Run, stream: bool) -> str:
    """What a run's reader reads, in words: its input seqs, or the batches it cuts."""
    return "batches" if run.job.batching is not None and not stream else "input seqs"


def _run_open(run: Run) -> RunOpen:
    batching = run.job.batching
    pad = dict(batching.pad) if batching is not None else {}
    return RunOpen(run=run.run, epoch=run.epoch, check_tags=run.seq_list is not None, pad=pad)


def _length(item: Item, key: Optional[str]) -> int:
    """An output's length for the cut: the first axis of its `key` (None: `data`, else its first array)."""
    for name, _, shape in item.arrays:
        if name == key or (key is None and name == "data"):
            return shape[0] if shape else 1
    if key is None and item.arrays:
        shape = item.arrays[0][2]
        return shape[0] if shape else 1
    return 1


def _batching(batching: Optional[Any]) -> str:
    return "one seq at a time" if batching is None else f"batches of {batching.describe()}"


def _too_many(world: int, readers: int) -> str:
    """The refusal of a job with more readers than MAX_READERS, in one line."""
    if readers == 1:
        return f"world_size {world} is above the {MAX_READERS} readers a job may have"
    return (
        f"world_size {world} x {readers} readers per rank (DataLoader num_workers {readers}) = {world * readers} "
        f"readers, above the {MAX_READERS} a job may have"
    )


def _describe_exit(rc: int) -> str:
    import signal

    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"
