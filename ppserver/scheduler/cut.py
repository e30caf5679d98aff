"""Cutting an epoch into batches: a pure function of the seqs' lengths (and durations) in epoch
order and the batching settings, so the batches never depend on workers, ranks, timing or crashes.

Greedy, as RETURNN's and Lhotse's samplers cut: a seq joins the current batch while the batch
keeps within `max_seqs` seqs, `max_frames` padded frames (seqs times the longest) and
`max_duration` seconds; a seq that alone breaks a cap is a batch of its own. With
`bucket_window` N, each run of N consecutive seqs of the epoch is sorted (stably) by length, or
by duration with `max_duration`, before it is cut, so a batch holds seqs of similar length (less
padding). The greedy cut runs on across windows: a window's last, unfilled batch takes the first
seqs of the next sorted window (Lhotse carries a bucket's remainder on the same way), so only the
epoch's last batch may be short and the window never caps a batch.

Seconds count as Lhotse's TimeConstraint counts them (lhotse/dataset/sampling/base.py): a seq of
d seconds counts as d, or d + d**2 / quadratic_duration, and a batch as its seqs times the
longest of those (`exceeded()`), in the same float arithmetic. A seq joins the batch exactly when
that constraint, given the batch and the seq, is not exceeded. Lhotse's DurationBatcher decides on
the batch's longest so far (`close_to_exceeding()`), so its batch may go over the cap by its last
seq, a longer one; here that seq starts the next batch. Otherwise the batches are Lhotse's.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from ppclient.batching import Batching

Batch = List[int]  # the epoch positions of a batch's seqs, in the order they are padded
Seq = Tuple[int, int, float]  # (epoch position, length, duration in seconds)


def counted_seconds(duration: float, quadratic_duration: Optional[float]) -> float:
    """A seq's duration as Lhotse's TimeConstraint counts it (its quadratic correction)."""
    if quadratic_duration is None:
        return duration
    return duration + (duration**2) / quadratic_duration


class _Greedy:
    """The batch being filled; `add` returns the batches it completes."""

    def __init__(self, b: Batching):
        self.max_seqs, self.max_frames, self.max_duration = b.max_seqs, b.max_frames, b.max_duration
        self.quadratic = b.quadratic_duration
        self.batch: Batch = []
        self.longest = 0
        self.longest_seconds = 0.0

    def add(self, pos: int, n: int, d: float = 0.0) -> List[Batch]:
        done = []
        cap = self.max_duration
        seconds = counted_seconds(d, self.quadratic) if cap is not None else 0.0
        if self.batch and (
            (self.max_frames is not None and (len(self.batch) + 1) * max(n, self.longest) > self.max_frames)
            or (cap is not None and (len(self.batch) + 1) * max(self.longest_seconds, seconds) > cap)
        ):
            done.append(self.batch)
            self.batch, self.longest, self.longest_seconds = [], 0, 0.0
        self.batch.append(pos)
        if n > self.longest:
            self.longest = n
        if seconds > self.longest_seconds:
            self.longest_seconds = seconds
        if self.max_seqs is not None and len(self.batch) >= self.max_seqs:
            done.append(self.batch)
            self.batch, self.longest, self.longest_seconds = [], 0, 0.0
        return done

    def finish(self) -> List[Batch]:
        done = [self.batch] if self.batch else []
        self.batch, self.longest, self.longest_seconds = [], 0, 0.0
        return done


def cut(seqs: Sequence[Tuple[int, int]], b: Batching) -> List[Batch]:
    """Batches of (position, length) pairs, cut in the order given."""
    greedy = _Greedy(b)
    out: List[Batch] = []
    for pos, n in seqs:
        out += greedy.add(pos, n)
    return out + greedy.finish()


class Cutter:
    """Cuts an epoch whose lengths (and durations) come one seq at a time (as a reader reads them):
    `add` returns the batches complete by now, `finish` the rest at the epoch's end. The same
    lengths and durations give the same batches as `cut_epoch`."""

    def __init__(self, batching: Batching):
        self.window_size = batching.bucket_window
        self.by_duration = batching.max_duration is not None  # what a window is sorted by
        self.greedy = _Greedy(batching)
        self.window: List[Seq] = []

    def add(self, pos: int, length: int, duration: float = 0.0) -> List[Batch]:
        if self.window_size == 1:
            return self.greedy.add(pos, length, duration)
        self.window.append((pos, length, duration))
        if len(self.window) < self.window_size:
            return []
        return self._window()

    def finish(self) -> List[Batch]:
        """The batches of what is left at the epoch's end (the last one may be short)."""
        return self._window() + self.greedy.finish()

    def _window(self) -> List[Batch]:
        """The window so far, sorted, into the greedy cut (whose unfilled batch stays open)."""
        window, self.window = self.window, []
        out: List[Batch] = []
        # stable: equal lengths (durations) keep the epoch's order
        for pos, n, d in sorted(window, key=(lambda s: s[2]) if self.by_duration else (lambda s: s[1])):
            out += self.greedy.add(pos, n, d)
        return out


def cut_epoch(
    lengths: Optional[Sequence[int]], b: Batching, durations: Optional[Sequence[float]] = None
) -> List[Batch]:
    """Every batch of an epoch whose seq lengths (in epoch order) are known up front, and their
    durations in seconds where the batching has max_duration. A measure the batching does not
    use may be None (see Batching.uses_lengths)."""
    if lengths is None and durations is None:
        raise ValueError("cut_epoch needs the seqs' lengths or durations")
    count = len(lengths) if lengths is not None else len(durations)  # type: ignore[arg-type]
    if b.uses_lengths and lengths is None:
        raise ValueError(f"batches of {b.describe()} need the seqs' lengths")
    if b.max_duration is not None and durations is None:
        raise ValueError(f"batches of {b.describe()} need the seqs' durations")
    if lengths is not None and durations is not None and len(lengths) != len(durations):
        raise ValueError(f"{len(lengths)} lengths but {len(durations)} durations")
    cutter = Cutter(b)
    out: List[Batch] = []
    ns, ds = _values(lengths, count, 0), _values(durations, count, 0.0)
    for pos, (n, d) in enumerate(zip(ns, ds)):
        out += cutter.add(pos, int(n), float(d))
    return out + cutter.finish()


def _values(values: Optional[Sequence], count: int, zero: float) -> Sequence:
    """A measure's values as a list to iterate (Python numbers), zeros where it is not given."""
    if values is None:
        return [zero] * count
    return values.tolist() if isinstance(values, np.ndarray) else values
