"""Checks of what a user passes to a Client: a bad value is one UsageError line naming it, raised
before anything is sent."""

from __future__ import annotations

from typing import Any, Tuple

from .errors import UsageError
from .shards import SHARDINGS

MAX_INT = 2**63 - 1  # what a message can carry
MAX_TIMEOUT_S = 365 * 86400.0


def int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise UsageError(f"{name} must be an int from {minimum} to 2**63 - 1, got {value!r}")
    return value


def timeout_arg(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise UsageError(f"timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g}, got {value!r}")
    return float(value)


def sharding_arg(sharding: Any) -> str:
    """How a job's ranks shard an epoch: "strided" or "contiguous" (RETURNN's shards)."""
    if sharding not in SHARDINGS:
        raise UsageError(f"sharding must be one of {', '.join(map(repr, SHARDINGS))}, got {sharding!r}")
    return str(sharding)


def shard_args(rank: Any, world_size: Any, subshard: Any) -> Tuple[int, int, int, int]:
    """(rank, world_size, subshard index, subshard count), each checked."""
    world_size = int_arg("world_size", world_size, 1)
    rank = int_arg("rank", rank, 0)
    if rank >= world_size:
        raise UsageError(f"rank {rank} must be below world_size {world_size}")
    if not (isinstance(subshard, tuple) and len(subshard) == 2):
        raise UsageError(f"subshard must be a pair (index, count), got {subshard!r}")
    count = int_arg("subshard count", subshard[1], 1)
    index = int_arg("subshard index", subshard[0], 0)
    if index >= count:
        raise UsageError(f"subshard index {index} must be below its count {count}")
    return rank, world_size, index, count
