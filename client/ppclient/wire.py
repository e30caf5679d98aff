"""The wire format shared by the server, its workers and clients.

Every message is a list of ZeroMQ frames: one small msgpack header (a dict) followed by
zero or more raw array buffers, one frame per array. The header lists each array as
``[key, dtype, shape]``; the bytes travel untouched, so a receiver builds the array with
``numpy.frombuffer`` on the frame (no copy) and a forwarder can pass frames on without
looking inside them. Nothing received is ever unpickled: object and structured dtypes
are refused.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import numpy

from .errors import Error

PROTOCOL = 1

# Meta entries travel in the header, never as array frames.
META_KEYS = ("seq_tag", "seq_idx", "complete_frac")

# Below this size a copying send is cheaper than pinning the buffer for zero-copy.
ZERO_COPY_MIN_BYTES = 64 * 1024

# Array kinds that can be rebuilt from raw bytes without running code.
_SAFE_KINDS = set("biufcUSmM")

MAX_HEADER_BYTES = 1 << 20  # headers are small; arrays travel in their own frames


class WireError(Error):
    """A message that does not follow the wire format."""


def pack(header: Dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def unpack(data, *, max_bytes: int = MAX_HEADER_BYTES) -> Dict[str, Any]:
    """Decode a header frame; anything but a msgpack map is a WireError."""
    if len(data) > max_bytes:
        raise WireError(f"header of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=False,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"undecodable header: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"header must be a map, got {type(obj).__name__}")
    return obj


def check_dtype(dtype_str: Any) -> numpy.dtype:
    """Parse a dtype from the network, refusing anything that is not plain data."""
    if not isinstance(dtype_str, str) or len(dtype_str) > 16:
        raise WireError(f"bad dtype {dtype_str!r}")
    try:
        dtype = numpy.dtype(dtype_str)
    except Exception:
        raise WireError(f"bad dtype {dtype_str!r}") from None
    if dtype.kind not in _SAFE_KINDS or dtype.fields is not None or dtype.hasobject:
        raise WireError(f"refused dtype {dtype_str!r}")
    return dtype


def seq_to_item(seq: Dict[str, Any], **fields: Any) -> Tuple[Dict[str, Any], List[Any]]:
    """Split a seq dict into an item header and its buffers, one per array.

    Meta entries (seq_tag, seq_idx, complete_frac) go into ``item["meta"]``; every other
    entry must be a numpy array. Large contiguous arrays are handed over without a copy.
    """
    arrays = []
    bufs: List[Any] = []
    meta = {}
    for key, value in seq.items():
        if key in META_KEYS:
            if value is not None:
                meta[key] = _meta_value(key, value)
            continue
        if not isinstance(value, numpy.ndarray):
            raise WireError(f"entry {key!r} is a {type(value).__name__}, expected a numpy array")
        if value.dtype.kind not in _SAFE_KINDS or value.dtype.hasobject or value.dtype.fields is not None:
            raise WireError(f"entry {key!r} has unsupported dtype {value.dtype}")
        if not value.flags.c_contiguous:
            value = numpy.ascontiguousarray(value)
        arrays.append([key, value.dtype.str, list(value.shape)])
        bufs.append(value if value.nbytes >= ZERO_COPY_MIN_BYTES else value.tobytes())
    item = dict(fields)
    item["meta"] = meta
    item["arrays"] = arrays
    return item, bufs


def pack_batch(header: Dict[str, Any], items: Sequence[Tuple[Dict[str, Any], Sequence[Any]]]) -> List[Any]:
    """One message carrying several items: header["items"] lists them, their buffers follow in order."""
    header = dict(header)
    header["items"] = [item for item, _ in items]
    frames: List[Any] = [pack(header)]
    for _, bufs in items:
        frames.extend(bufs)
    return frames


def unpack_batch(header: Dict[str, Any], bufs: Sequence[Any]) -> List[Tuple[Dict[str, Any], List[Any]]]:
    """The (item, buffers) pairs of a batch message; buffer counts are checked against the header."""
    items = header.get("items")
    if not isinstance(items, list):
        raise WireError("batch message without an 'items' list")
    out = []
    at = 0
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("arrays"), list):
            raise WireError("batch item without an 'arrays' list")
        n = len(item["arrays"])
        out.append((item, list(bufs[at:at + n])))
        at += n
    if at != len(bufs):
        raise WireError(f"batch lists {at} arrays but {len(bufs)} buffers came")
    return out


def _meta_value(key: str, value: Any):
    if isinstance(value, numpy.ndarray):
        value = value.item()
    if key == "seq_tag":
        if isinstance(value, bytes):
            value = value.decode("utf8")
        return str(value)
    if key == "seq_idx":
        return int(value)
    return float(value)


def item_to_seq(item: Dict[str, Any], bufs: Sequence[Any]) -> Dict[str, Any]:
    """Rebuild a seq dict from an item header and its buffer frames (no copy; read-only)."""
    arrays = item.get("arrays")
    meta = item.get("meta") or {}
    if not isinstance(arrays, list) or not isinstance(meta, dict):
        raise WireError("seq item without 'arrays' list or 'meta' map")
    if len(arrays) != len(bufs):
        raise WireError(f"item lists {len(arrays)} arrays but {len(bufs)} buffers came")
    seq: Dict[str, Any] = {}
    for spec, buf in zip(arrays, bufs):
        if not (isinstance(spec, (list, tuple)) and len(spec) == 3):
            raise WireError(f"bad array spec {spec!r}")
        key, dtype_str, shape = spec
        if not isinstance(key, str) or key in META_KEYS:
            raise WireError(f"bad array key {key!r}")
        dtype = check_dtype(dtype_str)
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WireError(f"bad shape {shape!r} for {key!r}")
        mv = memoryview(buf.buffer if hasattr(buf, "buffer") else buf)
        if mv.nbytes != math.prod(shape) * dtype.itemsize:
            raise WireError(f"array {key!r}: {mv.nbytes} bytes do not fit shape {shape} of {dtype}")
        seq[key] = numpy.frombuffer(mv, dtype=dtype).reshape(shape)
    for key, value in meta.items():
        if key not in META_KEYS:
            raise WireError(f"unknown meta entry {key!r}")
        if key == "seq_tag" and not isinstance(value, str):
            raise WireError("seq_tag must be a string")
        if key == "seq_idx" and (not isinstance(value, int) or isinstance(value, bool)):
            raise WireError("seq_idx must be an int")
        if key == "complete_frac" and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise WireError("complete_frac must be a number")
        seq[key] = value
    return seq


def split(frames: Sequence[Any], *, max_bytes: int = MAX_HEADER_BYTES) -> Tuple[Dict[str, Any], List[Any]]:
    """Decode the header of a message and return it with the untouched buffer frames."""
    if not frames:
        raise WireError("empty message")
    first = frames[0]
    data = first.buffer if hasattr(first, "buffer") else first
    return unpack(data, max_bytes=max_bytes), list(frames[1:])


def nbytes(buf: Any) -> int:
    """Size of a buffer frame: a numpy array, bytes or a zmq.Frame."""
    return buf.nbytes if isinstance(buf, numpy.ndarray) else len(buf)


def protocol_mismatch(theirs: Optional[int], who: str) -> Optional[str]:
    """One-line description of a protocol mismatch, or None when versions agree."""
    if theirs == PROTOCOL:
        return None
    return f"protocol version mismatch: {who} speaks {theirs!r}, this side speaks {PROTOCOL}"
