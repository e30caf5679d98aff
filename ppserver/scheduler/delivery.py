"""Delivery: outputs released in epoch order into their lanes, within each rank's credit.

Position i goes to lane i % lanes. The release goes on in epoch order while the next output's
lane has credit for it (an output no one wants is passed over); a lane without room holds the
epoch there (`held_by`, which keepalives name). With drop_last and the epoch's count not known
yet, outputs go out in groups of world_size, so the remainder can still be dropped. A lane's
released outputs leave at once (`flush`, in messages of max_delivery_batch), a lane whose shard
is all released ends (`End`), and a run whose lanes have all settled ends too.

map_seq_stream with batching: the merged outputs are cut into batches here (`StreamCut`), one
bucket window and one batch ahead of the lanes' credit at most; the client pads each batch's seqs,
and a batch whose seqs cannot be padded together fails the run here, for every rank at once.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Deque, Dict, List, Optional, Tuple, Union

import numpy

from ppclient import collate
from ppclient.batching import default_length_key
from ppclient.collate import BatchError
from ppclient.protocol import Batch, End, FailureKind, Item, Message, Seqs, Started
from ppserver.scheduler import events as ev
from ppserver.scheduler.cut import Cutter
from ppserver.scheduler.dispatch import Dispatch, Room, SeqWork, StreamWork
from ppserver.scheduler.instructions import Instruction, ToClient
from ppserver.scheduler.jobs import GONE, READING, Job, Lane, Run
from ppserver.scheduler.settings import Failure
from ppserver.scheduler.state import SchedulerState

if TYPE_CHECKING:
    from ppserver.scheduler.runs import Lifecycle

log = logging.getLogger("ppserver.scheduler")

MAX_GRANT_AHEAD = 1 << 20  # a client cannot make the server hold more than this many seqs


class Delivery:
    """Releasing, sending and ending, and the credit and word of each lane's client. A batch that
    cannot be cut fails its run, and a lane that ends may end it: `lifecycle` does both."""

    def __init__(self, state: SchedulerState, lifecycle: Lifecycle):
        self.state = state
        self.lifecycle = lifecycle

    def deliver(self, run: Run, out: List[Instruction]) -> None:
        """What the run's outputs allow now: late results, the release, the lanes' messages and ends."""
        d = run.dispatch
        assert d is not None
        if isinstance(d, SeqWork) and d.late:  # lost direct results made again: they were released
            for item in d.late:
                lane = run.lane_of(item.pos)
                if lane is not None and lane.consumer is not None and not lane.gone:
                    out.append(ToClient(lane.consumer, Seqs(run=run.run), [item]))
            d.late.clear()
        self._release(run, out)
        if not run.live:  # a batch it cut failed it
            return
        batch = self.state.settings.max_delivery_batch
        for lane in run.lanes.values():
            if lane.ready:
                self.state.total_delivered += flush(run.run, lane, batch, out)
        self._finish_lanes(run, out)

    # ---- the release ------------------------------------------------------------------------
    @staticmethod
    def _room(run: Run) -> Room:
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
            if lane.state is GONE or pos // width < lane.start:
                return True
            run.held_by = lane.index  # (until it has room: then the release goes on past it)
            if lane.consumer is None:
                return False  # the rank has not come yet: its seqs wait (and so does the epoch)
            waiting = len(lane.ready)
            if group:
                waiting += sum(1 for it in group if it.pos % width == lane.index)
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
        # with drop_last and the count not known yet, a group of W goes out only once complete
        hold = run.job.drop_last and world > 1 and run.total is None
        end = run.end()
        while True:
            item: Optional[Union[Item, Batch]]
            if run.cutting is not None:
                item = self._pop_batch(run, out, room)
            else:
                item = d.pop_next(room)
            if item is None:
                break
            if hold:
                run.group.append(item)
                if len(run.group) == world:
                    for it in run.group:
                        _to_ready(run, it, end)
                    run.group.clear()
            else:
                _to_ready(run, item, end)
        _credits(d, out)
        if run.total is None and run.cutting is None:
            run.total = d.total()
        if run.total is not None and run.group:
            end = run.end()
            for it in run.group:  # the epoch's count is known: the group is in end() or dropped
                _to_ready(run, it, end)
            run.group.clear()

    def _pop_batch(self, run: Run, out: List[Instruction], room: Room) -> Optional[Batch]:
        """The next batch cut from the merged outputs, if its lane has room. Outputs are taken (in
        merged order) only while no cut batch waits, so the run holds at most one bucket window
        of them, and the batch being filled, beyond what the lanes' credit allows. A batch whose seqs
        cannot be padded together fails the run (a mapper's failure)."""
        d, cutting = run.dispatch, run.cutting
        assert d is not None and cutting is not None
        try:
            while not cutting.cut:
                item = d.pop_next(lambda pos: True)
                if item is None:
                    if run.total is None and d.total() is not None:  # every output is out: cut the rest
                        run.total = cutting.finish()
                        continue
                    return None
                cutting.add(item)
        except BatchError as exc:  # the mapper's outputs cannot be padded together: as a map_seq batch would fail
            _credits(d, out)  # (for what it took before: sent before the run closes)
            self.lifecycle.fail(run, Failure(FailureKind.MAPPER, f"batch {cutting.count}: {exc}", exc.seq_tag), out)
            return None
        if not room(cutting.cut[0].pos):
            return None
        return cutting.cut.popleft()

    # ---- the lanes ----------------------------------------------------------------------------
    def _finish_lanes(self, run: Run, out: List[Instruction]) -> None:
        job = run.job
        for lane in run.lanes.values():
            if lane.state is not READING:
                continue
            size = run.shard_size(lane.index)
            if size is not None and not lane.ready and max(lane.released, lane.start) >= size:
                lane.end()
                job.finish(run.epoch, lane.index)
                to_lane(lane, End(run=run.run, count=lane.delivered), out)
                unit = job.units
                who = job.who(lane.index)
                log.info(
                    "%s of job %r finished epoch %d (run %d): %d %s",
                    who,
                    job.name,
                    run.epoch,
                    run.run,
                    lane.delivered,
                    unit,
                )
        self.lifecycle.check_finished(run, out)

    def lane_of(self, consumer: bytes, run_id: int) -> Optional[Tuple[Run, Lane]]:
        """The consumer's lane in the run (live, or ended with last words it has not heard yet)."""
        run = self.state.runs.get(run_id)
        if run is not None:
            for lane in run.lanes.values():
                if lane.consumer == consumer:
                    return run, lane
        return self.state.unheard.pop((run_id, consumer), None)  # keyed by consumer: a stranger pops nothing

    def credit(self, e: ev.CreditGranted, out: List[Instruction]) -> None:
        found = self.lane_of(e.consumer, e.run)
        if found is None:
            return
        run, lane = found
        heard(self.state.job, e.consumer, e.now)
        lane.granted = max(lane.granted, min(e.total, lane.delivered + MAX_GRANT_AHEAD))
        if e.consumed > lane.consumed:
            lane.consumed = min(e.consumed, lane.delivered)
            if isinstance(run.dispatch, SeqWork):
                run.dispatch.forget(lane.index, lane.start + lane.consumed)
            if lane.ended:
                self.lifecycle.check_finished(run, out)
        if not lane.connected:
            lane.connected = True
            out.extend(lane.held)
            lane.held.clear()

    def missing(self, e: ev.MissingReported, out: List[Instruction]) -> None:
        found = self.lane_of(e.consumer, e.run)
        if found is None:
            return
        run, lane = found
        if run.lane_of(e.pos) is lane and isinstance(run.dispatch, SeqWork) and run.dispatch.redo_lost(e.pos):
            self.state.lost_direct += 1
            log.warning(
                "%s of job %r did not get seq %d of epoch %d sent to it directly: made again, sent by the server",
                run.job.who(lane.index),
                run.job.name,
                e.pos,
                run.epoch,
            )


def started_message(run: Run, lane: Lane, fingerprint: str) -> Started:
    """The word that the run started, to the lane's client: its shard's count from the lane's start."""
    size = run.shard_size(lane.index)
    batching = run.job.batching
    return Started(
        run=run.run,
        num_seqs=None if size is None else max(size - lane.start, 0),
        fingerprint=fingerprint,
        batching=None if batching is None else batching.to_dict(),
    )


def heard(job: Optional[Job], consumer: bytes, now: float) -> None:
    """The consumer's client lives (a keepalive, or credit): its timeout starts again."""
    client = job.clients.get(consumer) if job is not None else None
    if client is not None:
        client.alive_at = now


def to_lane(lane: Lane, msg: Message, out: List[Instruction]) -> None:
    """A message to the lane's client; held until its data socket is known to reach us."""
    if lane.consumer is None:
        return
    instr = ToClient(lane.consumer, msg)
    if lane.connected:
        out.append(instr)
    else:
        lane.held.append(instr)


def flush(run: int, lane: Lane, batch: int, out: List[Instruction]) -> int:
    """Send the lane's released outputs, `batch` a message; returns the seqs they hold."""
    seqs = 0
    while lane.ready:
        items = [lane.ready.popleft() for _ in range(min(batch, len(lane.ready)))]
        lane.delivered += len(items)
        lane.delivered_bytes += sum(i.nbytes for i in items)
        seqs += sum(i.seqs for i in items)
        sent: List[Item] = []
        for i in items:
            if isinstance(i, Batch):
                sent += i.items  # cut, not padded: the seqs name their batch, the client pads them
            elif not i.direct:  # direct ones are at the consumer already
                sent.append(i)
        if sent:
            out.append(ToClient(lane.consumer, Seqs(run=run), sent))  # type: ignore[arg-type]
    return seqs


def _credits(d: Dispatch, out: List[Instruction]) -> None:
    """Send the credit a stream run's merge returned to the partitions' owners as it took outputs."""
    if isinstance(d, StreamWork) and d.credits:
        out.extend(d.credits)
        d.credits.clear()


def _to_ready(run: Run, item: Union[Item, Batch], end: Optional[int]) -> None:
    """Into its rank's lane (`end`: run.end(), passed in: this runs once per seq)."""
    width = run.job.lanes
    lane = run.lanes.get(item.pos % width)
    if lane is None:
        return  # its reader has not come: only outputs no one wants are released for it
    index = item.pos // width
    if index >= lane.released:
        lane.released = index + 1
    if lane.state is GONE or index < lane.start or (end is not None and item.pos >= end):
        return  # no one wants it
    lane.ready.append(item)


class StreamCut:
    """The merged outputs of a map_seq_stream run that batches, cut into batches in merged order.
    Every seq of a batch carries the batch's complete_frac: the largest of it and the batches
    before it (the merged outputs' never decreases, so that is the furthest output's), so a
    sorted bucket window never sends it back."""

    def __init__(self, cutter: Cutter, length_key: Optional[str]):
        self.cutter = cutter
        self.length_key = length_key
        self.cut: Deque[Batch] = deque()  # cut and not yet released
        self.uncut: Dict[int, Item] = {}  # outputs the cutter holds (a bucket window and a batch at most)
        self.count = 0  # batches cut
        self.complete_frac: Optional[float] = None  # the largest of the batches cut so far

    def add(self, item: Item) -> None:
        self.uncut[item.pos] = item
        self._batches(self.cutter.add(item.pos, _length(item, self.length_key)))

    def finish(self) -> int:
        """Every output is in: cut the rest. Returns the epoch's batches."""
        self._batches(self.cutter.finish())
        return self.count

    def _batches(self, cut: List[List[int]]) -> None:
        """The cut batches, each checked as its client will pad it (BatchError: it cannot be)."""
        for positions in cut:
            items = [self.uncut.pop(p) for p in positions]
            collate.layout_of([(i.meta.get("seq_tag"), _shapes(i)) for i in items])
            for item in items:
                cf = item.meta.get("complete_frac")
                if cf is not None and (self.complete_frac is None or cf > self.complete_frac):
                    self.complete_frac = cf
            for item in items:
                item.batch, item.size = self.count, len(items)
                if self.complete_frac is not None and "complete_frac" in item.meta:
                    item.meta = {**item.meta, "complete_frac": self.complete_frac}
            self.cut.append(Batch(self.count, items))
            self.count += 1


def _shapes(item: Item) -> collate.Shapes:
    """An output's arrays as (dtype, shape) by key, as collate.layout_of checks them."""
    return {name: (numpy.dtype(dtype), tuple(shape)) for name, dtype, shape in item.arrays}


def _length(item: Item, key: Optional[str]) -> int:
    """An output's length for the cut: the first axis of its `key` (None: the default one of its
    arrays, see default_length_key); 1 for an output without it, or with a scalar."""
    specs = {name: (dtype, shape) for name, dtype, shape in item.arrays}
    spec = specs.get(key if key is not None else default_length_key(specs))
    shape = spec[1] if spec is not None else None
    return shape[0] if shape else 1
