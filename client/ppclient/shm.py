"""Shared-memory segments that carry array bytes between two processes on one host.

A producer copies a seq's arrays into a block of its `Ring` and sends only a header naming
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
ring fills up, `alloc` returns None and the bytes travel over the socket.

A consumer marks a block taken when it makes arrays of it. So once a consumer has said it
takes no more blocks (it closed), its producer knows which of its blocks it never took
(still in a socket, or on the way) and frees those at once (`release_owner(taken=False)`);
the taken ones stay the consumer's until it drops their arrays, or exits.

Memory: a segment is committed when it is created (posix_fallocate), so a machine short of
memory fails there, not later inside a write. On a memfd that commit does not fail with
ENOSPC when memory runs out (there is no size limit to hit): the kernel's OOM killer runs
instead. So a segment is created only if it takes at most a quarter of the memory available
(MemAvailable, and the headroom of this process's memory cgroup), and it is committed in
steps that stop once less than RESERVE bytes would be left; either way ShmUnavailable says
why and the caller uses sockets. A consumer cannot shrink the segment under the producer's
writes (SIGBUS): it is sealed against that.

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

import bisect
import collections
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np

from .errors import Error

ALIGN = 64  # blocks and the arrays packed into them start on cache lines
SEGMENT_HEADER = 64  # magic (8 bytes) + token (8 bytes), then zeros
BLOCK_HEADER = 64  # state word, span, nbytes, owner tag length, owner tag (32 bytes)
MAGIC = b"ppshm\x00\x00\x01"
OWNER_TAG_BYTES = 32  # the owner tag in shared memory is informational: the ring keeps the full owner
MIN_SIZE = 4096
MAX_MAPPINGS = 16  # mappings the cache keeps; beyond this the oldest is forgotten (still usable by its holders)
MEMORY_SHARE = 4  # a segment may take at most 1/MEMORY_SHARE of the memory available when it is created
RESERVE = 256 << 20  # committing a segment stops (and fails) rather than leave less memory available than this
COMMIT_STEP = 16 << 20  # bytes committed between two looks at the memory available

# Block states, the low byte of a block's state word; the rest of the word is the block's
# seq, so a release through a stale Ref (the block reused since) changes nothing.
IN_USE = 1  # handed out by the producer
RELEASED = 2  # free: the producer may reuse its room
TAKEN = 3  # in use, and the consumer has made arrays of it

_PLAIN_KINDS = set("biufcUSmM")  # what raw bytes rebuild without running code


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


def host_id() -> str:
    """Equal for two processes that can share segments: same host, same boot, same pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "?"
    return f"{os.uname().nodename}/{boot}/{pidns}"


def probe() -> Optional[str]:
    """None if segments work in this process, else why not (for the caller to log and fall back)."""
    if not hasattr(os, "memfd_create"):
        return "os.memfd_create is not available (Linux only)"
    try:
        fd = os.memfd_create("ppshm-probe", os.MFD_CLOEXEC)
    except OSError as exc:
        return f"memfd_create failed: {exc}"
    try:
        os.ftruncate(fd, MIN_SIZE)
        with mmap.mmap(fd, MIN_SIZE) as mm:
            mm[:8] = MAGIC
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.pread(reopened, 8, 0) != MAGIC:
                return "a memfd reopened through /proc/self/fd reads different bytes"
        finally:
            os.close(reopened)
    except OSError as exc:
        return f"memfd, mmap or /proc/self/fd do not work: {exc}"
    finally:
        os.close(fd)
    return None


def usable_host_id(log: logging.Logger, what: str) -> str:
    """This process's host id if segments work here; else "", after one log line saying that
    `what` goes over sockets and why."""
    reason = probe()
    if reason is None:
        return host_id()
    log.warning("%s over sockets: shared memory does not work here: %s", what, reason)
    return ""


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _available_memory() -> Optional[int]:
    """Bytes this process could still get without swapping or hitting its cgroup's limit (None: unknown)."""
    found: List[int] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) << 10)
                    break
    except (OSError, ValueError, IndexError):
        pass
    headroom = _cgroup_headroom()
    if headroom is not None:
        found.append(headroom)
    return min(found) if found else None


def _cgroup_headroom() -> Optional[int]:
    """A cgroup v2 memory limit minus what the cgroup uses (less its inactive file cache), if there is one."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        base = f"/sys/fs/cgroup{path.rstrip('/')}"
        with open(f"{base}/memory.max") as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(f"{base}/memory.current") as f:
            current = int(f.read())
        inactive_file = 0
        with open(f"{base}/memory.stat") as f:
            for line in f:
                if line.startswith("inactive_file "):
                    inactive_file = int(line.split()[1])
                    break
        return max(int(limit) - current + inactive_file, 0)
    except (OSError, ValueError):
        return None


def _check_memory(size: int) -> None:
    available = _available_memory()
    if available is not None and size * MEMORY_SHARE > available:
        raise ShmUnavailable(
            f"a segment of {size >> 20} MiB would take more than 1/{MEMORY_SHARE} of the memory "
            f"available ({available >> 20} MiB)"
        )


def _commit(fd: int, size: int) -> None:
    """Allocate the segment's pages now, in steps, stopping while the machine still has RESERVE left."""
    for start in range(0, size, COMMIT_STEP):
        n = min(COMMIT_STEP, size - start)
        available = _available_memory()
        if available is not None and available - n < RESERVE:
            raise ShmUnavailable(
                f"memory ran short while committing a segment of {size >> 20} MiB "
                f"({available >> 20} MiB available, {RESERVE >> 20} MiB kept free)"
            )
        try:
            os.posix_fallocate(fd, start, n)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):  # then the pages come on first touch
                return
            raise


def _create_segment(size: int) -> Tuple[int, mmap.mmap]:
    _check_memory(size)
    fd = os.memfd_create("ppshm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        _commit(fd, size)
        try:  # a consumer that truncates the segment must not make the producer's writes SIGBUS
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except (AttributeError, OSError):
            pass
        return fd, _mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise


def _mmap(fd: int, size: int) -> mmap.mmap:
    # MAP_POPULATE: the page tables are filled now, not by a fault on each page's first touch
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


class Block:
    """A block handed out by a Ring: fill `data` (writable, `nbytes` long), then send `ref()`."""

    __slots__ = ("_ring", "data", "nbytes", "offset", "seq")

    def __init__(self, ring: Ring, offset: int, nbytes: int, seq: int, data: np.ndarray):
        self._ring = ring
        self.offset = offset
        self.nbytes = nbytes
        self.seq = seq
        self.data = data

    def ref(self) -> Ref:
        return Ref(self.offset, self.nbytes, self.seq)

    def release(self) -> None:
        """Give the block back without a consumer (its Ref was never sent, say)."""
        self._ring._release(self.offset - BLOCK_HEADER, self.seq)


class Ring:
    """A next-fit allocator over one segment, for the producer (one thread).

    Blocks are placed one after the other from where the last one ended, wrapping to the
    start of the segment; a block goes into the first gap from there that is large enough.
    A released block's room is reused as soon as it is released, whatever blocks before it
    are still held: a consumer that keeps one seq's arrays for long holds only their block.
    The allocator trusts only the state words in shared memory: the layout of its blocks it
    keeps to itself (their offsets in order, so a gap is found by looking at neighbours).
    """

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
            raise ValueError(f"size must be an int >= {MIN_SIZE}, got {size!r}")
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        self._fd, mm = _create_segment(size)
        token = int.from_bytes(os.urandom(8), "little")
        mm[:16] = MAGIC + token.to_bytes(8, "little")
        self._mm: Optional[mmap.mmap] = mm
        self._words: Optional[np.ndarray] = np.frombuffer(mm, np.uint64)
        self._bytes: Optional[np.ndarray] = np.frombuffer(mm, np.uint8)
        self.descriptor = Descriptor(host_id(), os.getpid(), self._fd, size, token)
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
        """A block of `nbytes` for consumer `owner`, or None when the ring has no room for it."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        words, data = self._words, self._bytes
        if words is None or data is None:
            raise ValueError("ring is closed")
        if os.getpid() != self.descriptor.pid:  # a forked child would overwrite its parent's blocks
            raise ValueError("a ring belongs to the process that created it")
        span = BLOCK_HEADER + _round_up(nbytes)
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

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def layout(sizes: Sequence[int]) -> Tuple[List[int], int]:
    """Where arrays of these byte sizes lie in one block (each at a 64-byte aligned offset), and
    the block's size."""
    offsets: List[int] = []
    pos = 0
    for n in sizes:
        pos = _round_up(pos)
        offsets.append(pos)
        pos += n
    return offsets, pos


def view(block: Block, offset: int, dtype: np.dtype, shape: Sequence[int]) -> np.ndarray:
    """A writable array of the block's memory at `offset` (as `layout` placed it)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return block.data[offset : offset + nbytes].view(dtype).reshape(shape)


def pack(ring: Ring, arrays: List[np.ndarray], owner: bytes = b"") -> Optional[Tuple[Block, List[int]]]:
    """Copy `arrays` into one block (each at a 64-byte aligned offset, one copy each).

    Returns the block and each array's offset in it, or None when the ring has no room.
    """
    arrays = [np.asarray(a) for a in arrays]
    for a in arrays:
        if a.dtype.hasobject:
            raise ValueError(f"cannot pack an array of dtype {a.dtype}")
    offsets, size = layout([a.nbytes for a in arrays])
    block = ring.alloc(size, owner)
    if block is None:
        return None
    for a, off in zip(arrays, offsets):
        if a.nbytes:
            view(block, off, a.dtype, a.shape)[...] = a
    return block, offsets


def _plain_dtype(dtype_str: Any) -> np.dtype:
    if type(dtype_str) is str and dtype_str in _dtype_cache:
        return _dtype_cache[dtype_str]
    dtype = _check_plain_dtype(dtype_str)
    if len(_dtype_cache) < 256:
        _dtype_cache[dtype_str] = dtype
    return dtype


_dtype_cache: Dict[str, np.dtype] = {}


def _check_plain_dtype(dtype_str: Any) -> np.dtype:
    if not isinstance(dtype_str, str) or len(dtype_str) > 16:
        raise ValueError(f"bad dtype {dtype_str!r:.40}")
    try:
        dtype = np.dtype(dtype_str)
    except TypeError:
        raise ValueError(f"bad dtype {dtype_str!r}") from None
    if dtype.kind not in _PLAIN_KINDS or dtype.fields is not None or dtype.hasobject:
        raise ValueError(f"refused dtype {dtype_str!r}")
    return dtype


# Consumer side: live blocks by id() of their owner array (removed when it dies), for release().
_leases: Dict[int, weakref.finalize] = {}
_mappings: collections.OrderedDict[Tuple[str, int, int, int], Mapping] = collections.OrderedDict()
_mappings_lock = threading.RLock()  # clients in several threads of one process share the cache


def _release_block(words: np.ndarray, index: int, seq: int, key: int, pid: int) -> None:
    _leases.pop(key, None)
    if os.getpid() != pid:  # a forked copy of the arrays died; the parent's are still in use
        return
    if int(words[index]) in ((seq << 8) | TAKEN, (seq << 8) | IN_USE):
        words[index] = (seq << 8) | RELEASED  # the one store the producer waits for


class Mapping:
    """A consumer's mapping of one producer's segment, shared by every message naming it.

    Each `open()` is one use, given back by one `close()`; the last close unmaps the segment
    (at once, or when the last array of it is gone), so clients in one process share a
    mapping without closing it under each other.
    """

    def __init__(self, descriptor: Descriptor, mm: mmap.mmap, inode: int = 0):
        self.descriptor = descriptor
        self._mm: Optional[mmap.mmap] = mm
        self._words: Optional[np.ndarray] = np.frombuffer(mm, np.uint64)
        self._inode = inode  # the segment's, to tell when the producer has closed it
        self._users = 0

    @classmethod
    def open(cls, descriptor: Union[Descriptor, Dict[str, Any]]) -> Mapping:
        """The mapping of `descriptor`'s segment, mapped on first use; ShmUnavailable says why not."""
        d = descriptor if isinstance(descriptor, Descriptor) else Descriptor.from_dict(descriptor)
        key = (d.host, d.pid, d.fd, d.token)
        with _mappings_lock:
            m = _mappings.get(key)
            if m is not None:
                _mappings.move_to_end(key)
            else:
                m = cls(d, *_map(d))
                for old in [k for k in _mappings if not os.path.exists(f"/proc/{k[1]}")]:
                    del _mappings[old]  # its producer is gone: it sends no new blocks
                _mappings[key] = m
                while len(_mappings) > MAX_MAPPINGS:
                    _mappings.popitem(last=False)  # forgotten, not closed: its holders keep using it
            m._users += 1
            return m

    @staticmethod
    def close_all() -> None:
        """Drop every cached mapping, whoever uses it (each unmapped once its arrays are gone)."""
        with _mappings_lock:
            for m in list(_mappings.values()):
                m._unmap()

    def producer_gone(self) -> bool:
        """True once the producer has exited or closed the segment: no new block will come."""
        d = self.descriptor
        try:
            return os.stat(f"/proc/{d.pid}/fd/{d.fd}").st_ino != self._inode
        except OSError:
            return True

    def arrays(self, ref: Sequence[int], specs: Sequence[Spec]) -> Dict[str, np.ndarray]:
        """The arrays of block `ref` as writable views of the shared memory (no copy), by key.

        The block is released once every returned array (and every view of one) is gone,
        or by `release()`; so each Ref is turned into arrays once. Bad specs raise
        ValueError and release the block (its arrays cannot be used).
        """
        return {spec[0]: view for spec, view in zip(specs, self.views(ref, specs))}

    def views(self, ref: Sequence[int], specs: Sequence[Spec]) -> List[np.ndarray]:
        """As `arrays`, in the order of `specs` (keys may repeat: several seqs in one block)."""
        words, mm = self._words, self._mm
        if words is None or mm is None:
            raise ShmUnavailable("mapping is closed")
        offset, nbytes, seq = (int(x) for x in ref)
        size = self.descriptor.size
        if offset % ALIGN or offset < SEGMENT_HEADER + BLOCK_HEADER or nbytes < 0 or offset + nbytes > size:
            raise ShmUnavailable(f"block {offset}+{nbytes} is outside the segment of {size} bytes")
        index = (offset - BLOCK_HEADER) // 8
        if int(words[index]) != (seq << 8) | IN_USE or int(words[index + 2]) != nbytes:
            raise ShmUnavailable(f"stale block reference {tuple(ref)}: taken, released or reused since")
        words[index] = (seq << 8) | TAKEN  # before the arrays exist: the producer leaves it alone from now on
        # All arrays are views of `owner`, whose base is the mmap itself, so numpy's view
        # chains end at it: it dies (and the finalizer releases) only after the last view.
        owner = np.frombuffer(mm, np.uint8, count=nbytes, offset=offset)
        _leases[id(owner)] = weakref.finalize(owner, _release_block, words, index, seq, id(owner), os.getpid())
        out: List[np.ndarray] = []
        for key, dtype_str, shape, off in specs:
            dtype = _plain_dtype(dtype_str)
            n = dtype.itemsize
            for d in shape:
                if type(d) is not int or d < 0:
                    raise ValueError(f"array {key!r} has a bad shape {shape!r:.60}")
                n *= d
            if type(off) is not int or off < 0 or off + n > nbytes:
                raise ValueError(f"array {key!r} {dtype_str}{list(shape)} at {off} exceeds the block's {nbytes} bytes")
            out.append(owner[off : off + n].view(dtype).reshape(shape))
        return out

    def discard(self, ref: Sequence[Any]) -> None:
        """Release block `ref` without making arrays of it (its message could not be used)."""
        words = self._words
        try:
            offset, nbytes, seq = (int(x) for x in ref[:3])
        except (TypeError, ValueError):
            return
        if words is None or offset % ALIGN or offset < SEGMENT_HEADER + BLOCK_HEADER:
            return
        if not 0 <= nbytes <= self.descriptor.size - offset:
            return
        index = (offset - BLOCK_HEADER) // 8
        if seq >= 0 and int(words[index]) == (seq << 8) | IN_USE and int(words[index + 2]) == nbytes:
            words[index] = (seq << 8) | RELEASED

    def close(self) -> None:
        """Give back one use; after the last, this mapping is forgotten and unmapped now or, if
        arrays of it live, when they are gone."""
        with _mappings_lock:
            self._users -= 1
            if self._users <= 0:
                self._unmap()

    def _unmap(self) -> None:
        key = (self.descriptor.host, self.descriptor.pid, self.descriptor.fd, self.descriptor.token)
        with _mappings_lock:
            self._users = 0
            if _mappings.get(key) is self:
                del _mappings[key]
        self._words = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # arrays of it live: unmapped when they are gone
                pass


def release(arrays: Union[np.ndarray, Dict[str, np.ndarray], Sequence[np.ndarray]]) -> None:
    """Release the blocks of `arrays` now; those arrays (and views of them) must not be used after."""
    if isinstance(arrays, dict):
        items: Any = arrays.values()
    elif isinstance(arrays, np.ndarray):
        items = [arrays]
    else:
        items = arrays
    for a in items:
        obj: Any = a
        while isinstance(obj, np.ndarray):
            fin = _leases.get(id(obj))
            if fin is not None and (fin.peek() or (None,))[0] is obj:
                fin()
                break
            obj = obj.base


def _map(d: Descriptor) -> Tuple[mmap.mmap, int]:
    here = host_id()
    if d.host != here:
        raise ShmUnavailable(f"segment of another host or pid namespace ({d.host}; here {here})")
    path = f"/proc/{d.pid}/fd/{d.fd}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise ShmUnavailable(f"{path} does not exist: the producer is gone or closed the segment") from None
    except PermissionError as exc:
        raise ShmUnavailable(f"no permission to open {path}: {exc.strerror}") from None
    except OSError as exc:
        raise ShmUnavailable(f"cannot open {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != d.size:
            raise ShmUnavailable(f"{path} is not the segment (stale descriptor: pid or fd reused)")
        head = os.pread(fd, 16, 0)
        if head[:8] != MAGIC:
            raise ShmUnavailable(f"{path} is not a segment (stale descriptor: pid or fd reused)")
        if int.from_bytes(head[8:16], "little") != d.token:
            raise ShmUnavailable(f"token mismatch at {path}: another segment (stale descriptor)")
        return _mmap(fd, d.size), st.st_ino
    except OSError as exc:
        raise ShmUnavailable(f"cannot map {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
