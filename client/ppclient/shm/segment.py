"""The producer's side: its segment, the blocks it hands out of it, and packing arrays into one."""

from __future__ import annotations

import bisect
import math
import mmap
import os
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from . import memfd
from .format import (
    BLOCK_HEADER,
    IN_USE,
    MAGIC,
    OWNER_TAG_BYTES,
    RELEASED,
    SEGMENT_HEADER,
    TAKEN,
    Descriptor,
    Ref,
    round_up,
)


class Block:
    """A block handed out by a Segment: fill `data` (writable, `nbytes` long), then send `ref()`."""

    __slots__ = ("_segment", "data", "nbytes", "offset", "seq")

    def __init__(self, segment: Segment, offset: int, nbytes: int, seq: int, data: np.ndarray):
        self._segment = segment
        self.offset = offset
        self.nbytes = nbytes
        self.seq = seq
        self.data = data

    def ref(self) -> Ref:
        return Ref(self.offset, self.nbytes, self.seq)

    def release(self) -> None:
        """Give the block back without a consumer (its Ref was never sent, say)."""
        self._segment._release(self.offset - BLOCK_HEADER, self.seq)


class Segment:
    """A producer's segment (one thread uses it): it makes the memfd, owns it until `close()`, and
    hands out blocks of it with a next-fit allocator; `descriptor` is what a consumer maps it by.

    Blocks are placed one after the other from where the last one ended, wrapping to the
    start of the segment; a block goes into the first gap from there that is large enough.
    A released block's room is reused as soon as it is released, whatever blocks before it
    are still held: a consumer that keeps one seq's arrays for long holds only their block.
    The allocator trusts only the state words in shared memory: the layout of its blocks it
    keeps to itself (their offsets in order, so a gap is found by looking at neighbours).
    """

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < memfd.MIN_SIZE:
            raise ValueError(f"size must be an int >= {memfd.MIN_SIZE}, got {size!r}")
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._fd, mm = memfd.create(size)
        token = int.from_bytes(os.urandom(8), "little")
        mm[:16] = MAGIC + token.to_bytes(8, "little")
        self._mm: Optional[mmap.mmap] = mm
        self._words: Optional[np.ndarray] = np.frombuffer(mm, np.uint64)
        self._bytes: Optional[np.ndarray] = np.frombuffer(mm, np.uint8)
        self.descriptor = Descriptor(memfd.host_id(), os.getpid(), self._fd, size, token)
        self._start = SEGMENT_HEADER
        self._end = size
        self._head = self._start  # where the next block is tried first
        self._used = 0  # bytes of the blocks in the lists below
        self._seq = 0
        # blocks not known to be released, by offset: their header offsets, and (span, seq, owner)
        self._offsets: List[int] = []
        self._blocks: List[Tuple[int, int, bytes]] = []

    @property
    def capacity(self) -> int:
        return self._end - self._start

    def alloc(self, nbytes: int, owner: bytes = b"") -> Optional[Block]:
        """A block of `nbytes` for consumer `owner`, or None when the segment has no room for it."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        words, data = self._words, self._bytes
        if words is None or data is None:
            raise ValueError("segment is closed")
        if os.getpid() != self.descriptor.pid:  # a forked child would overwrite its parent's blocks
            raise ValueError("a segment belongs to the process that created it")
        span = BLOCK_HEADER + round_up(nbytes)
        at = self._at_head(span)
        if at is None:
            self._reclaim()
            at = self._fit(span)
            if at is None:
                return None
        self._seq += 1
        seq = self._seq
        i = at // 8
        words[i + 1] = span
        words[i + 2] = nbytes
        tag = bytes(owner[:OWNER_TAG_BYTES])
        words[i + 3] = len(tag)
        if tag:
            data[at + 32 : at + 32 + len(tag)] = np.frombuffer(tag, np.uint8)
        words[i] = (seq << 8) | IN_USE
        k = bisect.bisect_left(self._offsets, at)
        self._offsets.insert(k, at)
        self._blocks.insert(k, (span, seq, bytes(owner)))
        self._used += span
        end = at + span
        self._head = end if end < self._end else self._start
        offset = at + BLOCK_HEADER
        return Block(self, offset, nbytes, seq, data[offset : offset + nbytes])

    def _at_head(self, span: int) -> Optional[int]:
        """The head, if a block of `span` bytes fits there before the next block (the usual case)."""
        head = self._head
        k = bisect.bisect_left(self._offsets, head)
        limit = self._offsets[k] if k < len(self._offsets) else self._end
        return head if limit - head >= span else None

    def _fit(self, span: int) -> Optional[int]:
        """The start of the first gap of `span` bytes from the head on, wrapping; None if none."""
        gaps: List[Tuple[int, int]] = []
        prev = self._start
        for at, (size, _, _) in zip(self._offsets, self._blocks):
            if at > prev:
                gaps.append((prev, at))
            prev = at + size
        if self._end > prev:
            gaps.append((prev, self._end))
        head = self._head
        for lo, hi in [g for g in gaps if g[1] > head] + [g for g in gaps if g[1] <= head]:
            lo = max(lo, head) if lo <= head < hi and hi - head >= span else lo
            if hi - lo >= span:
                return lo
        return None

    def _reclaim(self) -> None:
        """Forget the blocks whose consumers released them: their room is free."""
        words = self._words
        if words is None:
            return
        keep_at: List[int] = []
        keep: List[Tuple[int, int, bytes]] = []
        used = 0
        for at, block in zip(self._offsets, self._blocks):
            if int(words[at // 8]) != (block[1] << 8) | RELEASED:
                keep_at.append(at)
                keep.append(block)
                used += block[0]
        self._offsets, self._blocks, self._used = keep_at, keep, used
        if not keep:
            self._head = self._start

    def _release(self, at: int, seq: int) -> None:
        words = self._words
        if words is not None and int(words[at // 8]) == (seq << 8) | IN_USE:
            words[at // 8] = (seq << 8) | RELEASED

    def release_owner(self, owner: bytes, taken: bool = True) -> int:
        """Release every block handed to `owner` (a consumer known to be gone); returns how many.
        `taken=False`: only those it never made arrays of (a consumer that said it takes no more
        blocks: those it took may still be in use).

        Only for consumers that are gone: one still alive would find its arrays overwritten
        (its own late releases are harmless: they name the blocks' old seqs).
        """
        words = self._words
        if words is None:
            return 0
        n = 0
        for at, (_span, seq, who) in zip(self._offsets, self._blocks):
            state = int(words[at // 8])
            if who == owner and (state == (seq << 8) | IN_USE or (taken and state == (seq << 8) | TAKEN)):
                words[at // 8] = (seq << 8) | RELEASED
                n += 1
        self._reclaim()
        return n

    def untaken(self) -> int:
        """Blocks handed out that their consumers have not made arrays of yet (still on the way, or
        unread in their sockets): a producer that exits now would take them with it."""
        words = self._words
        if words is None:
            return 0
        return sum(
            1
            for at, (_span, seq, _who) in zip(self._offsets, self._blocks)
            if int(words[at // 8]) == (seq << 8) | IN_USE
        )

    def used(self) -> int:
        """Bytes not reusable yet: the blocks in use, with their headers."""
        self._reclaim()
        return self._used

    def free(self) -> int:
        """Capacity minus used(); a block of this size may still not fit (the free space can be split)."""
        return self.capacity - self.used()

    def close(self) -> None:
        """Close the segment: consumers can no longer open it; the memory goes with the last mapping."""
        if self._words is None:
            return
        self._words = self._bytes = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # Block.data still referenced: unmapped when that goes
                pass
        os.close(self._fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules may be gone already
            pass

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def layout(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """Where arrays of these byte sizes lie in one block (each at a 64-byte aligned offset), and
    the block's size."""
    offsets: List[int] = []
    pos = 0
    for n in sizes:
        pos = round_up(pos)
        offsets.append(pos)
        pos += n
    return offsets, pos


def view(block: Block, offset: int, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """A writable array of the block's memory at `offset` (as `layout` placed it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return block.data[offset : offset + nbytes].view(dtype).reshape(shape)


def pack(segment: Segment, arrays: List[np.ndarray], owner: bytes = b"") -> Optional[Tuple[Block, List[int]]]:
    """Copy `arrays` into one block (each at a 64-byte aligned offset, one copy each).

    Returns the block and each array's offset in it, or None when the segment has no room.
    """
    arrays = [np.asarray(a) for a in arrays]
    for a in arrays:
        if a.dtype.hasobject:
            raise ValueError(f"cannot pack an array of dtype {a.dtype}")
    offsets, size = layout([a.nbytes for a in arrays])
    block = segment.alloc(size, owner)
    if block is None:
        return None
    for a, off in zip(arrays, offsets):
        if a.nbytes:
            view(block, off, a.dtype, a.shape)[...] = a
    return block, offsets
