"""What happens to the scheduler: each event carries the time it happened (`now`, monotonic s)
and its stimulus id (`stimulus`: its kind and a number, "results-1234"), which the instructions
it causes and the moves it makes (story.py) carry too. The server names each event it builds
(`Stimuli`); one built without a name gets one from the scheduler.

Events are frozen slotted dataclasses: nothing changes one after it is made. (Frozen costs
about 1 us per event, little beside the message each one comes from.)

The server turns checked protocol messages, reader hand-overs, process exits and the clock
into these; nothing else reaches the scheduler.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

from ppclient.batching import Batching
from ppclient.protocol import BadItem, Batch, Item
from ppclient.shards import STRIDED, lane_of
from ppserver.scheduler.workers import InputPath


@dataclass(frozen=True, slots=True)
class Event:
    now: float
    stimulus: str = field(default="", kw_only=True)


class RunEvent:
    """An event about one run (`run`; None: not known): a handler that raises on it fails that
    run, not every live one (Scheduler._contain). A mixin beside Event or WorkerEvent, with no
    fields of its own, so each event keeps its fields' order."""

    __slots__ = ()
    run: Optional[int]


class Stimuli:
    """Names events: their kind (a protocol message's, or the event's) and a running number."""

    def __init__(self) -> None:
        self.count = 0

    def next(self, kind: str) -> str:
        self.count += 1
        return f"{kind}-{self.count}"

    def name(self, event: Event, kind: str = "") -> Event:
        """`event`, named as it is made (frozen: nothing changes it after it is handed over)."""
        object.__setattr__(event, "stimulus", self.next(kind or kind_of(type(event))))
        return event


_KINDS: Dict[type, str] = {}


def kind_of(cls: type) -> str:
    """An event class's kind in stimulus ids: "InputsRead" -> "inputs-read"."""
    kind = _KINDS.get(cls)
    if kind is None:
        kind = _KINDS[cls] = re.sub(r"(?<!^)(?=[A-Z])", "-", cls.__name__).lower()
    return kind


# ---- workers ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerJoined(Event):
    """A worker passed the protocol and fingerprint checks (the server has welcomed it)."""

    wid: bytes
    host: str
    pid: int
    local_index: Optional[int] = None
    replaces: Optional[bytes] = None


@dataclass(frozen=True, slots=True)
class WorkerEvent(Event):
    """Anything from a registered worker; an unknown `wid` is told so and otherwise ignored."""

    wid: bytes


@dataclass(frozen=True, slots=True)
class HeartbeatReceived(WorkerEvent):
    """`mapping`: (run, pos, seqs mapped) of the batch the worker maps now, if it maps one."""

    mapping: Optional[Tuple[int, int, int]] = None


@dataclass(frozen=True, slots=True)
class InputsShared(WorkerEvent):
    """How the worker gets its inputs changed (in the messages again, in shared memory, or by
    address in the server's memory): it bounds the input bytes of its task messages."""

    path: InputPath = field(default_factory=InputPath)


@dataclass(frozen=True, slots=True)
class RunDropped(WorkerEvent, RunEvent):
    """The worker dropped a closed run: the inputs of that run's tasks it held may go."""

    run: int = 0


@dataclass(frozen=True, slots=True)
class WorkerLeft(WorkerEvent):
    """The worker said goodbye: its work goes back to the queue, nothing is blamed."""


@dataclass(frozen=True, slots=True)
class ResultsReceived(WorkerEvent, RunEvent):
    run: int
    items: List[Item] = field(default_factory=list)
    bad: List[BadItem] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WorkerMessageMalformed(WorkerEvent):
    """A message on the worker's task socket that did not decode: it may have held results (of
    any run), so every seq and stream partition the worker holds is charged with it."""

    reason: str


@dataclass(frozen=True, slots=True)
class CompletedReceived(WorkerEvent, RunEvent):
    """Results the worker sent to their consumers itself: their positions and sizes."""

    run: int
    positions: List[int] = field(default_factory=list)
    nbytes: List[int] = field(default_factory=list)
    skipped: List[int] = field(default_factory=list)  # per position, seqs the mapper skipped (empty: none)
    skipped_tags: List[List[str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class InputsLost(WorkerEvent, RunEvent):
    """Tasks whose inputs the worker could not read: taken back, redone if still wanted."""

    run: int
    positions: List[int] = field(default_factory=list)
    reason: str = ""


class Carried(enum.Enum):
    """What a message of the server's to a worker carried, by its kind (the server tells, as it
    builds a MessageDropped): which work is redone when the worker drops it."""

    TASKS = "tasks"  # map_seq tasks
    STREAM = "stream"  # a stream partition's opening, inputs, end, close or credit
    NOTHING = "nothing"  # no work (a route, a run's close, ...): the worker goes on without it
    UNKNOWN = "unknown"  # unreadable: everything the worker holds is charged


@dataclass(frozen=True, slots=True)
class MessageDropped(WorkerEvent, RunEvent):
    """The worker dropped a message of the server's unread (see protocol.Dropped): what it carried
    is redone elsewhere, charged, or the run fails naming the seq."""

    what: Optional[str]  # its kind, as the worker read it (None: it could not read it)
    carried: Carried
    run: Optional[int] = None
    partition: Optional[int] = None
    positions: List[int] = field(default_factory=list)  # empty: every task of the run it holds
    reason: str = ""


@dataclass(frozen=True, slots=True)
class TaskFailed(WorkerEvent, RunEvent):
    run: int
    pos: int
    seq_tag: Optional[str]
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class MappingReported(WorkerEvent, RunEvent):
    """The worker is about to map seq `seq_tag` of the suspect batch at `pos` (it runs it alone)."""

    run: int
    pos: int
    seq_tag: Optional[str]


@dataclass(frozen=True, slots=True)
class StreamAcked(WorkerEvent, RunEvent):
    run: int
    partition: int
    incarnation: int
    n: int


@dataclass(frozen=True, slots=True)
class StreamOutputsReceived(WorkerEvent, RunEvent):
    run: int
    partition: int
    incarnation: int
    items: List[Item] = field(default_factory=list)
    bad: List[BadItem] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StreamFinished(WorkerEvent, RunEvent):
    run: int
    partition: int
    incarnation: int


@dataclass(frozen=True, slots=True)
class StreamFailed(WorkerEvent, RunEvent):
    run: int
    partition: int
    incarnation: int
    seq_tag: Optional[str]
    message: str
    traceback: str


@dataclass(frozen=True, slots=True)
class LocalWorkerExited(Event):
    """A worker process the server started exited (its supervisor reaped it)."""

    local_index: int
    pid: int
    returncode: int


@dataclass(frozen=True, slots=True)
class RetireWorker(Event):
    """The pool is to shrink by this worker: it gets no new work, and once it holds none it is
    told to exit (nothing it does is redone)."""

    wid: bytes


@dataclass(frozen=True, slots=True)
class Tick(Event):
    """Time passed: heartbeats are due, silent workers expire. `reader_busy` says what the
    reader is doing when it has been at it for a while (e.g. "in get_seq for 12.0 s"; None: it
    is not, or not for long)."""

    reader_busy: Optional[str] = None


# ---- runs and the reader ------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EpochRequested(Event):
    """A client asks for rank `rank`'s shard of an epoch of job `job` (the request's form is checked).

    `requester` is the REQ identity the reply goes to; `consumer` the data socket's.
    """

    requester: bytes
    consumer: bytes
    epoch: int
    job: str = "default"
    rank: int = 0
    world_size: int = 1
    start: int = 0
    seq_list: Optional[List[str]] = None
    seq_order: Optional[List[int]] = None
    drop_last: bool = True
    timeout: float = 30.0
    subshard: int = 0
    subshards: int = 1
    direct: str = ""  # the client's direct endpoint ("": results through the server)
    direct_key: bytes = b""
    host: str = ""
    batching: Optional[Batching] = None  # the job's cut (the server's default applied); None: seq by seq
    sharding: str = STRIDED  # or CONTIGUOUS: RETURNN's shards (server/shards.py)

    @property
    def lane(self) -> int:
        return lane_of(self.rank, self.world_size, self.subshard, self.subshards, self.sharding)

    @property
    def job_key(self) -> Tuple[str, int, bool, int, Optional[Batching], str]:
        return (self.job, self.world_size, self.drop_last, self.subshards, self.batching, self.sharding)


@dataclass(frozen=True, slots=True)
class RunChecked(Event, RunEvent):
    """The reader checked the run's request against the dataset; it will set the epoch up
    once the runs of other epochs have stopped reading."""

    run: int


@dataclass(frozen=True, slots=True)
class RunRejected(Event, RunEvent):
    """The reader refused the request (e.g. an unknown seq tag); nothing running is touched."""

    run: int
    message: str


@dataclass(frozen=True, slots=True)
class RunStarted(Event, RunEvent):
    """The reader set up the dataset for this run's epoch; `num_seqs` inputs will follow."""

    run: int
    epoch: int
    num_seqs: Optional[int]  # seqs, or batches of a batched map_seq run; None: learnt by reading (InputsEnded)
    check_tags: bool = False
    seqs: Optional[int] = None  # seqs of the epoch (also of a batched one), if known (else: num_seqs unbatched)


@dataclass(frozen=True, slots=True)
class InputsRead(Event, RunEvent):
    """Inputs the reader read: seqs, or the batches of a batched map_seq run."""

    run: int
    items: List[Union[Item, Batch]]


@dataclass(frozen=True, slots=True)
class InputsEnded(Event, RunEvent):
    """A dataset whose count was not known in advance has no seq at `count`: the epoch has
    `count` inputs (batches, of a batched map_seq run), and the positions asked for from there
    on will not come."""

    run: int
    count: int
    seqs: Optional[int] = None  # the epoch's seqs (else: `count`, unbatched)


@dataclass(frozen=True, slots=True)
class ReplayRead(Event, RunEvent):
    """Inputs read again for a stream partition that restarts on another worker."""

    run: int
    partition: int
    ticket: int
    items: List[Item]


@dataclass(frozen=True, slots=True)
class ReadFailed(Event, RunEvent):
    run: int
    message: str
    traceback: str = ""


@dataclass(frozen=True, slots=True)
class RunFailedElsewhere(Event, RunEvent):
    """Fail a run for a reason outside the scheduler (an internal error of the server)."""

    run: int
    message: str


# ---- clients ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CreditGranted(Event, RunEvent):
    consumer: bytes
    run: int
    total: int
    consumed: int = 0


@dataclass(frozen=True, slots=True)
class MissingReported(Event, RunEvent):
    """The client has waited long for the seq at `pos`: a direct result may have been lost."""

    consumer: bytes
    run: int
    pos: int


@dataclass(frozen=True, slots=True)
class ConsumerAlive(Event):
    """A client's keepalive: its data socket `consumer` lives (its process does, at least)."""

    consumer: bytes


@dataclass(frozen=True, slots=True)
class ConsumerClosed(Event):
    consumer: bytes
