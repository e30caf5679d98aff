"""Messages to frames and back: `encode` writes every field, `decode` checks a received header
against its class's fields (and each item against its frames) and refuses anything else, so
handlers only ever see checked messages. Also the reports of messages a worker dropped."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

from .. import wire
from .items import BadItem, Item, check_item
from .messages import KIND, MESSAGES, PROTO_FIELD, PROTOCOL, Channel, Dropped, Message, Peer, ProtocolError

PEEK_BYTES = 16 * wire.MAX_HEADER_BYTES  # how large a header a dropped message's report reads


def dropped(frames: Sequence[Any], reason: str) -> Dropped:
    """The report of a message that did not decode: what it names, read leniently (its header may be
    over the cap, say; it is in memory already). Any position that cannot be read leaves `pos`
    empty: every task of the run."""
    report = Dropped(reason=reason[:500])
    try:
        header, _ = wire.split(frames, max_bytes=PEEK_BYTES)
    except wire.WireError:
        return report
    kind, run, part, specs = header.get(KIND), header.get("run"), header.get("partition"), header.get("items")
    positions = [_task_position(spec) if type(spec) is dict else None for spec in specs] if type(specs) is list else []
    return dataclasses.replace(
        report,
        what=kind if type(kind) is str and len(kind) <= 40 else "",
        run=_index(run),
        partition=_index(part),
        pos=_all_known(positions),
    )


def _index(value: Any) -> Optional[int]:
    return value if _is_int(value) and value >= 0 else None


def dropped_items(msg: Message, bad: Sequence[BadItem], reason: str) -> Dropped:
    """The report of items of a decoded message that did not check."""
    return Dropped(
        what=msg.kind,
        run=getattr(msg, "run", None),
        partition=getattr(msg, "partition", None),
        pos=_all_known([b.pos for b in bad]),
        reason=reason[:500],
    )


def _all_known(positions: Sequence[Optional[int]]) -> List[int]:
    """Positions as a report names them: all (each task once: a batch's seqs name it), or none when one
    is unknown (every task of the run)."""
    known = [p for p in positions if p is not None]
    return list(dict.fromkeys(known)) if len(known) == len(positions) else []


# ---- encode / decode ------------------------------------------------------------------------
def encode(msg: Message, items: Sequence[Item] = ()) -> List[Any]:
    """The frames of a message: its header, then every item's frames in order."""
    header: Dict[str, Any] = {KIND: msg.kind}
    if msg.versioned:
        header[PROTO_FIELD] = PROTOCOL
    for f in _FIELDS[type(msg)]:
        header[f.name] = getattr(msg, f.name)
    if not msg.batch:
        return [wire.pack(header)]
    header["items"] = [item.header() for item in items]
    frames: List[Any] = [wire.pack(header)]
    for item in items:
        frames.extend(item.wire_frames)
    return frames


def encode_fitting(msg: Message, items: Sequence[Item]) -> List[List[Any]]:
    """The frames of a batch message, as one message or, if its header would exceed
    wire.MAX_HEADER_BYTES, as several (see split_fitting)."""
    frames = encode(msg, items)
    if len(frames[0]) <= wire.MAX_HEADER_BYTES or len(items) < 2:
        return [frames]
    return [encode(m, part) for m, part in split_fitting(msg, items)]


# what naming an item's arrays elsewhere (a block, the sender's memory) may add to its header
PLACE_ITEM_BYTES = 40  # "b": offset, nbytes, seq (or "m" and its list)


PLACE_ARRAY_BYTES = 16  # an array's offset, or its address and size


def split_fitting(msg: Message, items: Sequence[Item], placed: bool = False) -> List[Tuple[Message, List[Item]]]:
    """A batch message as one or, if its header would exceed wire.MAX_HEADER_BYTES, as several,
    each with a run of the items in order (and of the `per_item` fields). An item whose header
    alone does not fit still goes, alone. `placed`: the items' arrays will be named by place (a
    block or addresses) instead of frames, so their room is counted too."""
    size = len(encode(msg, items)[0])
    if placed:
        size += sum(PLACE_ITEM_BYTES + PLACE_ARRAY_BYTES * len(item.arrays) for item in items)
    if size <= wire.MAX_HEADER_BYTES or len(items) < 2:
        return [(msg, list(items))]
    half = len(items) // 2
    out: List[Tuple[Message, List[Item]]] = []
    for part in (slice(0, half), slice(half, len(items))):
        fields = {name: getattr(msg, name)[part] for name in msg.per_item if len(getattr(msg, name)) == len(items)}
        out += split_fitting(dataclasses.replace(msg, **fields), items[part], placed)
    return out


def encode_batch(msg: Message, headers: List[Dict[str, Any]], frames: Sequence[Any]) -> List[Any]:
    """A batch message from ready item headers and their frames (the server's relay path)."""
    header: Dict[str, Any] = {KIND: msg.kind}
    for f in _FIELDS[type(msg)]:
        header[f.name] = getattr(msg, f.name)
    header["items"] = headers
    return [wire.pack(header), *frames]


@dataclass
class Decoded:
    msg: Message
    items: List[Item] = field(default_factory=list)
    bad: List[BadItem] = field(default_factory=list)  # items of a batch that did not check
    unreadable: List[BadItem] = field(default_factory=list)  # checked, but their arrays could not be read


def decode(
    frames: Sequence[Any],
    receiver: Peer,
    channels: Tuple[Channel, ...],
    *,
    max_header_bytes: int = wire.MAX_HEADER_BYTES,
) -> Decoded:
    """Check and decode a message (header frame first) that `receiver` got on one of `channels`.

    Raises ProtocolError for an unknown kind, one that does not go to `receiver` on those
    channels, a missing field or one of the wrong type, and VersionMismatch for a versioned
    message of another protocol version. Items of a batch that do not check are returned in
    `bad` instead of `items`.
    """
    try:
        header, bufs = wire.split(frames, max_bytes=max_header_bytes)
    except wire.WireError as exc:
        raise ProtocolError(str(exc)) from None
    kind = header.get(KIND)
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r:.40}")
    if receiver not in cls.receiver or cls.channel not in channels:
        raise ProtocolError(f"a {receiver.value} does not accept {kind!r} messages on this socket")
    if cls.versioned and header.get(PROTO_FIELD) != PROTOCOL:
        raise VersionMismatch(header.get(PROTO_FIELD), cls.kind)
    values = {}
    for name, check, low in _SPECS[cls]:
        try:
            value = header[name]
        except KeyError:  # encode writes every field: a missing one is not our peer's doing
            raise ProtocolError(f"{kind!r} without its {name!r} field") from None
        try:
            value = check(value)
        except ValueError as exc:
            raise ProtocolError(f"{kind}.{name} must be {exc}") from None
        if low is not None and value is not None and value < low:
            raise ProtocolError(f"{kind}.{name} must be >= {low}, got {value}")
        values[name] = value
    msg = cls(**values)
    if not cls.batch:
        if bufs:
            raise ProtocolError(f"{kind!r} carries no frames, got {len(bufs)}")
        return Decoded(msg)
    return _decode_items(msg, header.get("items"), bufs)


def _decode_items(msg: Message, specs: Any, bufs: List[Any]) -> Decoded:
    if type(specs) is not list:
        raise ProtocolError(f"{msg.kind!r} without an items list")
    out = Decoded(msg)
    at = 0
    for spec in specs:
        arrays = spec.get("arrays") if type(spec) is dict else None
        if type(arrays) is not list:
            break
        n = 0 if "b" in spec or "m" in spec else len(arrays)  # arrays in (shared) memory have no frames
        if at + n > len(bufs):
            break
        try:
            out.items.append(check_item(spec, bufs[at : at + n]))
        except ProtocolError as exc:
            out.bad.append(BadItem(_task_position(spec), str(exc), _batch_size(spec)))
        at += n
    else:
        if at == len(bufs):
            return out
    # frames cannot be matched to items: every item is bad
    out.items.clear()
    out.bad = [
        BadItem(_task_position(spec), "items and frames do not match", _batch_size(spec))
        if type(spec) is dict
        else BadItem(None, "items and frames do not match")
        for spec in specs
    ]
    return out


def _position(spec: Dict[str, Any]) -> Optional[int]:
    pos = spec.get("i")
    return pos if type(pos) is int and pos >= 0 else None


def _task_position(spec: Dict[str, Any]) -> Optional[int]:
    """The position of the task an item header belongs to: its batch's, for a seq of a batch."""
    batch = spec.get("g")
    return batch if type(batch) is int and batch >= 0 else _position(spec)


def _batch_size(spec: Dict[str, Any]) -> Optional[int]:
    """The seqs of the batch an item header says it belongs to (None: not a seq of a batch)."""
    size = spec.get("n")
    return size if type(spec.get("g")) is int and type(size) is int and size > 0 else None


class VersionMismatch(ProtocolError):
    def __init__(self, theirs: Any, kind: str):
        super().__init__(mismatch_text(theirs, "the peer"))
        self.theirs = theirs
        self.msg_kind = kind


def mismatch_text(theirs: Any, who: str) -> str:
    return f"protocol version mismatch: {who} speaks {theirs!r}, this side speaks {PROTOCOL}"


# ---- field checks ---------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_like(value: Any, depth: int = 0) -> bool:
    if depth > 8:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_json_like(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    return False


def _checker(tp: Any):
    """A function value -> checked value for a field type; raises ValueError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        inner = _checker(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if origin in (list, List):
        elem = _checker(args[0])
        return lambda v: [elem(x) for x in _require(v, list)]
    if origin in (dict, Dict):
        return lambda v: _require_json(_require(v, dict))
    if tp is int:
        return lambda v: v if _is_int(v) else _bad(v, "an int")
    if tp is float:
        return lambda v: (
            float(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            else _bad(v, "a finite number")
        )
    if tp is bool:
        return lambda v: v if isinstance(v, bool) else _bad(v, "a bool")
    if tp is str:
        return lambda v: v if isinstance(v, str) else _bad(v, "a str")
    if tp is bytes:
        return lambda v: v if isinstance(v, bytes) else _bad(v, "bytes")
    raise TypeError(f"no check for field type {tp!r}")


def _require(value: Any, tp: type) -> Any:
    if not isinstance(value, tp):
        _bad(value, f"a {tp.__name__}")
    return value


def _require_json(value: Dict[str, Any]) -> Dict[str, Any]:
    if not _json_like(value):
        raise ValueError("a map of plain values")
    return value


def _bad(value: Any, what: str) -> Any:
    raise ValueError(f"{what}, got {type(value).__name__}")


class _PerClass(dict):
    """A message class's fields or checks, made when the class is first encoded or decoded: a
    process pays for the kinds it uses (working them all out costs ~10 ms at every start)."""

    def __init__(self, make: Any):
        super().__init__()
        self.make = make

    def __missing__(self, cls: Type[Message]) -> Any:
        value = self[cls] = self.make(cls)
        return value


def _specs(cls: Type[Message]) -> Tuple[Tuple[str, Any, Optional[int]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _checker(hints[f.name]), f.metadata.get("min")) for f in _FIELDS[cls])


_FIELDS: Dict[Type[Message], Tuple[dataclasses.Field, ...]] = _PerClass(lambda cls: tuple(dataclasses.fields(cls)))
_SPECS: Dict[Type[Message], Tuple[Tuple[str, Any, Optional[int]], ...]] = _PerClass(_specs)  # (name, check, minimum)


def describe() -> List[Dict[str, Any]]:
    """Every message with its sender, receiver and fields (for docs and tests)."""
    out = []
    hints_cache = {cls: typing.get_type_hints(cls) for cls in MESSAGES.values()}
    for kind, cls in MESSAGES.items():
        out.append(
            {
                "kind": kind,
                "class": cls.__name__,
                "sender": [p.value for p in cls.sender],
                "receiver": [p.value for p in cls.receiver],
                "channel": cls.channel.value,
                "batch": cls.batch,
                "fields": {f.name: _type_name(hints_cache[cls][f.name]) for f in _FIELDS[cls]},
            }
        )
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        return "Optional[" + _type_name(next(a for a in args if a is not type(None))) + "]"
    if origin in (list, List):
        return f"List[{_type_name(args[0])}]"
    if origin in (dict, Dict):
        return "Dict[str, Any]"
    return getattr(tp, "__name__", str(tp))
