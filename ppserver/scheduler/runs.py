"""A run's life: the reader's answers while it prepares, its dispatch while it runs, and how it
ends. Its states and their moves are `jobs.RunState`'s, beside the Run that holds one
(docs/protocol.md, run states); this module decides the moves, which `Run.to` makes and tells
to the story. An ended
run is forgotten at once: its workers drop it (`run_close`), the reader stops reading it, and
only a client that has not connected yet still hears its last words (`unheard`, briefly).
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

from ppclient.protocol import FailureKind, RunClose, RunFailed, RunOpen, Superseded
from ppserver.scheduler import events as ev
from ppserver.scheduler.cut import Cutter
from ppserver.scheduler.delivery import StreamCut, flush, started_message, to_lane
from ppserver.scheduler.dispatch import Dispatch, StreamWork
from ppserver.scheduler.instructions import Instruction, StopReading, ToWorker
from ppserver.scheduler.jobs import GONE, Run, RunState
from ppserver.scheduler.seqs import SeqDispatch
from ppserver.scheduler.settings import Failure
from ppserver.scheduler.skips import Skips
from ppserver.scheduler.state import SchedulerState
from ppserver.scheduler.streams import StreamDispatch

log = logging.getLogger("ppserver.scheduler")

UNHEARD_MAX = 64  # ended lanes kept for a client that has not connected yet
UNHEARD_S = 60.0


class Lifecycle:
    """The reader's answers about runs, and how runs end. Once a run's count of seqs is known,
    its skipped seqs may be too many: `skips` says."""

    def __init__(self, state: SchedulerState, skips: Skips):
        self.state = state
        self.skips = skips

    # ---- preparing --------------------------------------------------------------------------
    def rejected(self, e: ev.RunRejected, out: List[Instruction]) -> None:
        self.fail_id(e.run, Failure(FailureKind.REQUEST, e.message), out)

    def started(self, e: ev.RunStarted, out: List[Instruction]) -> None:
        run = self.state.runs.get(e.run)
        if run is None:
            out.append(StopReading(e.run))  # it ended meanwhile
            return
        s = self.state.settings
        run.open_reading()
        run.num_seqs = e.num_seqs
        run.seqs = e.seqs if e.seqs is not None or run.job.batching is not None else e.num_seqs
        run.started = e.now
        run.to(RunState.RUNNING)
        dispatch = run.dispatch = self._dispatch(run, e.num_seqs)
        if s.stream and run.job.batching is not None:
            run.cutting = StreamCut(Cutter(run.job.batching), run.job.batching.length_key)
        if dispatch.one_output_per_input and run.cutting is None:  # batches: counted once all are cut
            run.total = e.num_seqs
        count = "an unknown number of" if e.num_seqs is None else str(e.num_seqs)
        log.info("epoch %d started (run %d, %s %s)", run.epoch, run.run, count, _inputs(run, s.stream))
        for lane in run.lanes.values():
            if lane.consumer is not None and not lane.gone:
                to_lane(lane, started_message(run, lane, s.fingerprint), out)
        for w in self.state.workers.values():
            out.append(ToWorker(w.wid, run_open(run)))

    def _seqs_known(self, run: Run, out: List[Instruction]) -> None:
        """The epoch's count of seqs is known now: the seqs skipped so far may be too many."""
        self.fail_id(run.run, self.skips.over(run), out)

    def _dispatch(self, run: Run, num_seqs: Optional[int]) -> Dispatch:
        s = self.state.settings
        if s.stream:
            return StreamDispatch(run.run, num_seqs, s, story=self.state.story_log)
        return SeqDispatch(
            run.run,
            num_seqs,
            s,
            wanted=run.wanted,
            next_wanted=run.next_wanted,
            end=run.end_of(num_seqs),
            first=run.next_wanted(0) or 0,
            route=self._router(run) if s.direct else None,
            width=run.width,
            strict=self.state.strict,
            batched=run.job.batching is not None,
            story=self.state.story_log,
        )

    @staticmethod
    def _router(run: Run) -> Callable[[int], Optional[bytes]]:
        """Where a position's result goes directly: its lane's consumer, if that one takes direct
        results (None: through the server)."""
        lanes, width = run.lanes, run.width

        def route(pos: int) -> Optional[bytes]:
            lane = lanes.get(pos % width)
            if lane is None or not lane.direct or lane.state is GONE:
                return None
            return lane.consumer

        return route

    def inputs(self, e: ev.InputsRead, out: List[Instruction]) -> None:
        run = self.state.runs.get(e.run)
        if run is not None and run.dispatch is not None:
            run.dispatch.add_inputs(e.items)

    def inputs_ended(self, e: ev.InputsEnded, out: List[Instruction]) -> None:
        run = self.state.runs.get(e.run)
        if run is None or run.dispatch is None or run.num_seqs is not None:
            return  # the first end the reader found stands
        run.num_seqs = e.count
        if run.dispatch.one_output_per_input and run.cutting is None:
            run.total = e.count
        run.dispatch.inputs_ended(e.count, run.end())
        log.info("epoch %d (run %d) has %d %s", run.epoch, run.run, e.count, _inputs(run, self.state.settings.stream))
        if run.seqs is None:
            run.seqs = e.seqs if e.seqs is not None or run.job.batching is not None else e.count
            self._seqs_known(run, out)

    def replayed(self, e: ev.ReplayRead, out: List[Instruction]) -> None:
        run = self.state.runs.get(e.run)
        if run is not None and isinstance(run.dispatch, StreamWork):
            run.dispatch.replay_read(e.partition, e.ticket, e.items)

    # ---- ending ------------------------------------------------------------------------------
    def fail_id(self, run_id: int, failure: Optional[Failure], out: List[Instruction]) -> None:
        """Fail the run if it is live and there is a failure."""
        run = self.state.runs.get(run_id)
        if run is not None and failure is not None:
            self.fail(run, failure, out)

    def fail(self, run: Run, failure: Failure, out: List[Instruction]) -> None:
        log.error("epoch %d (run %d) failed: %s", run.epoch, run.run, failure.message)
        run.error = failure.message
        msg = RunFailed(
            run=run.run,
            failure=failure.kind.value,
            message=failure.message,
            seq_tag=failure.seq_tag,
            traceback=failure.traceback,
        )
        for lane in run.lanes.values():
            if lane.live:
                self.state.total_delivered += flush(run.run, lane, self.state.settings.max_delivery_batch, out)
                to_lane(lane, msg, out)
        self.close(run, RunState.FAILED, out)

    def supersede(self, run: Run, epoch: int, out: List[Instruction]) -> None:
        log.info("epoch %d (run %d) superseded", run.epoch, run.run)
        for lane in run.lanes.values():
            if lane.live:
                to_lane(lane, Superseded(run=run.run, epoch=epoch), out)
        self.close(run, RunState.SUPERSEDED, out)

    def check_finished(self, run: Run, out: List[Instruction]) -> None:
        """A run ends when every lane has settled: ended (its direct seqs all taken) or left."""
        if run.live and not run.expecting() and all(lane.settled for lane in run.lanes.values()):
            done = any(lane.ended for lane in run.lanes.values())
            self.close(run, RunState.DONE if done else RunState.SUPERSEDED, out)

    def close(self, run: Run, state: RunState, out: List[Instruction]) -> None:
        if state is RunState.DONE:
            elapsed = max(self.state.now - (run.started or run.requested), 1e-9)
            delivered = sum(lane.delivered for lane in run.lanes.values())
            unit = run.job.units
            rate = delivered / elapsed
            log.info(
                "epoch %d (run %d) done: %d %s in %.2f s (%.1f %s/s)",
                run.epoch,
                run.run,
                delivered,
                unit,
                elapsed,
                rate,
                unit,
            )
        if run.skipped:
            log.info("epoch %d (run %d): map_seq skipped %d seqs", run.epoch, run.run, run.skipped)
        run.to(state, run.error or "")
        run.ended = self.state.now
        self.state.runs.pop(run.run, None)
        run.job.runs.pop(run.run, None)
        unheard = self.state.unheard
        for lane in run.lanes.values():
            if lane.consumer is not None and lane.held:
                unheard[(run.run, lane.consumer)] = (run, lane)
            lane.ready.clear()
        while len(unheard) > UNHEARD_MAX:
            unheard.pop(next(iter(unheard)))
        if run.stop_reading():
            out.append(StopReading(run.run))
        if run.dispatch is not None:
            for w in self.state.workers.values():
                out.append(ToWorker(w.wid, RunClose(run=run.run)))
            run.dispatch.close(self.state.workers)

    def forget_unheard(self, now: float) -> None:
        """Ended lanes whose client never connected are forgotten after a while."""
        unheard = self.state.unheard
        for key, (ended_run, _) in list(unheard.items()):
            if now - (ended_run.ended or now) > UNHEARD_S:
                del unheard[key]


def run_open(run: Run) -> RunOpen:
    batching = run.job.batching
    pad = dict(batching.pad) if batching is not None else {}
    return RunOpen(run=run.run, epoch=run.epoch, check_tags=run.seq_list is not None, pad=pad)


def _inputs(run: Run, stream: bool) -> str:
    """What a run's reader reads, in words: its input seqs, or the batches it cuts."""
    return "batches" if run.job.batching is not None and not stream else "input seqs"
