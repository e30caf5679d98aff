"""Memfds as segments: whether they work in this process, what names this host to a peer, and
making one within the memory available.

A segment is committed when it is created (posix_fallocate), so a machine short of memory
fails there, not later inside a write. On a memfd that commit does not fail with ENOSPC when
memory runs out (there is no size limit to hit): the kernel's OOM killer runs instead. So a
segment is created only if it takes at most a quarter of the memory available (MemAvailable,
and the headroom of this process's memory cgroup), and it is committed in steps that stop
once less than RESERVE bytes would be left; either way ShmUnavailable says why and the
caller uses sockets. A consumer cannot shrink the segment under the producer's writes
(SIGBUS): it is sealed against that.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from typing import List, Optional, Tuple

from .format import MAGIC, ShmUnavailable

MIN_SIZE = 4096
MEMORY_SHARE = 4  # a segment may take at most 1/MEMORY_SHARE of the memory available when it is created
RESERVE = 256 << 20  # committing a segment stops (and fails) rather than leave less memory available than this
COMMIT_STEP = 16 << 20  # bytes committed between two looks at the memory available


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


def create(size: int) -> Tuple[int, mmap.mmap]:
    """A new sealed memfd of `size` bytes, committed, and its mapping; ShmUnavailable if memory is short."""
    _check_memory(size)
    fd = os.memfd_create("ppshm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        _commit(fd, size)
        try:  # a consumer that truncates the segment must not make the producer's writes SIGBUS
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except (AttributeError, OSError):
            pass
        return fd, map_shared(fd, size)
    except BaseException:
        os.close(fd)
        raise


def map_shared(fd: int, size: int) -> mmap.mmap:
    """A shared mapping of a segment's fd (the producer's own, or a consumer's reopened one)."""
    # MAP_POPULATE: the page tables are filled now, not by a fault on each page's first touch
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
