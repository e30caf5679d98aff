"""Cutting an epoch into batches: a pure function of the seqs' lengths in epoch order and the
batching settings, so the batches never depend on workers, ranks, timing or crashes.

Greedy, as RETURNN's and Lhotse's samplers cut: a seq joins the current batch while the batch
keeps within `max_seqs` seqs and `max_frames` padded frames (seqs times the longest); a seq
longer than `max_frames` is a batch of its own. With `bucket_window` N, each run of N
consecutive seqs of the epoch is sorted by length (stably) before it is cut, so a batch holds
seqs of similar length (less padding). The greedy cut runs on across windows: a window's last,
unfilled batch takes the first seqs of the next sorted window (Lhotse carries a bucket's
remainder on the same way), so only the epoch's last batch may be short and the window never
caps a batch.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from ppclient.batching import Batching

Batch = List[int]  # the epoch positions of a batch's seqs, in the order they are padded


class _Greedy:
    """The batch being filled; `add` returns the batches it completes."""

    def __init__(self, b: Batching):
        self.max_seqs, self.max_frames = b.max_seqs, b.max_frames
        self.batch: Batch = []
        self.longest = 0

    def add(self, pos: int, n: int) -> List[Batch]:
        done = []
        if (
            self.batch
            and self.max_frames is not None
            and (len(self.batch) + 1) * max(n, self.longest) > self.max_frames
        ):
            done.append(self.batch)
            self.batch, self.longest = [], 0
        self.batch.append(pos)
        if n > self.longest:
            self.longest = n
        if self.max_seqs is not None and len(self.batch) >= self.max_seqs:
            done.append(self.batch)
            self.batch, self.longest = [], 0
        return done

    def finish(self) -> List[Batch]:
        done = [self.batch] if self.batch else []
        self.batch, self.longest = [], 0
        return done


def cut(seqs: Sequence[Tuple[int, int]], b: Batching) -> List[Batch]:
    """Batches of (position, length) pairs, cut in the order given."""
    greedy = _Greedy(b)
    out: List[Batch] = []
    for pos, n in seqs:
        out += greedy.add(pos, n)
    return out + greedy.finish()


class Cutter:
    """Cuts an epoch whose lengths come one seq at a time (as a reader reads them): `add` returns
    the batches complete by now, `finish` the rest at the epoch's end. The same lengths give the
    same batches as `cut_epoch`."""

    def __init__(self, batching: Batching):
        self.window_size = batching.bucket_window
        self.greedy = _Greedy(batching)
        self.window: List[Tuple[int, int]] = []

    def add(self, pos: int, length: int) -> List[Batch]:
        if self.window_size == 1:
            return self.greedy.add(pos, length)
        self.window.append((pos, length))
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
        for pos, n in _sorted(window):
            out += self.greedy.add(pos, n)
        return out


def cut_epoch(lengths: Sequence[int], b: Batching) -> List[Batch]:
    """Every batch of an epoch whose seq lengths (in epoch order) are known up front."""
    cutter = Cutter(b)
    out: List[Batch] = []
    for pos, n in enumerate(lengths):
        out += cutter.add(pos, int(n))
    return out + cutter.finish()


def _sorted(window: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    return sorted(window, key=lambda pn: pn[1])  # stable: equal lengths keep the epoch's order
