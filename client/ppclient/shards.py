"""Which lane of a job's epoch a reader takes: the rule the server and every client share.

A job has world_size ranks of `subshards` readers each (a DataLoader's workers), one lane each;
position p of an epoch goes to lane p % lanes. Strided shards (PyTorch's DistributedSampler)
number the lanes rank + reader * world_size, so that every rank gets the positions
i % world_size == rank. Contiguous shards (RETURNN's) number them rank * subshards + reader, as
RETURNN's `set_sharding` numbers a DataLoader worker's shard, and the server serves lane l the
l-th contiguous chunk of the epoch's order (ppserver/server/shards.py).
"""

from __future__ import annotations

from typing import Tuple

STRIDED = "strided"
CONTIGUOUS = "contiguous"
SHARDINGS = (STRIDED, CONTIGUOUS)


def lane_of(rank: int, world_size: int, reader: int, subshards: int, sharding: str) -> int:
    """The lane of reader `reader` of rank `rank`."""
    return rank * subshards + reader if sharding == CONTIGUOUS else rank + reader * world_size


def reader_of(lane: int, world_size: int, subshards: int, sharding: str) -> Tuple[int, int]:
    """(rank, reader of the rank) of a lane."""
    if sharding == CONTIGUOUS:
        return divmod(lane, subshards)
    reader, rank = divmod(lane, world_size)
    return rank, reader
