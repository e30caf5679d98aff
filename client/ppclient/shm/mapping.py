"""The consumer's side: a producer's segment mapped (shared by every client of this process that
uses it), its blocks turned into arrays, and their release once the arrays are gone."""

from __future__ import annotations

import collections
import mmap
import os
import stat
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import wire
from .format import (
    ALIGN,
    BLOCK_HEADER,
    IN_USE,
    MAGIC,
    RELEASED,
    SEGMENT_HEADER,
    TAKEN,
    Descriptor,
    ShmUnavailable,
    Spec,
)
from .memfd import host_id, map_shared

MAX_MAPPINGS = 16  # mappings the cache keeps; beyond this the oldest is forgotten (still usable by its holders)


def _plain_dtype(dtype_str: Any) -> np.dtype:
    """A spec's dtype, checked as the wire checks it (ValueError if refused), cached."""
    if type(dtype_str) is str and dtype_str in _dtype_cache:
        return _dtype_cache[dtype_str]
    try:
        dtype = wire.check_dtype(dtype_str)
    except wire.WireError as exc:
        raise ValueError(str(exc)) from None
    if len(_dtype_cache) < 256:
        _dtype_cache[dtype_str] = dtype
    return dtype


_dtype_cache: Dict[str, np.dtype] = {}


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
        return map_shared(fd, d.size), st.st_ino
    except OSError as exc:
        raise ShmUnavailable(f"cannot map {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
