"""What the scheduler asks of a run's dispatch, whichever the mapper style.

A dispatch owns a running run's inputs, tasks and outputs: what to read, who maps what, what a
worker's message or departure means for them, and the outputs in epoch order. `SeqDispatch`
(map_seq: any worker maps any seq) and `StreamDispatch` (map_seq_stream: a partition is one
stream on one worker) implement it; the scheduler talks to them only through this class.

A message of the other style's (a stream message in a map_seq run, say: a worker of another
config, or a late one) is nothing to a dispatch: those methods have defaults that ignore it.
Each method that may fail the run returns the Failure, and the scheduler fails it.
"""

from __future__ import annotations

import abc
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from ppclient.protocol import BadItem, Batch, Item
from ppserver.scheduler.instructions import Instruction
from ppserver.scheduler.settings import Failure
from ppserver.scheduler.workers import WorkerState

Workers = Dict[bytes, WorkerState]
Room = Callable[[int], bool]  # whether the output at a position may be released now


class Dispatch(abc.ABC):
    run: int
    # Results made again after they were released (a direct result lost on its way), to go to
    # their consumer at once; the scheduler empties it after every event.
    late: List[Item]
    # Results accepted since the last event that hold seqs map_seq skipped: (position, how many,
    # the first few tags); the scheduler counts them (skips.py) and empties it.
    skips: List[Tuple[int, int, List[str]]]

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

    def replay_read(self, partition: int, ticket: int, items: List[Item]) -> None:
        """Inputs read again for a stream partition that restarts."""
        return None

    # ---- workers -----------------------------------------------------------------------------
    @abc.abstractmethod
    def dispatch(self, workers: Workers, out: List[Instruction]) -> None:
        """Hand out the work the workers' credit allows."""

    @abc.abstractmethod
    def worker_lost(self, w: WorkerState, crashed: bool, workers: Workers, out: List[Instruction]) -> Optional[Failure]:
        """`w` is gone (`workers` no longer holds it): its work goes to others; `crashed` charges it."""

    @abc.abstractmethod
    def malformed_message(
        self, w: WorkerState, reason: str, workers: Workers, out: List[Instruction]
    ) -> Optional[Failure]:
        """A message from `w` did not decode: everything of this run it holds is charged and redone."""

    @abc.abstractmethod
    def dropped(
        self,
        w: WorkerState,
        what: str,
        positions: List[int],
        partition: Optional[int],
        reason: str,
        workers: Workers,
        out: List[Instruction],
    ) -> Optional[Failure]:
        """`w` dropped a message of kind `what` unread ("": which is not known; `positions` empty and
        `partition` None: everything of this run it holds): what it carried is redone, charged."""

    def results_received(self, w: WorkerState, items: List[Item], bad: List[BadItem]) -> Optional[Failure]:
        """map_seq results (and malformed ones) from `w`."""
        return None

    def completed(
        self,
        w: WorkerState,
        positions: List[int],
        sizes: List[int],
        skipped: Sequence[int] = (),
        skipped_tags: Sequence[List[str]] = (),
    ) -> None:
        """map_seq results `w` sent to their consumers itself (and the seqs of each it skipped)."""
        return None

    def inputs_lost(self, w: WorkerState, positions: List[int]) -> Tuple[int, Optional[Failure]]:
        """map_seq tasks whose inputs `w` could not read; returns how many are redone."""
        return 0, None

    def task_failed(self, w: WorkerState, pos: int) -> bool:
        """Whether a map_seq task's failure `w` reports fails the run."""
        return False

    def stream_acked(self, w: WorkerState, partition: int, incarnation: int, n: int) -> None:
        """A stream partition's owner took `n` more inputs."""
        return None

    def stream_outputs(
        self,
        w: WorkerState,
        partition: int,
        incarnation: int,
        items: List[Item],
        bad: List[BadItem],
        workers: Workers,
        out: List[Instruction],
    ) -> Optional[Failure]:
        """Outputs of a stream partition."""
        return None

    def stream_finished(self, w: WorkerState, partition: int, incarnation: int) -> None:
        """A stream partition ended."""
        return None

    def stream_failed(self, w: WorkerState, partition: int, incarnation: int) -> bool:
        """Whether a stream partition's failure `w` reports fails the run."""
        return False

    # ---- delivery ----------------------------------------------------------------------------
    @abc.abstractmethod
    def pop_next(self, out: List[Instruction], room: Room) -> Optional[Item]:
        """The next output in epoch order, if it is there and `room` lets it go."""

    @abc.abstractmethod
    def total(self) -> Optional[int]:
        """The epoch's outputs, once known."""

    @property
    @abc.abstractmethod
    def one_output_per_input(self) -> bool:
        """Whether the epoch has as many outputs as inputs (so its input count gives theirs)."""

    def forget(self, lane: int, upto: int) -> None:
        """The consumer of `lane` has taken its outputs below index `upto` of the lane."""
        return None

    def redo_lost(self, pos: int) -> bool:
        """A released direct result its consumer never got: made again, to go through the server.
        False if there is nothing to redo (not a direct result that was released)."""
        return False

    # ---- the end -------------------------------------------------------------------------------
    @abc.abstractmethod
    def close(self, workers: Workers) -> None:
        """The run ended: forget everything (the inputs a worker may still read go to its `retained`)."""

    @abc.abstractmethod
    def queues(self) -> Dict[str, int]:
        """What waits where, for status."""

    @abc.abstractmethod
    def holds(self) -> List[int]:
        """The positions whose inputs it holds (to send, in flight, kept for consumers)."""

    @abc.abstractmethod
    def validate(self, workers: Workers) -> None:
        """Check the invariants of its docstring; AssertionError naming the first that does not hold."""
