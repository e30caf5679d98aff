"""Jobs, runs and lanes: who consumes which part of which epoch.

A job is one training run: `world_size` ranks (DDP processes) that read the same epochs.
Rank r's shard of an epoch is every position i with i % world_size == r (strided, as
PyTorch's DistributedSampler does), so all ranks move through the same region of the
epoch at once and the reader reads one stream. A rank may split its shard among
`subshards` readers (its DataLoader's workers): reader s takes every subshards-th seq of the
shard from its s-th on. A run is one epoch of a job; it has a lane per reader, lane
rank + s * world_size of world_size * subshards, which holds positions i with
i % lanes == lane: the reader's client (its data socket), where it starts, what has been
released to it and what it has been granted. drop_last drops the epoch's last
num_seqs % world_size positions, so that every rank gets the same count.

A job that batches has its epochs cut into batches (cut.py), and then a position is a batch:
batch j goes to lane j % lanes, counts, starts and credit count batches, and drop_last makes
every rank's number of batches equal.

With `sharding` "contiguous" reader s of rank r reads lane r * subshards + s (RETURNN's shard
index, ppclient/shards.py), the reader serves position row * lanes + lane as row `row` of
RETURNN's contiguous chunk `lane` (server/shards.py), and drop_last (with more than one rank)
drops the last num_seqs % lanes positions (the longer chunks' last seqs): those are the first
ranks', so only then every rank gets the same count.

A lane has state of its own only once its reader comes (or it leaves the run): until then
it is the run's `base` one (expected from index `base` on; gone, in a solo run). So a job
of many readers costs, on a request and on every event, what its readers that came cost,
not what its world_size says.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Set, Tuple, Union

from ppclient.batching import Batching
from ppclient.protocol import Batch, ConsumerRoute, Item
from ppclient.shards import CONTIGUOUS, STRIDED, reader_of
from ppserver.scheduler.dispatch import Dispatch
from ppserver.scheduler.instructions import ToClient
from ppserver.scheduler.story import LANE, RUN, Story

# the story of a run or lane made without one (a test's): told nowhere
UNTOLD = Story(0)

if TYPE_CHECKING:
    from ppserver.scheduler.delivery import StreamCut


class RunState(enum.Enum):
    """A run's life (docs/protocol.md, run states); runs.py decides the moves, `Run.to` makes
    them and tells them to the story (from the Run's making on):

        preparing ─started─► running ─every lane settled, one having ended─► done
        preparing ─the request refused, a dataset or server failure─► failed
        running ─a mapper, dataset or server failure─► failed
        preparing, running ─newer runs took its lanes over, or its readers all left─► superseded

    Live while preparing or running; an ended run is never live again."""

    PREPARING = "preparing"  # the reader checks the request and sets the epoch up
    RUNNING = "running"
    DONE = "done"  # every lane ended (or left, once one had ended)
    FAILED = "failed"
    SUPERSEDED = "superseded"  # newer runs took its lanes over, or its readers all left


# The moves a run's state may make; an ended run is never live again.
RUN_MOVES: Dict[RunState, Tuple[RunState, ...]] = {
    RunState.PREPARING: (RunState.RUNNING, RunState.FAILED, RunState.SUPERSEDED),
    RunState.RUNNING: (RunState.DONE, RunState.FAILED, RunState.SUPERSEDED),
    RunState.DONE: (),
    RunState.FAILED: (),
    RunState.SUPERSEDED: (),
}


_LIVE = (RunState.PREPARING, RunState.RUNNING)  # (the enum's own lookup is slow on the hot path)


class ReadState(enum.Enum):
    """Where the reader is with a run: a sub-state of its RunState (asked and accepted while it
    prepares, open and stopped while it runs; stopped once it ended). The Run's methods make
    the moves:

        asked ─accept (RunChecked)─► accepted ─open (RunStarted)─► open ─stop─► stopped
        asked ─open─► open;   asked, accepted ─stop (the run ended)─► stopped"""

    ASKED = "asked"  # Prepare was sent: the reader checks the request
    ACCEPTED = "accepted"  # the reader accepted it (its readers leave their other runs) and sets the epoch up
    OPEN = "open"  # the epoch is set up: positions are read as there is room
    STOPPED = "stopped"  # StopReading was sent: every input was read, or the run ended


READER = "reader"  # the note of a ReadState's move in the run's story

# The moves a run's ReadState may make.
READ_MOVES: Dict[ReadState, Tuple[ReadState, ...]] = {
    ReadState.ASKED: (ReadState.ACCEPTED, ReadState.OPEN, ReadState.STOPPED),
    ReadState.ACCEPTED: (ReadState.OPEN, ReadState.STOPPED),
    ReadState.OPEN: (ReadState.STOPPED,),
    ReadState.STOPPED: (),
}
# The ReadStates of each RunState (validate checks that the two agree).
READ_STATES_OF: Dict[RunState, Tuple[ReadState, ...]] = {
    RunState.PREPARING: (ReadState.ASKED, ReadState.ACCEPTED),
    RunState.RUNNING: (ReadState.OPEN, ReadState.STOPPED),
    RunState.DONE: (ReadState.STOPPED,),
    RunState.FAILED: (ReadState.STOPPED,),
    RunState.SUPERSEDED: (ReadState.STOPPED,),
}


class LaneState(enum.Enum):
    """A lane's life in a run (its value is the word `Scheduler.lanes` gives); the Lane's
    methods make the moves:

        awaited ─attach─► reading ─end─► done
        reading, done ─attach (a client takes the lane over)─► reading
        awaited, reading, done ─leave─► gone
        gone ─attach─► reading   (only a solo run's own lane, made up gone until its reader takes it)

    A lane without state of its own is awaited (gone, in a solo run) from the run's `base` on."""

    AWAITED = "awaited"  # its reader has not come: its seqs wait for it (and so does the epoch)
    READING = "reading"  # a client reads it
    DONE = "done"  # End was sent: its whole shard went out
    GONE = "gone"  # its reader left this run (another epoch, a resume elsewhere, dead): its seqs are dropped


AWAITED, READING, DONE, GONE = LaneState  # (the enum's own lookup is slow on the hot path)

# The moves a lane's state may make.
LANE_MOVES: Dict[LaneState, Tuple[LaneState, ...]] = {
    AWAITED: (READING, GONE),
    READING: (READING, DONE, GONE),
    DONE: (READING, GONE),
    GONE: (READING,),
}


@dataclass
class Lane:
    """The lane at `index` of a run (a reader's, ppclient/shards.py): positions index,
    index + lanes, ... from index `start` of the lane on. Its consumer has taken (`consumed`) no
    more than it was sent (`delivered`), which is no more than it granted nor than was released
    from `start` on; between events nothing waits in `ready`. `state` moves only through
    attach, end and leave (LANE_MOVES); `consumer` is set while it is reading or done (and kept
    once it left, so its client's late words still find it). `ended` is a flag, not a state: it
    is what the lane did (End went out since its client attached), which a lane that left after
    it keeps, so a run whose lanes all settled knows it is done rather than superseded; `end`
    sets it, `attach` clears it, and it is true exactly while done unless the lane is gone
    (validate). A state for it would split gone in two for that one question."""

    index: int
    start: int = 0  # index in the lane of the first seq delivered (the ones before are dropped)
    state: LaneState = AWAITED
    consumer: Optional[bytes] = None  # the client's data socket; None: the rank has not come
    ended: bool = False  # End was sent to its consumer (kept if it leaves after: the run counts as done); end, attach
    connected: bool = False  # a credit arrived, so the data socket reaches us
    held: List[ToClient] = field(default_factory=list)  # waiting for the data socket
    granted: int = 0  # cumulative, from the current consumer
    delivered: int = 0  # seqs sent to the current consumer
    delivered_bytes: int = 0
    released: int = 0  # index in the shard of the next position released (dropped ones included)
    ready: Deque[Union[Item, Batch]] = field(default_factory=deque)  # released, to send in this step
    attached_at: float = 0.0
    direct: bool = False  # the consumer takes results straight from workers
    consumed: int = 0  # seqs the consumer has taken (from `start`)
    run: int = 0  # the run it is a lane of
    story: Story = field(default=UNTOLD, repr=False, compare=False)  # where its moves are told (its run's)

    @property
    def credit(self) -> int:
        return self.granted - self.delivered

    @property
    def gone(self) -> bool:
        """Its reader left this run: its seqs are dropped."""
        return self.state is GONE

    @property
    def done(self) -> bool:
        """End was sent, and it has not left since."""
        return self.state is DONE

    @property
    def live(self) -> bool:
        return self.state is READING

    @property
    def settled(self) -> bool:
        """Nothing is left to do for it: it left, or it ended and (direct results) its consumer
        said it took every seq, so none can still turn out lost."""
        state = self.state
        return state is GONE or (state is DONE and (not self.direct or self.consumed >= self.delivered))

    def _to(self, state: LaneState, note: str = "") -> None:
        """Move the lane to `state` (only along LANE_MOVES), told to the story as lane RUN/INDEX."""
        if state not in LANE_MOVES[self.state]:
            raise AssertionError(f"lane {self.index}: {self.state.value} -> {state.value} is not a move of a lane")
        self.story.move(LANE, f"{self.run}/{self.index}", self.run, self.state, state, None, note)
        self.state = state

    def attach(self, consumer: bytes, start: int, now: float, lanes: int) -> None:
        """A (new) client takes the lane over from index `start` (>= released): what was released
        for it and not yet delivered is kept, the rest before `start` is dropped."""
        self._to(READING, f"from index {start}")
        self.consumer = consumer
        self.start = start
        self.attached_at = now
        self.ended = self.connected = False
        self.held = []
        self.granted = self.delivered = self.delivered_bytes = self.consumed = 0
        self.ready = deque(item for item in self.ready if item.pos // lanes >= start)

    def end(self) -> None:
        """Its whole shard went out: End is sent to its consumer."""
        self._to(DONE, f"{self.delivered} sent")
        self.ended = True

    def leave(self) -> None:
        """Its reader left this run: what is released for it from now on is dropped."""
        self._to(GONE)


@dataclass
class Run:
    """One epoch of a job (or, `solo`, one rank's resume of it behind the job's main run). It has a
    dispatch once the reader set the epoch up (RUNNING), and holds nothing once it ended; `reading`
    (ReadState) is where the reader is with it, a sub-state of `state`."""

    run: int
    job: Job
    epoch: int
    requested: float
    seq_list: Optional[List[str]] = None
    seq_order: Optional[List[int]] = None
    solo: Optional[int] = None  # the lane a solo run serves
    lanes: Dict[int, Lane] = field(default_factory=dict)  # the lanes with state of their own, by index
    base: int = 0  # where a lane without state of its own is expected to start
    dispatch: Optional[Dispatch] = None  # None while the reader prepares the epoch
    num_seqs: Optional[int] = None  # inputs of the epoch
    started: Optional[float] = None
    ended: Optional[float] = None
    state: RunState = RunState.PREPARING
    error: Optional[str] = None
    reading: ReadState = ReadState.ASKED  # where the reader is with it (moved by accept, open_reading, stop_reading)
    group: List[Union[Item, Batch]] = field(default_factory=list)  # stream, drop_last: a group of W not complete
    cutting: Optional[StreamCut] = None  # stream mode, batching: the merged outputs cut into batches
    total: Optional[int] = None  # outputs of the whole epoch, once known
    held_by: Optional[int] = None  # the lane without room for the next output to release, if one is
    mapped: int = 0  # seqs of batches under way that workers said they mapped (keepalives carry it)
    seqs: Optional[int] = None  # seqs of the epoch (not batches), once known: max_skipped is a part of them
    skipped: int = 0  # seqs map_seq skipped in this run (skips.py)
    skipped_tags: List[str] = field(default_factory=list)  # the first few of their tags
    story: Story = field(default=UNTOLD, repr=False, compare=False)  # where its and its lanes' moves are told

    def __post_init__(self) -> None:
        """Its story begins: (none) -> preparing."""
        self.story.move(RUN, self.run, self.run, None, self.state, note=f"epoch {self.epoch}")

    @property
    def width(self) -> int:
        """How many lanes the run has (positions go to lane pos % width)."""
        return self.job.lanes

    @property
    def live(self) -> bool:
        return self.state in _LIVE

    def to(self, state: RunState, note: str = "") -> None:
        """Move the run to `state` (only along RUN_MOVES: an ended run stays ended), told to the story."""
        if state not in RUN_MOVES[self.state]:
            raise AssertionError(f"run {self.run}: {self.state.value} -> {state.value} is not a move of a run")
        self.story.move(RUN, self.run, self.run, self.state, state, note=note)
        self.state = state

    @property
    def accepted(self) -> bool:
        """Whether the reader accepted the request (so its readers have left their other runs)."""
        return self.reading is not ReadState.ASKED

    def accept(self) -> None:
        """The reader accepted the request (RunChecked; once it opened, it had)."""
        if self.reading is ReadState.ASKED:
            self._read(ReadState.ACCEPTED)

    def open_reading(self) -> None:
        """The reader set the epoch up (RunStarted): positions are read as there is room."""
        self._read(ReadState.OPEN)

    def stop_reading(self) -> bool:
        """Whether StopReading is to be sent now (every input was read, or the run ended): only
        the first time."""
        if self.reading is ReadState.STOPPED:
            return False
        self._read(ReadState.STOPPED)
        return True

    def _read(self, reading: ReadState) -> None:
        """Move the run's ReadState (only along READ_MOVES), told to the story as the run's
        (noted "reader": the reader's side of it)."""
        if reading not in READ_MOVES[self.reading]:
            raise AssertionError(f"run {self.run}: reading {self.reading.value} -> {reading.value} is not a move")
        self.story.move(RUN, self.run, self.run, self.reading, reading, note=READER)
        self.reading = reading

    @property
    def absent_gone(self) -> bool:
        """Whether a lane without state of its own is gone (a solo run serves one rank's) or expected."""
        return self.solo is not None

    def view(self, index: int) -> Lane:
        """The lane's state; for a lane without state of its own, made up and not kept."""
        lane = self.lanes.get(index)
        if lane is None:
            lane = Lane(index, self.base, GONE if self.absent_gone else AWAITED, run=self.run, story=self.story)
        return lane

    def lane(self, index: int) -> Lane:
        """The lane's state, kept from now on (its reader comes, or it leaves the run)."""
        lane = self.lanes.get(index)
        if lane is None:
            lane = self.lanes[index] = self.view(index)
        return lane

    def lane_of(self, pos: int) -> Optional[Lane]:
        """The lane of a position, if it has state of its own (else no reader has come to it)."""
        return self.lanes.get(pos % self.job.lanes)

    def wanted(self, pos: int) -> bool:
        """Whether the output at `pos` goes to anyone (else it is dropped, and in map_seq never read)."""
        lane = self.lanes.get(pos % self.job.lanes)
        if lane is None:
            return not self.absent_gone and pos // self.job.lanes >= self.base
        return lane.state is not GONE and pos // self.job.lanes >= lane.start

    def expecting(self, besides: Optional[int] = None) -> bool:
        """Whether a lane without state of its own (other than `besides`) is still expected: its
        reader has not come, so the run is not over."""
        if self.absent_gone:
            return False
        absent = self.width - len(self.lanes)
        return absent - (besides is not None and besides not in self.lanes) > 0

    def next_wanted(self, pos: int) -> Optional[int]:
        """The first position from `pos` on that goes to someone (None: none will). What it costs
        grows with the lanes that have state: a run that serves few of many lanes passes over the
        others' positions at once."""
        width = self.width
        row, col = divmod(pos, width)
        found = [
            max(row + (index < col), lane.start) * width + index
            for index, lane in self.lanes.items()
            if lane.state is not GONE
        ]
        if self.expecting():  # the first lane without state of its own at or after pos, from row `base` on
            at = max(row, self.base)
            absent = next((i for i in range(col if at == row else 0, width) if i not in self.lanes), None)
            if absent is None:
                at, absent = at + 1, next(i for i in range(width) if i not in self.lanes)
            found.append(at * width + absent)
        return min(found, default=None)

    def awaited(self, limit: int) -> List[int]:
        """The first `limit` lanes whose reader is expected and has not come (in order; what it
        costs grows with the lanes that have state, not with the run's width)."""
        indices: Any = sorted(self.lanes) if self.absent_gone else range(self.width)
        found: List[int] = []
        for index in indices:
            lane = self.lanes.get(index)
            if lane is None or lane.state is AWAITED:
                found.append(index)
                if len(found) == limit:
                    break
        return found

    def shard_size(self, lane: int) -> Optional[int]:
        """Seqs of a lane in the epoch (from index 0), once the epoch's output count is known."""
        end = self.end()
        if end is None:
            return None
        return max(0, -(-(end - lane) // self.job.lanes))

    def end(self) -> Optional[int]:
        """The first position no rank gets: with drop_last, the remainder of world_size."""
        return self.end_of(self.total)

    def end_of(self, total: Optional[int]) -> Optional[int]:
        """The first position no rank gets in an epoch of `total` outputs."""
        if total is None:
            return None
        w = self.job.world
        if self.job.sharding == CONTIGUOUS and w > 1:
            w = self.job.lanes  # the longer chunks are the first ranks': only cutting them all leaves ranks equal
        return total // w * w if self.job.drop_last else total


@dataclass
class Client:
    """A client of the job (one data socket, one lane): alive while its keepalives come."""

    lane: int  # the lane it reads (ppclient/shards.py)
    timeout: float
    alive_at: float
    route: Optional[ConsumerRoute] = None  # how workers reach its direct ROUTER (None: through the server)


@dataclass
class Job:
    name: str
    world: int  # ranks
    drop_last: bool
    subshards: int = 1  # readers per rank
    batching: Optional[Batching] = None  # the cut of its epochs (None: seq by seq)
    sharding: str = STRIDED  # CONTIGUOUS: lane l reads RETURNN's chunk l instead (server/shards.py)
    runs: Dict[int, Run] = field(default_factory=dict)  # live runs
    clients: Dict[bytes, Client] = field(default_factory=dict)  # live clients, by data socket
    finished: Dict[int, Set[int]] = field(default_factory=dict)  # epoch -> lanes that finished it (recent ones)

    def finish(self, epoch: int, lane: int) -> None:
        self.finished.setdefault(epoch, set()).add(lane)
        for old in [e for e in self.finished if e < epoch - 2]:
            del self.finished[old]

    def unexpected(self, epoch: int) -> Set[int]:
        """The lanes a new run of `epoch` should not wait for: they finished that epoch, or read
        it (a solo run) or a later one elsewhere. (Every other lane is expected.)"""
        lanes = set(self.finished.get(epoch, ()))
        for run in self.runs.values():
            if run.epoch >= epoch:
                lanes.update(i for i, lane in run.lanes.items() if lane.state is READING or lane.state is DONE)
        return lanes

    @property
    def lanes(self) -> int:
        return self.world * self.subshards

    def reader_of(self, lane: int) -> Tuple[int, int]:
        """(rank, reader of the rank) of a lane (ppclient/shards.py)."""
        return reader_of(lane, self.world, self.subshards, self.sharding)

    def who(self, lane: int) -> str:
        """A lane in words: "rank 1", or "rank 1 (reader 2 of 4)" with subshards."""
        rank, part = self.reader_of(lane)
        return f"rank {rank}" if self.subshards == 1 else f"rank {rank} (reader {part} of {self.subshards})"

    @property
    def unit(self) -> str:
        """What its positions are, in words: seqs, or the batches its epochs are cut into."""
        return "batch" if self.batching is not None else "seq"

    @property
    def units(self) -> str:
        return "batches" if self.batching is not None else "seqs"

    @property
    def key(self) -> Tuple[str, int, bool, int, Optional[Batching], str]:
        return (self.name, self.world, self.drop_last, self.subshards, self.batching, self.sharding)

    @property
    def contiguous(self) -> Optional[int]:
        """The lanes whose chunks the reader serves, for contiguous shards of more than one lane
        (else None: one lane's chunk is the epoch, in its order)."""
        return self.lanes if self.sharding == CONTIGUOUS and self.lanes > 1 else None

    def lanes_of(self, consumer: bytes) -> List[Tuple[Run, Lane]]:
        return [(run, lane) for run in self.runs.values() for lane in run.lanes.values() if lane.consumer == consumer]
