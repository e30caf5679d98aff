"""Keep freed heap memory for reuse in the server and worker processes.

Every seq allocates and frees buffers of its size (a copy of a small array, a mapped
output, a received frame). With glibc's defaults the heap top is given back to the OS
whenever more than 128 KB of it is free, and arrays above the dynamic mmap threshold get
mappings of their own, so the next seq faults the same pages in again (5 minor faults per
32 KB seq in a worker, measured here; about 15 % of its CPU). Raising both thresholds
keeps that memory for the next seq. What a process holds stays bounded by its credits;
at most TRIM_THRESHOLD of free heap is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("ppserver.memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 128 << 20
MMAP_THRESHOLD = 32 << 20


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process (no-op elsewhere or when MALLOC_* env vars say otherwise)."""
    if any(k.startswith(("MALLOC_TRIM_THRESHOLD", "MALLOC_MMAP_THRESHOLD")) for k in os.environ):
        return False  # the user chose
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the thresholds")
    return ok
