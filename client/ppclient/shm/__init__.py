"""Shared-memory segments that carry array bytes between two processes on one host.

A producer copies a seq's arrays into a block of its `Segment` and sends only a header naming
the block (`Ref`) over ZeroMQ; the consumer maps the producer's segment once (`Mapping`)
and turns each block into numpy arrays that are views of the shared memory: the bytes are
copied once, into the block, and never again.

Segments are anonymous memfds, never files in /dev/shm: the kernel frees one once no
process maps it or holds its fd, so a kill -9 of either side leaves nothing behind. A
consumer opens the producer's memfd through /proc/<pid>/fd/<fd>, which needs the same host,
the same pid namespace and the right to look at the producer's fds; anything else raises
ShmUnavailable and the caller sends the bytes over the socket instead.

The consumer's rule: an array stays valid as long as the consumer references it (it or any
view of it). Once every array of a block is gone, the block is released and the producer
may reuse its memory; `release()` does that earlier, by hand, after which the block's
arrays must not be used. A consumer that holds arrays forever never blocks a producer: the
segment fills up, `alloc` returns None and the bytes travel over the socket.

A consumer marks a block taken when it makes arrays of it. So once a consumer has said it
takes no more blocks (it closed), its producer knows which of its blocks it never took
(still in a socket, or on the way) and frees those at once (`release_owner(taken=False)`);
the taken ones stay the consumer's until it drops their arrays, or exits.

The modules: `format` (what both sides agree on: the layout, the block states, the names a
message carries), `memfd` (making a segment within the memory available, and whether memfds
work here), `segment` (the producer's segment and its allocator of blocks), `mapping` (the
consumer's side).
"""

from .format import ALIGN, BLOCK_HEADER, SEGMENT_HEADER, Descriptor, Ref, ShmUnavailable, Spec
from .mapping import MAX_MAPPINGS, Mapping, release
from .memfd import COMMIT_STEP, MEMORY_SHARE, MIN_SIZE, RESERVE, host_id, probe, usable_host_id
from .segment import Block, Segment, layout, pack, view

__all__ = [
    "ALIGN",
    "BLOCK_HEADER",
    "COMMIT_STEP",
    "MAX_MAPPINGS",
    "MEMORY_SHARE",
    "MIN_SIZE",
    "RESERVE",
    "SEGMENT_HEADER",
    "Block",
    "Descriptor",
    "Mapping",
    "Ref",
    "Segment",
    "ShmUnavailable",
    "Spec",
    "host_id",
    "layout",
    "pack",
    "probe",
    "release",
    "usable_host_id",
    "view",
]
