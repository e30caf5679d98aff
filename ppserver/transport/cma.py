"""Reading another process's memory on this host: Linux's process_vm_readv ("cross-memory attach").

A worker on the server's host reads its inputs straight out of the server's memory: the server
sends only where each array lies (address and size), the worker copies the bytes into arrays
of its own with one system call per message. The copy runs in the worker, so the server spends
nothing per byte; it is also the writable copy a mapper gets.

The kernel allows it when the worker may trace the server: the same user, and where the Yama
security module restricts tracing (kernel.yama.ptrace_scope >= 1) not at all, since the
server does not lift that for its workers; a container's seccomp profile may forbid the call
too. `check_offer` says whether it works before anything depends on it, and the worker then
takes its inputs through a shared-memory segment (or the socket) instead.

The server keeps every array alive while a worker may still read it (see the scheduler's
`SeqDispatch`: inputs of tasks in flight, also of dropped seqs and of runs that ended, until the
worker settles the task or answers `run_close`); a read that fails all the same is reported
and the task redone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return libc


_LIBC = _libc()


def available() -> Optional[str]:
    """None if this process can make the call at all, else why not."""
    if _LIBC is None:
        return "process_vm_readv is not available (Linux only)"
    return None


class Reader:
    """Reads spans of one process's memory into new arrays."""

    def __init__(self, pid: int):
        self.pid = pid

    def read(self, spans: Sequence[Tuple[int, int]], dtypes: Sequence[Any], shapes: Sequence[Any]) -> List[np.ndarray]:
        """New writable arrays holding the bytes at `spans` of the process; OSError if the kernel
        refuses (EPERM: not allowed; ESRCH: the process is gone; EFAULT: not mapped there)."""
        out = [np.empty(shape, dtype) for dtype, shape in zip(dtypes, shapes)]
        for at in range(0, len(out), IOV_MAX):
            part = range(at, min(at + IOV_MAX, len(out)))
            n = len(part)
            local = (_Iovec * n)()
            remote = (_Iovec * n)()
            want = 0
            for j, k in enumerate(part):
                addr, size = spans[k]
                if size != out[k].nbytes:
                    raise ValueError(f"span of {size} bytes for an array of {out[k].nbytes}")
                local[j].iov_base = out[k].ctypes.data
                local[j].iov_len = size
                remote[j].iov_base = addr
                remote[j].iov_len = size
                want += size
            if want == 0:
                continue
            got = _LIBC.process_vm_readv(self.pid, local, n, remote, n, 0)
            if got < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"process_vm_readv from pid {self.pid}: {os.strerror(err)}")
            if got != want:
                raise OSError(0, f"process_vm_readv from pid {self.pid} read {got} of {want} bytes")
        return out

    def check(self, address: int, expected: bytes) -> Optional[str]:
        """None if reading `address` of the process gives `expected`, else why not."""
        if _LIBC is None:
            return available()
        try:
            (got,) = self.read([(address, len(expected))], [np.uint8], [(len(expected),)])
        except OSError as exc:
            return str(exc)
        if got.tobytes() != expected:
            return "process_vm_readv read other bytes than the server put there"
        return None


def check_offer(offer: Any) -> Tuple[Optional[Reader], str]:
    """A reader of the server's memory if it can be read as `offer` (welcome.cma) says, else
    (None, why not)."""
    try:
        pid, address, token = int(offer["pid"]), int(offer["address"]), bytes.fromhex(offer["token"])
    except (KeyError, TypeError, ValueError):
        return None, f"malformed offer {offer!r:.100}"
    if not token:
        return None, "empty token"
    reader = Reader(pid)
    why_not = reader.check(address, token)
    return (reader, "") if why_not is None else (None, why_not)


def offer(token: np.ndarray) -> Dict[str, Any]:
    """What the server offers its workers: its pid and a token (kept alive by the caller)."""
    return {"pid": os.getpid(), "address": int(token.ctypes.data), "token": token.tobytes().hex()}


def resolve_spans(items: List[Any], reader: Optional[Reader]) -> List[Any]:
    """Give items whose arrays lie in the sender's memory (`Item.spans`) arrays of their own, read
    with one call; if that fails, every such item is taken out and returned as bad."""
    from ppclient.protocol import BadItem, give_arrays

    todo = [item for item in items if item.spans is not None]
    if not todo:
        return []
    reason = "inputs name the server's memory, but it cannot be read here"
    if reader is not None:
        spans: List[Tuple[int, int]] = []
        dtypes: List[Any] = []
        shapes: List[Any] = []
        for item in todo:
            for (_, dtype, shape), (address, size) in zip(item.arrays, item.spans):
                spans.append((address, size))
                dtypes.append(np.dtype(dtype))
                shapes.append(shape)
        try:
            arrays = reader.read(spans, dtypes, shapes)
        except (OSError, ValueError, TypeError) as exc:
            reason = f"cannot read the inputs in the server's memory: {exc}"
        else:
            give_arrays(todo, arrays)
            return []
    bad = [BadItem(item.task, reason, item.size if item.batch is not None else None) for item in todo]
    items[:] = [item for item in items if item.spans is None]
    return bad
