"""What the scheduler tells about itself: what a run waits for (in words, and the side that is:
the trainer, the workers or the dataset), the keepalives that say so to its clients, and its
status (`ppserver status`), a typed value: the server adds its own part and turns the whole
into the `status_reply` dict in one place (observe/status.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ppclient.batching import Batching
from ppclient.protocol import Keepalive
from ppserver.scheduler.dispatch import Queues
from ppserver.scheduler.instructions import Instruction, ToClient
from ppserver.scheduler.jobs import Lane, Run, RunState
from ppserver.scheduler.state import SchedulerState
from ppserver.scheduler.workers import Departure, WorkerState


class Side(enum.Enum):
    """The side that holds a run back (status's `held_back_by`, the elastic pool's input)."""

    TRAINER = "trainer"  # no credit, or ranks that have not connected (or do not take their seqs)
    WORKERS = "workers"
    DATASET = "dataset"


@dataclass(frozen=True)
class Holdup:
    """What a run (or a rank of it) waits for: in words (keepalives and status) and its side."""

    words: str
    side: Side
    on_readers: bool  # other readers whose clients live (their batch sizes, or room for their seqs)


@dataclass(frozen=True)
class WorkerStatus:
    """A connected worker."""

    id: str
    host: str
    pid: int
    local: bool  # a process of the server's own pool
    seqs_done: int
    in_flight: int  # tasks and stream partitions it holds
    partitions: Tuple[int, ...]  # the stream partitions it holds
    last_heartbeat_s: float
    retiring: bool


@dataclass(frozen=True)
class JobStatus:
    """The job the server serves."""

    name: str
    world_size: int
    drop_last: bool
    subshards: int
    batching: Optional[Batching]
    sharding: str
    clients: int  # live clients
    runs: Tuple[int, ...]  # its live runs
    epochs: Tuple[int, ...]  # their epochs


@dataclass(frozen=True)
class RankStatus:
    """A reader of the job with a live client, in one run."""

    rank: int
    subshard: int
    epoch: int
    run: int
    solo: bool  # a rank's resume behind the job's main run
    position: int  # the next position of its shard it gets
    shard_size: Optional[int]  # None: not known yet
    seqs_per_sec: float
    done: bool
    last_heard_s: Optional[float]  # None: its client is gone
    credit: int


@dataclass(frozen=True)
class RunStatus:
    """The newest run, live or not."""

    epoch: int
    run: int
    state: RunState
    num_seqs: Optional[int]  # outputs of the epoch, once known
    seqs_delivered: int
    seqs_skipped: int
    seqs_per_sec: float
    mb_delivered: float
    error: Optional[str]
    waiting_for: Optional[Holdup]  # what it waits for, while live
    queues: Optional[Queues]  # what waits where in its dispatch, while live (each style's own)
    client_credit: int  # what its live lanes' clients granted and were not sent yet


@dataclass(frozen=True)
class SchedulerStatus:
    """What the scheduler tells about itself at one time."""

    workers: Tuple[WorkerStatus, ...]
    seqs_delivered_total: int
    seqs_skipped_total: int
    malformed_results: int
    lost_direct_results: int
    lost_inputs: int
    dropped_by_workers: int
    departures: Dict[Departure, int]
    handed_back: int
    internal_errors: int  # events whose handler raised (each failed its run)
    job: Optional[JobStatus]
    ranks: Tuple[RankStatus, ...]
    newest: Optional[RunStatus]  # None: no run yet (idle)


def holdup(s: SchedulerState, run: Run, lane: Optional[Lane] = None) -> Holdup:
    """What the run (or a rank of it) waits for: the first of these that holds."""
    if run.dispatch is None:
        busy = f" ({s.reader_busy})" if s.reader_busy is not None else ""
        return Holdup(f"the dataset to set up the epoch{busy}", Side.DATASET, False)
    job = run.job
    if not s.workers:
        return Holdup("a worker (none is connected)", Side.WORKERS, False)
    if any(ln.credit <= 0 and ln.live for ln in ([lane] if lane is not None else run.lanes.values())):
        return Holdup("the trainer (no credit)", Side.TRAINER, False)
    held = run.lanes.get(run.held_by) if run.held_by is not None else None
    if held is not None and held is not lane and held.consumer in job.clients:
        words = f"{job.who(held.index)} of job {job.name!r} to take its seqs (the next one waits for credit)"
        return Holdup(words, Side.TRAINER, True)
    missing = run.awaited(8)
    if missing:
        return Holdup(f"rank(s) {', '.join(map(str, missing))} of job {run.job.name!r} to connect", Side.TRAINER, False)
    in_flight = run.dispatch.in_flight()
    if in_flight:
        return Holdup(f"the workers ({in_flight} in flight)", Side.WORKERS, False)
    if s.reader_busy is not None:
        return Holdup(f"the dataset ({s.reader_busy})", Side.DATASET, False)
    return Holdup("the dataset", Side.DATASET, False)


def keepalives(s: SchedulerState, out: List[Instruction]) -> None:
    """A keepalive to the client of every lane that is not settled, saying what it waits for."""
    for run in s.runs.values():
        for lane in run.lanes.values():
            if lane.consumer is not None and lane.connected and not lane.settled:
                why = holdup(s, run, lane)
                msg = Keepalive(
                    run=run.run,
                    interval=s.settings.heartbeat_interval,
                    workers=len(s.workers),
                    waiting_for=why.words,
                    waits_on_readers=why.on_readers,
                    mapped=run.mapped,
                )
                out.append(ToClient(lane.consumer, msg))


def status(s: SchedulerState, now: float) -> SchedulerStatus:
    job = s.job
    ranks: List[RankStatus] = []
    if job is not None:
        for run in sorted(job.runs.values(), key=lambda r: r.run):
            for _, lane in sorted(run.lanes.items()):
                if lane.consumer is not None and not lane.gone:
                    ranks.append(_rank(run, lane, now))
    return SchedulerStatus(
        workers=tuple(_worker(w, now) for w in s.workers.values()),
        seqs_delivered_total=s.total_delivered,
        seqs_skipped_total=s.skipped_total,
        malformed_results=s.malformed_results,
        lost_direct_results=s.lost_direct,
        lost_inputs=s.lost_inputs,
        dropped_by_workers=s.dropped_by_workers,
        departures=dict(s.departures),
        handed_back=s.handed_back,
        internal_errors=s.internal_errors,
        job=None
        if job is None
        else JobStatus(
            name=job.name,
            world_size=job.world,
            drop_last=job.drop_last,
            subshards=job.subshards,
            batching=job.batching,
            sharding=job.sharding,
            clients=len(job.clients),
            runs=tuple(sorted(job.runs)),
            epochs=tuple(sorted({r.epoch for r in job.runs.values()})),
        ),
        ranks=tuple(ranks),
        newest=None if s.last_run is None else _newest(s, s.last_run, now),
    )


def _worker(w: WorkerState, now: float) -> WorkerStatus:
    return WorkerStatus(
        id=w.name,
        host=w.host,
        pid=w.pid,
        local=w.local_index is not None,
        seqs_done=w.done,
        in_flight=len(w.tasks) + len(w.partitions),
        partitions=tuple(sorted(p for _, p in w.partitions)),
        last_heartbeat_s=round(now - w.last_seen, 3),
        retiring=w.retiring,
    )


def _newest(s: SchedulerState, last: Run, now: float) -> RunStatus:
    began = last.started if last.started is not None else last.requested
    end = now if last.ended is None else last.ended
    delivered = sum(lane.delivered for lane in last.lanes.values())
    return RunStatus(
        epoch=last.epoch,
        run=last.run,
        state=last.state,
        num_seqs=last.total,
        seqs_delivered=delivered,
        seqs_skipped=last.skipped,
        seqs_per_sec=round(delivered / max(end - began, 1e-9), 2),
        mb_delivered=round(sum(lane.delivered_bytes for lane in last.lanes.values()) / 1e6, 3),
        error=last.error,
        waiting_for=holdup(s, last) if last.live else None,
        queues=last.dispatch.queues() if last.dispatch is not None and last.live else None,
        client_credit=sum(max(lane.credit, 0) for lane in last.lanes.values() if lane.live),
    )


def _rank(run: Run, lane: Lane, now: float) -> RankStatus:
    """A reader of the job, for status."""
    job = run.job
    took = max(now - lane.attached_at, 1e-9)
    client = job.clients.get(lane.consumer) if lane.consumer is not None else None
    rank, subshard = job.reader_of(lane.index)
    return RankStatus(
        rank=rank,
        subshard=subshard,
        epoch=run.epoch,
        run=run.run,
        solo=run.solo is not None,
        position=lane.start + lane.delivered,
        shard_size=run.shard_size(lane.index),
        seqs_per_sec=round(lane.delivered / took, 2),
        done=lane.done,
        last_heard_s=round(now - client.alive_at, 1) if client is not None else None,
        credit=max(lane.credit, 0),
    )
