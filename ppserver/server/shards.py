"""Contiguous shards (RETURNN's) served through the strided lanes: a run's positions in another order.

The scheduler deals position p to lane p % lanes (jobs.py); for contiguous shards lane
rank * readers + reader (ppclient/shards.py), the index RETURNN's `set_sharding` gives a rank's
DataLoader worker. RETURNN cuts an epoch's order into `lanes` consecutive chunks
(`Dataset._apply_partition_epoch_and_sharding`: the first num_seqs % lanes chunks one seq
longer, as the strided rule gives the first num_seqs % lanes lanes one more position). Serving
position p = row * lanes + lane as the seq at row `row` of chunk `lane` gives every lane exactly
RETURNN's shard, in order, and leaves everything the scheduler does by position (exactly once,
release in order, resume, solo runs) as it is. The reader reads the chunks side by side, one
seq of each in turn, so the dataset must read at any position; a seq keeps its `seq_idx` (the
epoch position, so its rng is that of the strided epoch), and its `complete_frac` is how far its
chunk has got, as RETURNN gives a shard's.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List


def chunk_starts(num_seqs: int, lanes: int) -> List[int]:
    """Where each of RETURNN's `lanes` chunks of an epoch of `num_seqs` starts, and the end."""
    size, longer = divmod(num_seqs, lanes)
    starts = [0]
    for lane in range(lanes):
        starts.append(starts[-1] + size + (lane < longer))
    return starts


class Contiguous:
    """A run's positions as epoch positions: position p is row p // lanes of chunk p % lanes."""

    def __init__(self, num_seqs: int, lanes: int):
        self.lanes = lanes
        starts = chunk_starts(num_seqs, lanes)
        self.starts = starts[:-1]  # by lane
        self.sizes = [end - start for start, end in itertools.pairwise(starts)]

    def epoch_pos(self, pos: int) -> int:
        row, lane = divmod(pos, self.lanes)
        return self.starts[lane] + row

    def served(self, pos: int, seq: Dict[str, Any]) -> Dict[str, Any]:
        """The seq read at epoch_pos(pos), with its chunk's complete_frac."""
        row, lane = divmod(pos, self.lanes)
        out = dict(seq)
        out["complete_frac"] = (row + 1) / self.sizes[lane]
        return out
