"""A batched run's batches, as the reader cuts its epoch (scheduler/cut.py): up front where the
dataset knows every measure the cut uses (lengths, durations) for every seq, else as the seqs are
read, a seq's length measured by the config's `batch_length` or by the first axis of the
batching's length key, its duration by the config's `batch_duration` or the dataset's
`seq_durations()`.

Cut as read, the run keeps the lengths of a bucket window, not its inputs: a seq read for the
cut is read again when its batch is handed over, so the server's memory does not grow with
`bucket_window`. Only without buckets (a window of 1: a batch is complete once the seq after it
is read) are the seqs read for the cut kept for their batch, at most a batch and one seq.

Each batch's `reach` is the largest epoch position in it and the batches before it: a batch's
`complete_frac` is that seq's, so it never goes back in delivery order however a window sorts.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy

from ppclient.batching import Batching
from ppclient.protocol import Item
from ppserver.datasets.base import is_int
from ppserver.scheduler.cut import Cutter, cut_epoch

Length = Callable[[Dict[str, Any]], int]
Duration = Callable[[int, Dict[str, Any]], float]  # (epoch position, the read seq) -> seconds


def up_front(batching: Batching, lengths: Optional[Any], durations: Optional[Any]) -> bool:
    """Whether the epoch can be cut before reading: every measure the cut uses is known (and one
    of them gives the epoch's count)."""
    return (
        (lengths is not None or not batching.uses_lengths)
        and (durations is not None or batching.max_duration is None)
        and (lengths is not None or durations is not None)
    )


class BatchedRun:
    """A batched run's batches: cut up front (see `up_front`), or as its seqs are read."""

    def __init__(
        self,
        batching: Batching,
        lengths: Optional[Any],
        length: Length,
        durations: Optional[Any] = None,
        duration: Optional[Duration] = None,
    ):
        self.batches: List[List[int]] = []
        self.reach: List[int] = []  # per batch: the largest position in it and the batches before it
        ahead = up_front(batching, lengths, durations)
        self.cutter: Optional[Cutter] = None if ahead else Cutter(batching)
        self.keep = batching.bucket_window == 1  # keep the seqs read for the cut (see the module's doc)
        self.length = length if batching.uses_lengths else _no_length  # of a read seq, for the cut
        self.duration: Duration = duration or _no_duration  # of a read seq, for the cut
        self.next_seq = 0  # the next seq to read, cutting as it goes
        self.read: Dict[int, Item] = {}  # seqs kept from the cut whose batch was neither handed over nor dropped
        self.low = 0  # the first batch whose read seqs may still be in `read`
        self.ended = ahead  # every batch is known
        self.frac: Optional[Tuple[int, Any]] = None  # (position, its complete_frac) of the last reach looked up
        if ahead:
            self._extend(cut_epoch(lengths, batching, durations))

    @property
    def up_front(self) -> bool:
        return self.cutter is None

    def add(self, pos: int, item: Item, length: int, duration: float = 0.0) -> None:
        """A seq read to cut the epoch further, its length and duration; kept until its batch is
        handed over only without buckets."""
        assert self.cutter is not None
        if self.keep:
            self.read[pos] = item
        self.next_seq = pos + 1
        self._extend(self.cutter.add(pos, length, duration))

    def finish(self) -> None:
        """The epoch has no more seqs: the last batches are known."""
        assert self.cutter is not None
        self._extend(self.cutter.finish())
        self.ended = True

    def _extend(self, batches: List[List[int]]) -> None:
        reach = self.reach[-1] if self.reach else -1
        for batch in batches:
            reach = max(reach, *batch)
            self.batches.append(batch)
            self.reach.append(reach)

    def passed(self, index: int) -> None:
        """Batch `index` is handed over: the seqs read for batches before it (no one wants them) go."""
        for low in range(self.low, index):
            for pos in self.batches[low]:
                self.read.pop(pos, None)
        self.low = index + 1


def seq_length(batch_length: Optional[Callable[[Dict[str, Any]], Any]], key: Optional[str]) -> Length:
    """A read seq's length for the cut: the config's batch_length, else the first axis of `key`."""
    fn = batch_length
    if fn is not None:
        return lambda seq: _checked_length(fn(seq), "batch_length(seq)")

    def length(seq: Dict[str, Any]) -> int:
        array = seq.get(key) if key is not None else None
        if array is None:
            raise KeyError(f"the seq has no array {key!r}, the batching's length_key")
        return int(array.shape[0]) if getattr(array, "ndim", 0) else 1

    return length


def seq_duration(batch_duration: Optional[Callable[[Dict[str, Any]], Any]], durations: Optional[Any]) -> Duration:
    """A read seq's duration for the cut: the config's batch_duration, else the dataset's (the
    epoch's `durations`, by position)."""
    fn = batch_duration
    if fn is not None:
        return lambda pos, seq: checked_seconds(fn(seq), "batch_duration(seq)")
    if durations is None:
        return _no_duration
    return lambda pos, seq: float(durations[pos])


def checked_durations(durations: Any, count: Optional[int]) -> numpy.ndarray:
    """The dataset's durations of an epoch's seqs (epoch_durations()) as float64, checked: one per
    seq, each a finite number of seconds >= 0."""
    array = numpy.asarray(durations, dtype=numpy.float64)
    if array.ndim != 1 or (count is not None and len(array) != count):
        raise ValueError(f"the dataset's seq_durations() gave {array.shape} values for an epoch of {count} seqs")
    bad = numpy.flatnonzero(~numpy.isfinite(array) | (array < 0))
    if len(bad):
        value = float(array[bad[0]])
        raise ValueError(f"the dataset's seq_durations() gave {value!r} seconds for the epoch's seq {int(bad[0])}")
    return array


def checked_seconds(value: Any, what: str) -> float:
    """A duration a config function returned: a finite number of seconds >= 0."""
    if isinstance(value, (bool, numpy.bool_)) or not isinstance(value, (int, float, numpy.integer, numpy.floating)):
        raise ValueError(f"{what} must return a number of seconds >= 0, got {value!r:.60}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{what} must return a finite number of seconds >= 0, got {value!r:.60}")
    return seconds


def _no_length(seq: Dict[str, Any]) -> int:
    return 0  # the cut uses no lengths


def _no_duration(pos: int, seq: Dict[str, Any]) -> float:
    return 0.0  # the cut uses no durations


def _checked_length(value: Any, what: str) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{what} must return an int >= 0, got {value!r:.60}")
    return int(value)
