"""What happens to the scheduler: each event carries the time it happened (`now`, monotonic s).

The server turns checked protocol messages, reader hand-overs, process exits and the clock
into these; nothing else reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ppclient.protocol import BadItem, Item


@dataclass(frozen=True)
class Event:
    now: float


# ---- workers ----------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerJoined(Event):
    """A worker passed the protocol and fingerprint checks (the server has welcomed it)."""

    wid: bytes
    host: str
    pid: int
    local_index: Optional[int] = None
    replaces: Optional[bytes] = None


@dataclass(frozen=True)
class WorkerEvent(Event):
    """Anything from a registered worker; an unknown `wid` is told so and otherwise ignored."""

    wid: bytes


@dataclass(frozen=True)
class HeartbeatReceived(WorkerEvent):
    pass


@dataclass(frozen=True)
class WorkerLeft(WorkerEvent):
    """The worker said goodbye: its work goes back to the queue, nothing is blamed."""


@dataclass(frozen=True)
class ResultsReceived(WorkerEvent):
    run: int
    items: List[Item] = field(default_factory=list)
    bad: List[BadItem] = field(default_factory=list)


@dataclass(frozen=True)
class TaskFailed(WorkerEvent):
    run: int
    pos: int
    seq_tag: Optional[str]
    message: str
    traceback: str


@dataclass(frozen=True)
class StreamAcked(WorkerEvent):
    run: int
    partition: int
    n: int


@dataclass(frozen=True)
class StreamOutputsReceived(WorkerEvent):
    run: int
    partition: int
    items: List[Item] = field(default_factory=list)
    bad: List[BadItem] = field(default_factory=list)


@dataclass(frozen=True)
class StreamFinished(WorkerEvent):
    run: int
    partition: int


@dataclass(frozen=True)
class StreamFailed(WorkerEvent):
    run: int
    partition: int
    seq_tag: Optional[str]
    message: str
    traceback: str


@dataclass(frozen=True)
class LocalWorkerExited(Event):
    """A worker process the server started exited (its supervisor reaped it)."""

    local_index: int
    pid: int
    returncode: int


@dataclass(frozen=True)
class Tick(Event):
    """Time passed: heartbeats are due, silent workers expire. `reader_busy` says what the
    reader is doing when it has been at it for a while (e.g. "in get_seq for 12.0 s")."""

    reader_busy: str = ""


# ---- runs and the reader ------------------------------------------------------------------
@dataclass(frozen=True)
class RunRequested(Event):
    """A client's epoch request passed the server's checks; the reader is preparing it."""

    run: int
    epoch: int
    consumer: bytes


@dataclass(frozen=True)
class RunRejected(Event):
    """The reader refused the request (e.g. an unknown seq tag); the running epoch is untouched."""

    run: int
    message: str


@dataclass(frozen=True)
class RunStarted(Event):
    """The reader set up the dataset for this run's epoch; `num_seqs` inputs will follow."""

    run: int
    epoch: int
    num_seqs: int
    check_tags: bool = False


@dataclass(frozen=True)
class InputsRead(Event):
    run: int
    items: List[Item]


@dataclass(frozen=True)
class InputsEnded(Event):
    run: int
    count: int


@dataclass(frozen=True)
class ReplayRead(Event):
    """Inputs read again for a stream partition that restarts on another worker."""

    run: int
    partition: int
    ticket: int
    items: List[Item]


@dataclass(frozen=True)
class ReadFailed(Event):
    run: int
    message: str
    traceback: str = ""


@dataclass(frozen=True)
class RunFailedElsewhere(Event):
    """Fail a run for a reason outside the scheduler (an internal error of the server)."""

    run: int
    message: str


# ---- clients ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CreditGranted(Event):
    consumer: bytes
    run: int
    total: int
