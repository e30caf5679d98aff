"""What the scheduler asks of a run's dispatch, by what the run's work is.

A dispatch owns a running run's inputs, tasks and outputs: what to read, who maps what, what a
worker's departure or a message it could not take means for them, and the outputs in epoch
order. That much every run has (`Dispatch`). The rest depends on the mapper style, and so does
the class: `SeqWork` (map_seq: any worker maps any seq; results, direct results, tasks a worker
could not read or that failed; implemented by `seqs.SeqDispatch`) and `StreamWork`
(map_seq_stream: a partition is one stream on one worker; replayed inputs, acks, outputs, ends;
implemented by `streams.StreamDispatch`). The scheduler hands a worker's message to a run's
dispatch only if it is of the message's style: one of the other style's (a worker of another
config, or a late one) is nothing to the run, and no class has to say so.

Each method that may fail the run returns the Failure, and the scheduler fails it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeVar, Union

from ppclient.protocol import BadItem, Batch, Item
from ppserver.scheduler.events import Carried, CompletedReceived
from ppserver.scheduler.instructions import Instruction
from ppserver.scheduler.settings import Failure
from ppserver.scheduler.workers import WorkerState

Workers = Dict[bytes, WorkerState]
Room = Callable[[int], bool]  # whether the output at a position may be released now
D = TypeVar("D", bound="Dispatch")


@dataclass(frozen=True)
class Drop:
    """What a message a worker dropped unread carried, as far as it could be read: `carried`
    (which style's work), the tasks' `positions` (empty: every task of the run the worker holds)
    or the stream `partition` (None: every partition of the run it runs), and why."""

    carried: Carried
    positions: Sequence[int]
    partition: Optional[int]
    reason: str


@dataclass(frozen=True)
class Queues:
    """What waits where in a run's dispatch, for status (observe/status.py makes it the wire's
    `queues`, a key per field); each style adds its own."""

    fed: int  # inputs the reader gave it
    waiting_for_worker: int  # inputs no worker holds yet
    in_flight: int  # work workers hold: tasks, or stream partitions
    reorder_buffer: int  # outputs waiting for the ones before them


@dataclass(frozen=True)
class SeqQueues(Queues):
    """A map_seq run's."""

    kept_for_consumers: int  # results sent directly, kept until their consumer took them
    suspects: int  # seqs charged with a worker's death


@dataclass(frozen=True)
class StreamQueues(Queues):
    """A map_seq_stream run's."""

    partitions_done: int


class Dispatch(abc.ABC):
    """What every run's dispatch does, whichever the mapper style."""

    run: int

    @classmethod
    def of(cls: Type[D], d: Optional[Dispatch]) -> Optional[D]:
        """`d` if it is one of this class (a message of one style goes only to that style's)."""
        return d if isinstance(d, cls) else None

    # ---- reading ---------------------------------------------------------------------------
    @abc.abstractmethod
    def requests(self, capacity: int) -> List[int]:
        """Positions to read now (the workers' credit is `capacity` tasks)."""

    @abc.abstractmethod
    def add_inputs(self, items: Sequence[Union[Item, Batch]]) -> None:
        """Inputs the reader read (Batches only in a map_seq run that batches)."""

    @abc.abstractmethod
    def inputs_ended(self, count: int, end: Optional[int]) -> None:
        """The epoch has `count` inputs (learnt by reading); `end`: the first position no rank
        gets, if the outputs' count is known now."""

    @abc.abstractmethod
    def reading_done(self) -> bool:
        """Nothing more will be read: the reader may move on to another epoch."""

    # ---- workers -----------------------------------------------------------------------------
    @abc.abstractmethod
    def dispatch(self, workers: Workers, out: List[Instruction]) -> None:
        """Hand out the work the workers' credit allows."""

    # What a worker's departure or message takes back is handed out again by the next `dispatch`
    # (the step after every event), so these only change state.
    @abc.abstractmethod
    def worker_lost(self, w: WorkerState, crashed: bool) -> Optional[Failure]:
        """`w` is gone (the scheduler no longer holds it): its work goes to others; `crashed` charges it."""

    @abc.abstractmethod
    def malformed_message(self, w: WorkerState, reason: str) -> Optional[Failure]:
        """A message from `w` did not decode: everything of this run it holds is charged and redone."""

    @abc.abstractmethod
    def dropped(self, w: WorkerState, drop: Drop) -> Optional[Failure]:
        """`w` dropped a message of this run's style (or one it could not read) unread: what it
        carried is redone, charged."""

    # ---- delivery ----------------------------------------------------------------------------
    @abc.abstractmethod
    def pop_next(self, room: Room) -> Optional[Item]:
        """The next output in epoch order, if it is there and `room` lets it go."""

    @abc.abstractmethod
    def total(self) -> Optional[int]:
        """The epoch's outputs, once known."""

    @property
    @abc.abstractmethod
    def one_output_per_input(self) -> bool:
        """Whether the epoch has as many outputs as inputs (so its input count gives theirs)."""

    # ---- the end -------------------------------------------------------------------------------
    @abc.abstractmethod
    def close(self, workers: Workers) -> None:
        """The run ended: forget everything (the inputs a worker may still read go to its `retained`)."""

    @abc.abstractmethod
    def queues(self) -> Queues:
        """What waits where, for status."""

    @abc.abstractmethod
    def in_flight(self) -> int:
        """The work workers hold (tasks, or stream partitions): `queues().in_flight`, cheaply (each
        keepalive asks)."""

    @abc.abstractmethod
    def holds(self) -> List[int]:
        """The positions whose inputs it holds (to send, in flight, kept for consumers)."""

    @abc.abstractmethod
    def validate(self, workers: Workers) -> None:
        """Check the invariants of its docstring; AssertionError naming the first that does not hold."""


class SeqWork(Dispatch):
    """A map_seq run's dispatch: tasks, their results, and results sent to consumers directly."""

    # Results made again after they were released (a direct result lost on its way), to go to
    # their consumer at once; the scheduler empties it after every event.
    late: List[Item]
    # Results accepted since the last event that hold seqs map_seq skipped: (position, how many,
    # the first few tags); the scheduler counts them (skips.py) and empties it.
    skips: List[Tuple[int, int, List[str]]]

    @abc.abstractmethod
    def results_received(self, w: WorkerState, items: List[Item], bad: List[BadItem]) -> Optional[Failure]:
        """Results (and malformed ones) from `w`."""

    @abc.abstractmethod
    def completed(self, w: WorkerState, done: CompletedReceived) -> None:
        """Results `w` sent to their consumers itself: their positions and sizes, and the seqs of
        each the mapper skipped."""

    @abc.abstractmethod
    def inputs_lost(self, w: WorkerState, positions: List[int]) -> Tuple[int, Optional[Failure]]:
        """Tasks whose inputs `w` could not read; returns how many are redone."""

    @abc.abstractmethod
    def task_failed(self, w: WorkerState, pos: int) -> bool:
        """Whether a task's failure `w` reports fails the run."""

    @abc.abstractmethod
    def forget(self, lane: int, upto: int) -> None:
        """The consumer of `lane` has taken its outputs below index `upto` of the lane."""

    @abc.abstractmethod
    def redo_lost(self, pos: int) -> bool:
        """A released direct result its consumer never got: made again, to go through the server.
        False if there is nothing to redo (not a direct result that was released)."""


class StreamWork(Dispatch):
    """A map_seq_stream run's dispatch: partitions, each one stream on one worker."""

    # The credit the merge returned to the partitions' owners as `pop_next` took their outputs
    # (StreamCredit), for the scheduler to send right after the release and empty.
    credits: List[Instruction]

    @abc.abstractmethod
    def replay_read(self, partition: int, ticket: int, items: List[Item]) -> None:
        """Inputs read again for a partition that restarts."""

    @abc.abstractmethod
    def stream_acked(self, w: WorkerState, partition: int, incarnation: int, n: int) -> None:
        """A partition's owner took `n` more inputs."""

    @abc.abstractmethod
    def stream_outputs(
        self, w: WorkerState, partition: int, incarnation: int, items: List[Item], bad: List[BadItem]
    ) -> Optional[Failure]:
        """Outputs of a partition."""

    @abc.abstractmethod
    def stream_finished(self, w: WorkerState, partition: int, incarnation: int) -> None:
        """A partition ended."""

    @abc.abstractmethod
    def stream_failed(self, w: WorkerState, partition: int, incarnation: int) -> bool:
        """Whether a partition's failure `w` reports fails the run."""
