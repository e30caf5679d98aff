"""A batched run's batches, as the reader cuts its epoch (scheduler/cut.py): up front where the
dataset knows every seq's length, else as the seqs are read, measured by the config's
`batch_length` or by the first axis of the batching's length key.

Cut as read, the run keeps the lengths of a bucket window, not its inputs: a seq read for the
cut is read again when its batch is handed over, so the server's memory does not grow with
`bucket_window`. Only without buckets (a window of 1: a batch is complete once the seq after it
is read) are the seqs read for the cut kept for their batch, at most a batch and one seq.

Each batch's `reach` is the largest epoch position in it and the batches before it: a batch's
`complete_frac` is that seq's, so it never goes back in delivery order however a window sorts.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ppclient.batching import Batching
from ppclient.protocol import Item
from ppserver.datasets.base import is_int
from ppserver.scheduler.cut import Cutter, cut_epoch

Length = Callable[[Dict[str, Any]], int]


class BatchedRun:
    """A batched run's batches: cut up front (`lengths` known), or as its seqs are read."""

    def __init__(self, batching: Batching, lengths: Optional[Any], length: Length):
        self.batches: List[List[int]] = []
        self.reach: List[int] = []  # per batch: the largest position in it and the batches before it
        self.cutter: Optional[Cutter] = None if lengths is not None else Cutter(batching)
        self.keep = batching.bucket_window == 1  # keep the seqs read for the cut (see the module's doc)
        self.length = length  # of a read seq, for the cut
        self.next_seq = 0  # the next seq to read, cutting as it goes
        self.read: Dict[int, Item] = {}  # seqs kept from the cut whose batch was neither handed over nor dropped
        self.low = 0  # the first batch whose read seqs may still be in `read`
        self.ended = lengths is not None  # every batch is known
        self.frac: Optional[Tuple[int, Any]] = None  # (position, its complete_frac) of the last reach looked up
        if lengths is not None:
            self._extend(cut_epoch(lengths, batching))

    @property
    def up_front(self) -> bool:
        return self.cutter is None

    def add(self, pos: int, item: Item, length: int) -> None:
        """A seq read to cut the epoch further, and its length; kept until its batch is handed
        over only without buckets."""
        assert self.cutter is not None
        if self.keep:
            self.read[pos] = item
        self.next_seq = pos + 1
        self._extend(self.cutter.add(pos, length))

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


def _checked_length(value: Any, what: str) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{what} must return an int >= 0, got {value!r:.60}")
    return int(value)
