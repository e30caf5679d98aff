"""map_seq_stream dispatch: input i belongs to partition i mod P; a partition is one stream on one
worker; outputs are merged round-robin across partitions (exhausted ones are skipped).

Credits bound memory both ways: the server sends a partition's owner at most `buf_size`
inputs it has not yet taken (StreamAck returns credit), and the owner sends at most
`buf_size` outputs the merge has not yet taken (StreamCredit returns it).

A partition whose worker dies restarts on another worker from its first input: the inputs
already sent are read again from the dataset (Replay, in chunks of `buf_size`), and the new
owner skips the outputs the server already received (StreamOpen.skip). `max_seq_retries`
crashes without progress in between fail the run.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union, cast

from ppclient.protocol import (
    BadItem,
    Batch,
    FailureKind,
    Item,
    StreamClose,
    StreamCredit,
    StreamEnd,
    StreamInputs,
    StreamOpen,
    short_tag,
)
from ppserver.scheduler.dispatch import Drop, Room, StreamQueues, StreamWork, Workers
from ppserver.scheduler.instructions import Instruction, Replay, ToWorker
from ppserver.scheduler.placement import choose_owner
from ppserver.scheduler.settings import Failure, Settings
from ppserver.scheduler.story import PARTITION, Story
from ppserver.scheduler.workers import WorkerState


class PartState(enum.Enum):
    """A stream partition's state (docs/protocol.md, stream partitions), in its story as its value."""

    UNOWNED = "unowned"  # no worker runs it; once one does, what was sent before is replayed first
    OWNED = "owned"  # its owner `wid` runs it: inputs go there within credit, replayed ones first
    DONE = "done"  # its stream ended: nothing more goes to it


UNOWNED, OWNED, DONE = PartState

# The moves a partition's state may make; a stream that ended stays ended.
PART_MOVES: Dict[PartState, Tuple[PartState, ...]] = {
    UNOWNED: (OWNED,),
    OWNED: (UNOWNED, DONE),
    DONE: (),
}


@dataclass
class Partition:
    """One stream of run `run`, in one state (PartState): it has an owner (`wid`) while owned, and
    only then. Its moves are the only writers of its state and owner: each is told to `story` and
    keeps the owner's set of partitions (WorkerState.partitions) in step."""

    index: int
    run: int
    story: Story = field(repr=False, compare=False)
    state: PartState = UNOWNED
    wid: Optional[bytes] = None  # the owner
    avoid: Optional[bytes] = None  # unowned: the worker it let down, its next owner if no other may be
    queue: Deque[Item] = field(default_factory=deque)  # new inputs not yet sent
    fed: int = 0  # inputs of this partition received from the reader
    sent: int = 0  # inputs sent to the current owner (from the partition's first)
    in_credit: int = 0
    replay_until: int = 0  # inputs j < replay_until come from a replay, not the queue
    replay: Deque[Item] = field(default_factory=deque)  # replayed inputs not yet sent
    replay_ticket: Optional[int] = None  # the replay request whose answer is awaited, if one is
    eof_sent: bool = False
    outputs: Deque[Tuple[Item, bytes]] = field(default_factory=deque)  # (output, the worker that made it)
    received: int = 0  # outputs received, across restarts
    deaths: int = 0
    received_at_death: Optional[int] = None  # `received` at the last failure charged (None: none yet)
    last_tag: Optional[str] = None
    incarnation: int = 0  # counts the partition's starts; the owner echoes it

    def replaying(self) -> bool:
        return self.sent < self.replay_until

    def _to(self, state: PartState, w: Optional[WorkerState], note: str = "") -> None:
        """Move to `state` (only along PART_MOVES), told to the story with the worker `w` it leaves
        or goes to, whose set of partitions gains or loses it (None: it leaves an owner that is
        forgotten already, set and all)."""
        if state not in PART_MOVES[self.state]:
            raise AssertionError(f"stream partition {self.index}: {self.state.value} -> {state.value} is not a move")
        if w is None:
            if state is OWNED:
                raise AssertionError(f"stream partition {self.index}: owned by no worker")
        elif state is OWNED:
            w.partitions.add((self.run, self.index))
        else:
            if w.wid != self.wid:
                raise AssertionError(f"stream partition {self.index}: owned by {self.wid!r}, not {w.wid!r}")
            w.partitions.discard((self.run, self.index))
        self.story.move(PARTITION, self.index, self.run, self.state, state, self.wid if w is None else w.wid, note)
        self.state = state

    def open(self, w: WorkerState, credit: int) -> None:
        """UNOWNED -> OWNED: start (again) on `w`, from the partition's first input."""
        self._to(OWNED, w, f"start {self.incarnation + 1}")
        self.wid = w.wid
        self.avoid = None
        self.incarnation += 1
        self.in_credit = credit

    def charge(self) -> int:
        """A failure charged to the partition (a crash, a malformed output, an input its worker could
        not take); progress since the last one means that one was not its fault. Returns the count."""
        if self.received_at_death is None or self.received > self.received_at_death:
            self.deaths = 0
        self.deaths += 1
        self.received_at_death = self.received
        return self.deaths

    def disown(self, w: Optional[WorkerState], let_down: bool, note: str = "") -> None:
        """OWNED -> UNOWNED: its owner `w` is gone, or let it down (`let_down`: its next owner is
        another if one may be), or its run closed; what was sent is replayed if it runs again."""
        self._to(UNOWNED, w, note)
        self.wid = None
        self.avoid = w.wid if let_down and w is not None else None
        self.replay_until = self.fed - len(self.queue)
        self.replay.clear()
        self.replay_ticket = None
        self.sent = 0
        self.in_credit = 0
        self.eof_sent = False

    def finish(self, w: WorkerState) -> None:
        """OWNED -> DONE: its stream on `w` ended."""
        self._to(DONE, w)
        self.wid = None
        self.queue.clear()
        self.replay.clear()

    def replayed(self, ticket: int, items: List[Item]) -> None:
        """Inputs read again, for the replay asked for with `ticket` (else for an earlier owner's)."""
        if ticket == self.replay_ticket and self.state is OWNED:
            self.replay_ticket = None
            self.replay.extend(items)

    def receive(self, items: List[Item], wid: bytes) -> Tuple[int, bool]:
        """Outputs of its owner `wid`, in stream order: how many were new, and whether one was
        missing (a gap: something in between was lost). Duplicates are dropped."""
        taken = 0
        for item in items:
            if item.pos < self.received:
                continue  # a duplicate of an output already taken
            if item.pos > self.received:
                return taken, True
            self.outputs.append((item, wid))
            self.received += 1
            taken += 1
        return taken, False

    def to_replay(self, partitions: int, buf_size: int) -> List[int]:
        """The positions to read again next, if a replay is due and none is asked for: a chunk
        of what its credit takes (`buf_size` at least)."""
        if not self.replaying() or self.replay or self.replay_ticket is not None:
            return []
        first = self.sent
        count = min(self.replay_until - first, max(self.in_credit, buf_size))
        return [self.index + j * partitions for j in range(first, first + count)]

    def take(self) -> List[Item]:
        """The inputs its owner's credit allows: replayed ones first, then new ones."""
        batch: List[Item] = []
        while self.in_credit > 0:
            if self.replaying():
                if not self.replay:
                    break
                item = self.replay.popleft()
            elif self.queue:
                item = self.queue.popleft()
            else:
                break
            self.last_tag = item.seq_tag
            batch.append(item)
            self.sent += 1
            self.in_credit -= 1
        return batch

    def forget(self, workers: Dict[bytes, WorkerState]) -> None:
        """The run ended: an owned partition leaves its owner through its move (OWNED -> UNOWNED,
        noted "run closed"; its owner may be forgotten already, if its loss failed the run), so
        its owner and its owner's set agree; a done or unowned one keeps its state. Either way the
        run will not run again."""
        if self.wid is not None:
            self.disown(workers.get(self.wid), let_down=False, note="run closed")
        self.queue.clear()
        self.outputs.clear()
        self.replay.clear()

    def validate(self, workers: Dict[bytes, WorkerState]) -> None:
        """An owner while owned, and only then; a worker to avoid only while unowned. Done: nothing
        queued. Unowned: fed nothing. Owned: in its owner's set, sent no more than it was fed."""
        where = f"run {self.run}, stream partition {self.index}"
        assert (self.wid is not None) == (self.state is OWNED), f"{where}: {self.state.value}, owner {self.wid!r}"
        assert self.avoid is None or self.state is UNOWNED, f"{where}: {self.state.value}, avoids {self.avoid!r}"
        if self.state is DONE:
            assert not self.queue and not self.replay, f"{where}: done, yet fed"
        elif self.state is UNOWNED:
            assert self.replay_ticket is None and self.in_credit == 0, f"{where}: unowned, yet fed"
        else:
            w = workers.get(self.wid) if self.wid is not None else None
            assert w is not None and (self.run, self.index) in w.partitions, f"{where}: not in its owner's set"
            assert self.sent <= self.fed and self.in_credit >= 0, f"{where}: {self.sent} of {self.fed} sent"


class StreamDispatch(StreamWork):
    """A partition's moves (unowned -> owned -> done, owned -> unowned) are told to `story` (by the
    partition). A partition taken from its owner gets a new one in `dispatch` (placement's
    choose_owner), after the old owner is told to close it (`closes`); the credit the merge
    returns waits in `credits` for the scheduler."""

    def __init__(self, run: int, num_seqs: Optional[int], settings: Settings, story: Optional[Story] = None):
        self.run = run
        self.story = Story(0) if story is None else story
        self.num_seqs = num_seqs  # inputs
        self.settings = settings
        self.parts = [Partition(p, run, self.story) for p in range(settings.partitions)]
        self.closes: List[Instruction] = []  # StreamClose to owners that let a partition down, sent first
        self.credits: List[Instruction] = []
        self.fed = 0
        self.feed_done = num_seqs == 0
        self.rr = 0  # the partition whose output the merge takes next
        self.released = 0
        self.complete_frac = 0.0  # the largest released so far: the merge's never decreases
        self.tickets = 0  # replay requests so far (each one's ticket is its number)
        self.read_upto = 0  # positions asked of the reader

    @property
    def one_output_per_input(self) -> bool:
        return self.settings.preserves_num_seqs

    # ---- inputs ---------------------------------------------------------------------------
    def add_inputs(self, items: Sequence[Union[Item, Batch]]) -> None:
        n = len(self.parts)
        for item in cast(List[Item], items):  # (never Batches: a stream run's reader does not cut)
            self.fed = max(self.fed, item.pos + 1)
            part = self.parts[item.pos % n]
            part.fed += 1
            if part.state is not DONE:  # a stream that ended early never reads its remaining inputs
                part.queue.append(item)
        self.feed_done = self.num_seqs is not None and self.fed >= self.num_seqs

    def inputs_ended(self, count: int, end: Optional[int]) -> None:
        self.num_seqs = count
        self.feed_done = self.fed >= count

    def read_limit(self) -> int:
        """Read on while a partition that can take inputs has none queued: each hungry partition
        may get what its credit allows; the others queue what comes meanwhile (their streams may
        need that lookahead before they yield)."""
        n = len(self.parts)
        limit = self.read_upto
        for part in self.parts:
            if part.state is not OWNED or part.replaying():
                continue
            room = part.in_credit - len(part.queue)
            if room <= 0:
                continue
            first = self.read_upto + (part.index - self.read_upto) % n  # this partition's next position
            limit = max(limit, first + (room - 1) * n + 1)
        return limit if self.num_seqs is None else min(limit, self.num_seqs)

    def requests(self, capacity: int) -> List[int]:
        """The next positions to read: every input goes to some partition, in epoch order."""
        limit = self.read_limit()
        if limit <= self.read_upto:
            return []
        out = list(range(self.read_upto, limit))
        self.read_upto = limit
        return out

    def reading_done(self) -> bool:
        """No partition can need an input again (a partition that restarts replays its inputs)."""
        return all(part.state is DONE for part in self.parts)

    def replay_read(self, partition: int, ticket: int, items: List[Item]) -> None:
        self.parts[partition].replayed(ticket, items)

    # ---- workers --------------------------------------------------------------------------
    def worker_lost(self, w: WorkerState, crashed: bool) -> Optional[Failure]:
        """`w` is gone: its partitions restart elsewhere (at the next `dispatch`)."""
        for p in w.held_of(self.run):
            if self.parts[p].wid == w.wid:
                failure = self._restart(w, self.parts[p], "killed {n} workers", counts=crashed, let_down=False)
                if failure is not None:
                    return failure
        return None

    def _restart(
        self,
        w: WorkerState,
        part: Partition,
        what: str,
        *,
        counts: bool,
        let_down: bool,
        kind: FailureKind = FailureKind.MAPPER,
    ) -> Optional[Failure]:
        """Take the partition from its owner `w`; `counts`: charge it (a crash, a malformed output,
        an input the worker could not take), failing the run as `kind` once it has cost too many;
        `what` says what it cost, "{n}" standing for how many times; `let_down`: its next owner is
        another worker if one may be."""
        if counts:
            n = part.charge()
            if n >= self.settings.max_seq_retries:
                tag = short_tag(part.last_tag) or f"partition {part.index}"
                cost = what.replace("{n}", str(n))
                return Failure(kind, f"stream partition {part.index} (last input {tag!r}) {cost}", seq_tag=tag)
        part.disown(w, let_down)
        return None

    def _assign(self, workers: Workers, out: List[Instruction]) -> None:
        """Partitions without an owner go where placement.choose_owner says."""
        for part in self.parts:
            if part.state is not UNOWNED:
                continue
            wid = choose_owner(workers.values(), part.avoid)
            if wid is None:
                return  # no worker may run a stream now
            part.open(workers[wid], self.settings.buf_size)
            out.append(
                ToWorker(
                    wid,
                    StreamOpen(
                        run=self.run,
                        partition=part.index,
                        skip=part.received,
                        credit=self.settings.buf_size,
                        incarnation=part.incarnation,
                    ),
                )
            )

    def owned(self, w: WorkerState, partition: int, incarnation: int) -> Optional[Partition]:
        """The partition, if `w` runs its current start (`incarnation`): else the message is stale."""
        if not 0 <= partition < len(self.parts):
            return None
        part = self.parts[partition]
        return part if part.wid == w.wid and part.incarnation == incarnation else None

    def stream_acked(self, w: WorkerState, partition: int, incarnation: int, n: int) -> None:
        part = self.owned(w, partition, incarnation)
        if part is not None:
            part.in_credit += n

    def stream_outputs(
        self, w: WorkerState, partition: int, incarnation: int, items: List[Item], bad: List[BadItem]
    ) -> Optional[Failure]:
        """Outputs arrive in stream order; a malformed one (or a gap) restarts the partition elsewhere."""
        part = self.owned(w, partition, incarnation)
        if part is None:
            return None
        if not bad:  # (a malformed one: none of the message is taken)
            taken, gap = part.receive(items, w.wid)
            w.done += taken
            if not gap:
                return None
        return self._take_back(w, part, "sent malformed outputs from {n} workers")

    def _take_back(
        self, w: WorkerState, part: Partition, what: str, kind: FailureKind = FailureKind.MAPPER
    ) -> Optional[Failure]:
        """`w` let the partition down: it is told to close it, and it restarts on another worker, charged."""
        failure = self._restart(w, part, what, counts=True, let_down=True, kind=kind)
        if failure is not None:
            return failure
        self.closes.append(ToWorker(w.wid, StreamClose(run=self.run, partition=part.index)))
        return None

    def dropped(self, w: WorkerState, drop: Drop) -> Optional[Failure]:
        """`w` dropped a message of the partition unread (None: of a partition of this run it runs):
        its stream misses what it carried, so it restarts elsewhere, charged; `max_seq_retries`
        such restarts without progress fail the run naming its last input."""
        for p in w.held_of(self.run) if drop.partition is None else [drop.partition]:
            part = self.parts[p] if 0 <= p < len(self.parts) else None
            if part is None or part.wid != w.wid:
                continue  # not (or no longer) its partition
            cost = f"could not be taken by {{n}} workers ({drop.reason})"
            failure = self._take_back(w, part, cost, FailureKind.DATASET)
            if failure is not None:
                return failure
        return None

    def malformed_message(self, w: WorkerState, reason: str) -> Optional[Failure]:
        """A message from `w` did not decode: every partition it runs restarts elsewhere, charged."""
        for p in w.held_of(self.run):
            part = self.parts[p]
            if part.wid == w.wid:
                failure = self.stream_outputs(w, p, part.incarnation, [], [BadItem(None, reason)])
                if failure is not None:
                    return failure
        return None

    def stream_finished(self, w: WorkerState, partition: int, incarnation: int) -> None:
        part = self.owned(w, partition, incarnation)
        if part is not None:
            part.finish(w)

    def stream_failed(self, w: WorkerState, partition: int, incarnation: int) -> bool:
        """A mapper failure fails the run if it comes from the partition's current start."""
        return self.owned(w, partition, incarnation) is not None

    # ---- dispatch -------------------------------------------------------------------------
    def dispatch(self, workers: Workers, out: List[Instruction]) -> None:
        """Owners that let a partition down are told to close it; partitions without an owner get
        one; owners get the inputs their credit allows, replayed ones first (asked of the reader in
        chunks), and the end of their stream once all is sent."""
        if self.closes:
            out.extend(self.closes)
            self.closes.clear()
        self._assign(workers, out)
        n = len(self.parts)
        buf = self.settings.buf_size
        for part in self.parts:
            if part.wid is None:  # unowned or done
                continue
            replay = part.to_replay(n, buf)
            if replay:
                self.tickets += 1
                part.replay_ticket = self.tickets
                out.append(Replay(self.run, part.index, replay, ticket=self.tickets))
            batch = part.take()
            if batch:
                out.append(ToWorker(part.wid, StreamInputs(run=self.run, partition=part.index), batch))
            if self.feed_done and not part.eof_sent and part.sent >= part.fed and not part.queue:
                part.eof_sent = True
                out.append(ToWorker(part.wid, StreamEnd(run=self.run, partition=part.index)))

    # ---- delivery -------------------------------------------------------------------------
    def pop_next(self, room: Room) -> Optional[Item]:
        """The next output of the round-robin merge, once it is known and its rank has room;
        `item.pos` becomes its position in the epoch, and its complete_frac never goes back. Its
        producer gets the credit back (in `credits`) if it still owns the partition."""
        n = len(self.parts)
        for _ in range(n):
            part = self.parts[self.rr]
            if part.outputs:
                if not room(self.released):
                    return None
                item, producer = part.outputs.popleft()
                item.pos = self.released
                self._clamp(item)
                if part.wid is not None and producer == part.wid:  # credit only for the owner's outputs
                    self.credits.append(ToWorker(part.wid, StreamCredit(run=self.run, partition=part.index, n=1)))
                self.rr = (self.rr + 1) % n
                self.released += 1
                return item
            if part.state is not DONE:
                return None  # its next output decides what comes next
            self.rr = (self.rr + 1) % n
        return None

    def _clamp(self, item: Item) -> None:
        cf = item.meta.get("complete_frac")
        if cf is not None:
            if cf > self.complete_frac:
                self.complete_frac = cf
            elif cf < self.complete_frac:
                item.meta = {**item.meta, "complete_frac": self.complete_frac}

    def total(self) -> Optional[int]:
        if all(part.state is DONE and not part.outputs for part in self.parts):
            return self.released
        return None

    def close(self, workers: Workers) -> None:
        """Its owners let its partitions go (Partition.forget): the run will not run again."""
        for part in self.parts:
            part.forget(workers)
        self.closes.clear()
        self.credits.clear()

    def queues(self) -> StreamQueues:
        return StreamQueues(
            fed=self.fed,
            waiting_for_worker=sum(len(p.queue) + len(p.replay) for p in self.parts),
            in_flight=self.in_flight(),
            reorder_buffer=sum(len(p.outputs) for p in self.parts),
            partitions_done=sum(1 for p in self.parts if p.state is DONE),
        )

    def in_flight(self) -> int:
        return sum(1 for p in self.parts if p.state is OWNED)

    def holds(self) -> List[int]:
        return sorted(item.pos for part in self.parts for item in (*part.queue, *part.replay))

    def validate(self, workers: Workers) -> None:
        """Each partition by itself (Partition.validate); a worker's set holds only partitions of
        this run it owns."""
        for part in self.parts:
            part.validate(workers)
        for w in workers.values():
            for run, p in w.partitions:
                owner = self.parts[p].wid
                assert run != self.run or owner == w.wid, f"run {run}: {w.name} holds partition {p}, owned by {owner!r}"
