"""The framing shared by the server, its workers and clients.

Every message is a list of ZeroMQ frames: one small msgpack header (a map) followed by
zero or more raw array buffers, one frame per array. A seq travels as an item header
``{"i": position, "meta": {...}, "arrays": [[key, dtype, shape], ...]}`` plus its frames;
the bytes travel untouched, so a receiver builds each array with ``numpy.frombuffer`` on
its frame (no copy) and a forwarder passes frames on without looking inside them.
Nothing received is ever unpickled: object and structured dtypes are refused.

Which headers exist and what their fields mean is `protocol.py`'s business.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import msgpack
import numpy

from .errors import Error

# Meta entries travel in the item header, never as array frames.
META_KEYS = ("seq_tag", "seq_idx", "complete_frac")

# Array kinds that can be rebuilt from raw bytes without running code.
_SAFE_KINDS = set("biufcUSmM")

MAX_HEADER_BYTES = 1 << 20  # headers are small; arrays travel in their own frames


class WireError(Error):
    """Bytes that do not follow the framing."""


def pack(header: Dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack(data: Any, *, max_bytes: int = MAX_HEADER_BYTES) -> Dict[str, Any]:
    """Decode a header frame; anything but a msgpack map is a WireError."""
    if len(data) > max_bytes:
        raise WireError(f"header of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"undecodable header: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"header must be a map, got {type(obj).__name__}")
    return obj


def split(frames: Sequence[Any], *, max_bytes: int = MAX_HEADER_BYTES) -> Tuple[Dict[str, Any], List[Any]]:
    """Decode the header of a message and return it with the untouched buffer frames."""
    if not frames:
        raise WireError("empty message")
    first = frames[0]
    data = first.buffer if hasattr(first, "buffer") else first
    return unpack(data, max_bytes=max_bytes), list(frames[1:])


def check_dtype(dtype_str: Any) -> numpy.dtype:
    """Parse a dtype from the network, refusing anything that is not plain data."""
    if not isinstance(dtype_str, str) or len(dtype_str) > 16:
        raise WireError(f"bad dtype {dtype_str!r:.40}")
    try:
        dtype = numpy.dtype(dtype_str)
    except Exception:
        raise WireError(f"bad dtype {dtype_str!r}") from None
    if not plain_dtype(dtype):
        raise WireError(f"refused dtype {dtype_str!r}")
    return dtype


def plain_dtype(dtype: numpy.dtype) -> bool:
    """Numbers, bools, strings, bytes and times: what raw bytes rebuild without running code."""
    return dtype.kind in _SAFE_KINDS and dtype.fields is None and not dtype.hasobject


def split_seq(seq: Dict[str, Any]) -> Tuple[Dict[str, Any], List[List[Any]], List[Any], int]:
    """(meta, array specs, buffers, total bytes) of a seq dict.

    Meta entries go into `meta`; every other entry must be a numpy array with a str key.
    Contiguous arrays are handed over without a copy, so the caller must not change them
    while the item is in use (datasets and mappers hand over arrays they do not reuse).
    """
    arrays = []
    bufs: List[Any] = []
    meta = {}
    nbytes = 0
    for key, value in seq.items():
        if key in META_KEYS:
            if value is not None:
                meta[key] = _meta_value(key, value)
            continue
        if type(key) is not str:
            raise WireError(f"key {key!r} is a {type(key).__name__}, expected a str")
        if not isinstance(value, numpy.ndarray):
            raise WireError(f"entry {key!r} is a {type(value).__name__}, expected a numpy array")
        dtype = value.dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:
            if not plain_dtype(dtype):
                raise WireError(f"entry {key!r} has unsupported dtype {dtype}")
            name = _DTYPE_NAMES[dtype] = dtype.str
        if not value.flags.c_contiguous:
            value = numpy.ascontiguousarray(value)
        arrays.append([key, name, list(value.shape)])
        bufs.append(value)  # no copy: a socket send copies small ones anyway, shared memory copies once
        nbytes += value.nbytes
    return meta, arrays, bufs, nbytes


_DTYPE_NAMES: Dict[numpy.dtype, str] = {}  # plain dtypes seen, and how they travel (dtype.str is slow to make)


def _meta_value(key: str, value: Any) -> Any:
    if isinstance(value, numpy.ndarray):
        value = value.item()
    if key == "seq_tag":
        if isinstance(value, bytes):
            value = value.decode("utf8")
        return str(value)
    if key == "seq_idx":
        return int(value)
    return float(value)


def build_seq(arrays: Sequence[Any], meta: Dict[str, Any], bufs: Sequence[Any]) -> Dict[str, Any]:
    """A seq dict from checked array specs, meta entries and one buffer per array (no copy)."""
    seq: Dict[str, Any] = {}
    for (key, dtype_str, shape), buf in zip(arrays, bufs):
        if type(buf) is numpy.ndarray:
            seq[key] = buf  # built for this spec already (a view of shared memory, a read, a sent array)
            continue
        mv = buf.buffer if hasattr(buf, "buffer") else buf
        seq[key] = numpy.frombuffer(mv, dtype=numpy.dtype(dtype_str)).reshape(shape)
    seq.update(meta)
    return seq


def nbytes(buf: Any) -> int:
    """Size of a buffer frame: a numpy array, bytes, a memoryview or a zmq.Frame."""
    if isinstance(buf, numpy.ndarray):
        return buf.nbytes
    if isinstance(buf, memoryview):
        return buf.nbytes
    return len(buf)
