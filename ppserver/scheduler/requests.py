"""Epoch requests: refusing them, the job, new runs, and readers coming and going.

A rank joins the job's run of its epoch, or starts it. A rank that asks for the epoch it is
in again, from index k of its shard (a restarted trainer), takes its lane over if nothing from
k on has been released to it yet; otherwise a solo run serves its shard from k, read and
mapped again, and the main run drops that rank's seqs. A rank leaves its other runs only once
the reader has checked its request (RunChecked), so a refused request disturbs nothing. One
job at a time: another job is refused while any of this one's clients lives; a client is gone
once it closed, or after its timeout without a keepalive or credit.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from ppclient.batching import describe as describe_batching
from ppclient.protocol import ConsumerGone, ConsumerRoute, EpochAccepted, ErrorReply, RefusalReason, Superseded
from ppserver.scheduler import events as ev
from ppserver.scheduler.delivery import heard, started_message, to_lane
from ppserver.scheduler.instructions import Instruction, Prepare, Reply, ToWorker
from ppserver.scheduler.jobs import Client, Job, Run
from ppserver.scheduler.runs import Lifecycle
from ppserver.scheduler.state import SchedulerState

log = logging.getLogger("ppserver.scheduler")

MAX_EPOCHS = 2  # a job's runs span at most this many epochs (one being finished, the next one)
# A job may have at most this many readers (world_size * readers per rank): each holds a connection
# of its own to the server, so a job above it could never have them all connected. (Below it, a
# reader costs nothing until it comes: see jobs.py.)
MAX_READERS = 1 << 16


class Requests:
    """The job, its runs and their readers; a run superseded or left by its readers ends
    through `lifecycle`."""

    def __init__(self, state: SchedulerState, lifecycle: Lifecycle):
        self.state = state
        self.lifecycle = lifecycle

    def request(self, e: ev.EpochRequested, out: List[Instruction]) -> None:
        malformed = form_error(e)
        refused = (RefusalReason.REQUEST, malformed) if malformed is not None else refusal(self.state.job, e)
        if refused is not None:
            reason, why = refused
            log.warning("refused epoch %d for rank %d of job %r: %s", e.epoch, e.rank, e.job, why)
            out.append(Reply(e.requester, ErrorReply(error=why, reason=reason.value)))
            return
        job = self._job_for(e, out)
        main = main_run(job, e.epoch)
        if main is not None and _can_attach(main, e):
            self._attach(main, e, out)
            target = main
        else:
            target = self._new_run(job, e, solo=e.lane if main is not None else None, out=out)
        settings = self.state.settings
        accepted = EpochAccepted(run=target.run, instance=settings.instance, fingerprint=settings.fingerprint)
        out.append(Reply(e.requester, accepted))

    def _job_for(self, e: ev.EpochRequested, out: List[Instruction]) -> Job:
        job = self.state.job
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
                self.lifecycle.supersede(run, e.epoch, out)
        job = self.state.job = Job(e.job, e.world_size, e.drop_last, e.subshards, e.batching, e.sharding)
        kind = (e.drop_last, readers(e.subshards), describe_batching(e.batching), e.sharding)
        log.info("job %r: world_size %d, drop_last %s, %s, %s, %s shards", e.job, e.world_size, *kind)
        return job

    def _attach(self, run: Run, e: ev.EpochRequested, out: List[Instruction]) -> None:
        lane = run.lane(e.lane)
        if lane.consumer is not None and lane.consumer != e.consumer and not lane.gone:
            to_lane(lane, Superseded(run=run.run, epoch=run.epoch), out)
        lane.attach(e.consumer, e.start, e.now, run.width)
        known = run.job.clients.get(e.consumer)
        client = run.job.clients[e.consumer] = Client(e.lane, e.timeout, e.now)
        if e.direct and self.state.settings.direct:
            client.route = ConsumerRoute(consumer=e.consumer, endpoint=e.direct, key=e.direct_key, host=e.host)
            if known is None or known.route != client.route:
                for wid in self.state.workers:
                    out.append(ToWorker(wid, client.route))
        lane.direct = client.route is not None
        who = run.job.who(e.lane)
        log.info(
            "%s of job %r reads epoch %d (run %d) from %s %d of its shard",
            who,
            run.job.name,
            run.epoch,
            run.run,
            run.job.unit,
            e.start,
        )
        if run.accepted:
            self._leave_others(run, e.lane, out)
        if run.dispatch is not None:
            to_lane(lane, started_message(run, lane, self.state.settings.fingerprint), out)

    def _new_run(self, job: Job, e: ev.EpochRequested, *, solo: Optional[int], out: List[Instruction]) -> Run:
        state = self.state
        run = Run(
            run=state.next_run,
            job=job,
            epoch=e.epoch,
            requested=e.now,
            seq_list=e.seq_list,
            seq_order=e.seq_order,
            solo=solo,
            base=e.start,
            story=state.story_log,
        )
        state.next_run += 1
        # Ranks that have not come yet are expected where this one starts (DDP ranks resume
        # together), unless they are done with this epoch (in a solo run, none is): a lane gets
        # state of its own only when its reader comes, or here if it is not expected.
        if solo is None:
            for index in job.unexpected(e.epoch) - {e.lane}:
                run.lane(index).leave()
        job.runs[run.run] = run
        state.runs[run.run] = run
        state.last_run = run
        self._attach(run, e, out)
        batching = None if state.settings.stream else job.batching
        out.append(Prepare(run.run, e.epoch, e.seq_list, e.seq_order, batching, job.contiguous))
        if solo is not None:
            log.info(
                "%s of job %r resumes epoch %d at %s %d of its shard, behind the job's run: "
                "run %d reads and maps its shard again",
                job.who(solo),
                job.name,
                e.epoch,
                job.unit,
                e.start,
                run.run,
            )
        return run

    def checked(self, e: ev.RunChecked, out: List[Instruction]) -> None:
        """The reader accepted the run's request: its readers leave their other runs."""
        run = self.state.runs.get(e.run)
        if run is None:
            return
        run.accept()
        for lane in list(run.lanes.values()):
            if lane.consumer is not None and not lane.gone:
                self._leave_others(run, lane.index, out)

    def _leave_others(self, run: Run, index: int, out: List[Instruction]) -> None:
        """The reader of lane `index` now reads `run`: its lanes in the job's other runs are dropped."""
        for other in list(run.job.runs.values()):
            if other is run or other.view(index).gone:
                continue
            lane = other.lane(index)
            if lane.consumer is not None and not lane.done:
                to_lane(lane, Superseded(run=other.run, epoch=run.epoch), out)
            lane.leave()
            self.lifecycle.check_finished(other, out)

    # ---- clients -------------------------------------------------------------------------------
    def alive(self, e: ev.ConsumerAlive, out: List[Instruction]) -> None:
        heard(self.state.job, e.consumer, e.now)

    def closed(self, e: ev.ConsumerClosed, out: List[Instruction]) -> None:
        self.gone(e.consumer, "closed", out, closed=True)

    def expire(self, now: float, out: List[Instruction]) -> None:
        """Clients silent for their timeout are gone."""
        job = self.state.job
        if job is not None:
            for consumer, client in list(job.clients.items()):
                if now - client.alive_at > client.timeout:
                    self.gone(consumer, f"silent for {now - client.alive_at:.1f} s", out)

    def gone(self, consumer: bytes, why: str, out: List[Instruction], closed: bool = False) -> None:
        """A client closed or went silent: its lanes are dropped (the rank may resume later).
        `closed`: it said so, and takes nothing more: the workers free the blocks it never took."""
        job = self.state.job
        client = job.clients.pop(consumer, None) if job is not None else None
        if job is None or client is None:
            return
        if client.route is not None:
            for wid in self.state.workers:
                out.append(ToWorker(wid, ConsumerGone(consumer=consumer, closed=closed)))
        for run, lane in job.lanes_of(consumer):
            if lane.gone:
                continue
            who = job.who(lane.index)
            log.warning("%s of job %r (epoch %d, run %d) gone: client %s", who, job.name, run.epoch, run.run, why)
            lane.leave()
            self.lifecycle.check_finished(run, out)


def main_run(job: Job, epoch: int) -> Optional[Run]:
    """The job's live run of `epoch` that is not a solo run, if there is one."""
    for run in job.runs.values():
        if run.epoch == epoch and run.solo is None and run.live:
            return run
    return None


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


def form_error(e: ev.EpochRequested) -> Optional[str]:
    """Why the request can never be served, whatever the job (one line), or None."""
    if not 0 <= e.rank < e.world_size:
        return f"rank {e.rank} is not below world_size {e.world_size}"
    if not 0 <= e.subshard < e.subshards:
        return f"reader {e.subshard} of a rank is not below its number of readers {e.subshards}"
    if e.world_size * e.subshards > MAX_READERS:
        return _too_many(e.world_size, e.subshards)
    return None


def refusal(job: Optional[Job], e: ev.EpochRequested) -> Optional[Tuple[RefusalReason, str]]:
    """Why the request cannot be served while the job's other clients live, or None: the error
    reply's reason and one line. JOB: another job, or this one with other settings (it may pass
    once those clients are gone: a client asks again for a moment, see client.py); EPOCH: an
    epoch the job's ranks do not read together (another seq selection, too far apart)."""
    others = [client for consumer, client in job.clients.items() if consumer != e.consumer] if job else []
    if job is None or not others:
        return None  # no job, or one whose clients are all gone: this request starts a new one
    if e.job_key != job.key:
        return RefusalReason.JOB, _conflict(job, e, others)
    why = _epoch_refusal(job, e)
    return None if why is None else (RefusalReason.EPOCH, why)


def _epoch_refusal(job: Job, e: ev.EpochRequested) -> Optional[str]:
    """Why this job cannot serve the epoch `e` asks for now, or None."""
    main = main_run(job, e.epoch)
    if main is not None:
        if (main.seq_list, main.seq_order) != (e.seq_list, e.seq_order):
            return f"epoch {e.epoch} of job {job.name!r} runs with another seq_list/seq_order"
        return None
    # Only what other ranks still read constrains this one: it leaves its own runs anyway.
    epochs = {
        run.epoch
        for run in job.runs.values()
        if run.expecting(besides=e.lane)
        or any(lane.index != e.lane and not lane.gone and not lane.done for lane in run.lanes.values())
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


def _conflict(job: Job, e: ev.EpochRequested, others: List[Client]) -> str:
    """The refusal of a request of another job, or of this one with other settings."""
    clients = f"{len(others)} live client{'s' if len(others) != 1 else ''}"
    one = len(others) == 1
    timeout = max(c.timeout for c in others)
    gone = f"closed, or silent for {'its' if one else 'their'} client timeout of {timeout:g} s"
    if e.job != job.name:
        return (
            f"job {job.name!r} is running with {clients} (world_size {job.world}, "
            f"drop_last {job.drop_last}, {readers(job.subshards)}); a request of job {e.job!r} must "
            f"wait until {'it is' if one else 'they are'} gone ({gone})"
        )
    mine: Dict[str, Any] = {"world_size": job.world, "drop_last": job.drop_last, "readers": job.subshards}
    asked: Dict[str, Any] = {"world_size": e.world_size, "drop_last": e.drop_last, "readers": e.subshards}
    mine["sharding"], asked["sharding"] = job.sharding, e.sharding
    conflicts = [
        f"{readers(asked[k])}, where the job has {readers(mine[k])}"
        if k == "readers"
        else f"{k} {asked[k]}, where the job has {k} {mine[k]}"
        for k in mine
        if mine[k] != asked[k]
    ]
    if e.batching != job.batching:
        conflicts.append(f"{describe_batching(e.batching)}, where the job has {describe_batching(job.batching)}")
    return (
        f"this request of job {job.name!r} conflicts with the job's {clients}: "
        f"{'; '.join(conflicts)}. Every rank of a job must use the same world_size, drop_last, "
        f"DataLoader num_workers, batching and sharding; the job keeps its settings until "
        f"{'that client is' if one else 'they are'} gone ({gone})"
    )


def readers(n: int) -> str:
    """A rank's number of readers, in the words of a PyTorch user."""
    if n == 1:
        return "1 reader per rank, i.e. DataLoader num_workers 0 or 1"
    return f"{n} readers per rank, i.e. DataLoader num_workers {n}"


def _too_many(world: int, per_rank: int) -> str:
    """The refusal of a job with more readers than MAX_READERS, in one line."""
    if per_rank == 1:
        return f"world_size {world} is above the {MAX_READERS} readers a job may have"
    return (
        f"world_size {world} x {per_rank} readers per rank (DataLoader num_workers {per_rank}) = "
        f"{world * per_rank} readers, above the {MAX_READERS} a job may have"
    )
