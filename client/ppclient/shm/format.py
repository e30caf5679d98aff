"""What a producer and its consumers agree on: a segment's layout, the states of its blocks,
and how a message names a segment (`Descriptor`) and a block in it (`Ref`).

A segment starts with SEGMENT_HEADER bytes (MAGIC, then a random token); each block with
BLOCK_HEADER bytes: its state word, its span, its size and its owner's tag.

Memory ordering, kept simple: the producer fills a block before it hands the Ref to
ZeroMQ, whose send and receive (system calls, locks) order the data before the consumer's
first read. The consumer marks a block taken, and releases it, with one aligned 8-byte store
each to its state word (one instruction on x86-64 and arm64, never torn), which the producer
loads before it reuses the block; it marks before it says it closed (a message: system calls
again), so the producer never frees a block the consumer took. This assumes the consumer's
last reads of a block are visible as done before its release: guaranteed on x86-64 (stores
are not reordered before earlier loads), and in practice elsewhere, since the store runs only
after the arrays became garbage.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, NamedTuple, Sequence, Tuple

from ..errors import Error

ALIGN = 64  # blocks and the arrays packed into them start on cache lines
SEGMENT_HEADER = 64  # magic (8 bytes) + token (8 bytes), then zeros
BLOCK_HEADER = 64  # state word, span, nbytes, owner tag length, owner tag (32 bytes)
MAGIC = b"ppshm\x00\x00\x01"
OWNER_TAG_BYTES = 32  # the owner tag in shared memory is informational: the allocator keeps the full owner

# Block states, the low byte of a block's state word; the rest of the word is the block's
# seq, so a release through a stale Ref (the block reused since) changes nothing.
IN_USE = 1  # handed out by the producer
RELEASED = 2  # free: the producer may reuse its room
TAKEN = 3  # in use, and the consumer has made arrays of it


class ShmUnavailable(Error):
    """A segment (or a block in it) cannot be used here; the message says why."""


@dataclass(frozen=True)
class Descriptor:
    """What a consumer needs to find a producer's segment; `to_dict()` is msgpack-able.

    `token` is random per segment and also written at its start, so a descriptor whose
    pid or fd was reused since is told from the real one.
    """

    host: str
    pid: int
    fd: int
    size: int
    token: int

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Descriptor:
        """Parse a descriptor from the network; anything malformed is ShmUnavailable."""
        try:
            d = cls(**data)
        except TypeError:
            raise ShmUnavailable(f"malformed descriptor {data!r:.200}") from None
        ints = (d.pid, d.fd, d.size, d.token)
        if not isinstance(d.host, str) or not all(isinstance(x, int) and not isinstance(x, bool) for x in ints):
            raise ShmUnavailable(f"malformed descriptor {data!r:.200}")
        return d


class Ref(NamedTuple):
    """A block as a message names it (a tuple, so msgpack sends it as a list)."""

    offset: int  # of the block's data, from the start of the segment
    nbytes: int
    seq: int


Spec = Tuple[str, str, Sequence[int], int]  # (key, dtype str, shape, offset within the block)


def round_up(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return (n + ALIGN - 1) // ALIGN * ALIGN
