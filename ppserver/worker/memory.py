"""Keep freed heap memory for reuse in the server and worker processes.

Every seq allocates and frees buffers of its size (a copy of a small array, a mapped
output, a received frame). With glibc's defaults the heap top is given back to the OS
whenever more than 128 KB of it is free, and arrays above the dynamic mmap threshold get
mappings of their own, so the next seq faults the same pages in again (5 minor faults per
32 KB seq in a worker, measured here; about 15 % of its CPU). Raising both thresholds
keeps that memory for the next seq. What a process holds stays bounded by its credits;
at most TRIM_THRESHOLD of free heap is kept. Memory a peer made the server take for junk
is given back at once (`given_back`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Callable, Iterator, Optional

log = logging.getLogger("ppserver.memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 128 << 20
MMAP_THRESHOLD = 32 << 20
_tuned = False  # keep_freed_memory set the thresholds above


@functools.cache
def _glibc(function: str) -> Optional[Callable[..., int]]:
    """A function of glibc's malloc, or None where there is none."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return getattr(ctypes.CDLL(name), function)
    except (OSError, AttributeError):  # not glibc
        return None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process (no-op elsewhere or when MALLOC_* env vars say otherwise)."""
    if any(k.startswith(("MALLOC_TRIM_THRESHOLD", "MALLOC_MMAP_THRESHOLD")) for k in os.environ):
        return False  # the user chose
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    global _tuned
    _tuned = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not _tuned:
        log.debug("mallopt refused the thresholds")
    return _tuned


@contextlib.contextmanager
def given_back() -> Iterator[None]:
    """Memory freed inside goes back to the OS. The trim threshold is lowered meanwhile, so that
    frees shrink the heaps of other threads' arenas too (malloc_trim leaves their tops alone),
    then every arena's free pages are released."""
    mallopt = _glibc("mallopt") if _tuned else None
    lowered = mallopt is not None and bool(mallopt(_M_TRIM_THRESHOLD, 0))
    try:
        yield
    finally:
        if lowered:
            assert mallopt is not None
            mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        trim = _glibc("malloc_trim")
        if trim is not None:
            trim(0)
