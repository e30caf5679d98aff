"""Where an item's arrays lie when they are not its message's frames: a block of a shared-memory
segment (`b`), or the sender's own memory for a receiver on its host that reads it there (`m`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import wire
from .codec import _is_int, _position
from .items import BadItem, Item


def to_block(items: Sequence[Item], segment: Any, owner: bytes = b"") -> Tuple[List[Item], Any]:
    """The items with their arrays copied into one block of `segment` (shm.Segment), and the block;
    the items themselves and None if the segment has no room (or nothing needs one: items laid out
    in a block of their own already stay as they are). One block per message: one allocation, and
    one release once the receiver has dropped every array of every seq in it."""
    from .. import shm

    loose = [item for item in items if item.block is None and not item.skip]  # (a skipped seq holds nothing)
    if not loose:
        return list(items), None
    packed = shm.pack(segment, [_as_array(f) for item in loose for f in item.frames], owner)
    if packed is None:
        return list(items), None
    block, offsets = packed
    ref = block.ref()
    out: List[Item] = []
    at = 0
    for item in items:
        if item.block is not None or item.skip:
            out.append(item)
            continue
        n = len(item.frames)
        out.append(dataclasses.replace(item, frames=[], block=[ref.offset, ref.nbytes, ref.seq, offsets[at : at + n]]))
        at += n
    return out, block


def to_spans(items: Sequence[Item]) -> Optional[List[Item]]:
    """The items with their arrays named by address in this process (its memory must stay as it
    is until the receiver has read it); None if a frame is not a C-contiguous numpy array."""
    out: List[Item] = []
    ndarray = wire.numpy.ndarray
    for item in items:
        spans = []
        for f in item.frames:  # (split_seq made them C-contiguous)
            if type(f) is not ndarray:
                return None
            spans.append([f.__array_interface__["data"][0], f.nbytes])
        out.append(Item(item.pos, item.meta, item.arrays, [], item.nbytes, None, False, spans, item.batch, item.size))
    return out


def _as_array(frame: Any) -> Any:
    import numpy

    if isinstance(frame, numpy.ndarray):
        return frame
    return numpy.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, numpy.uint8)


def resolve_blocks(items: List[Item], mapping: Any) -> List[BadItem]:
    """Give items in shared memory their arrays (views of `mapping`, a shm.Mapping); the items
    whose block cannot be used are taken out and returned as bad. Items naming the same block
    (one message's seqs) share one lease on it."""
    from .. import shm

    bad: List[BadItem] = []
    groups: Dict[Tuple[int, int, int], List[Item]] = {}
    for item in items:
        if item.block is not None:
            b = item.block
            groups.setdefault((b[0], b[1], b[2]), []).append(item)
    if not groups:
        return bad
    failed = set()
    for ref, group in groups.items():
        if mapping is None:
            reason = "an item in shared memory, but no segment is mapped"
        else:
            specs = [(k, d, shape, o) for item in group for (k, d, shape), o in zip(item.arrays, item.block[3])]  # type: ignore[index]
            try:
                views = mapping.views(ref, specs)
            except (shm.ShmUnavailable, ValueError) as exc:
                reason = str(exc)
            else:
                give_arrays(group, views)
                continue
        for item in group:
            bad.append(BadItem(item.task, reason, item.size if item.batch is not None else None))
            failed.add(id(item))
    if failed:
        items[:] = [item for item in items if id(item) not in failed]
    return bad


def block_refs(frames: Sequence[Any]) -> List[Tuple[Optional[int], List[int]]]:
    """(position, [offset, nbytes, seq]) of each shared-memory block a batch message names, read
    leniently: for giving back the blocks of a message, or items, that did not check."""
    try:
        header, _ = wire.split(frames)
    except wire.WireError:
        return []
    specs = header.get("items")
    out: List[Tuple[Optional[int], List[int]]] = []
    for spec in specs if isinstance(specs, list) else []:
        block = spec.get("b") if isinstance(spec, dict) else None
        if isinstance(block, list) and len(block) >= 3 and all(_is_int(x) for x in block[:3]):
            out.append((_position(spec), block[:3]))
    return out


def unused_blocks(frames: Sequence[Any], kept: Sequence[Item]) -> List[List[int]]:
    """The blocks a batch message names that none of its `kept` items uses: the seqs of a message
    share a block, so one is given back only when no seq of it is kept."""
    refs = block_refs(frames)
    positions = {item.pos for item in kept}
    live = {tuple(ref) for pos, ref in refs if pos in positions}
    out: List[List[int]] = []
    for pos, ref in refs:
        key = tuple(ref)
        if pos not in positions and key not in live:
            live.add(key)  # each block once
            out.append(ref)
    return out


def give_arrays(items: Sequence[Item], arrays: Sequence[Any]) -> None:
    """Items that named where their arrays lie (a block, the sender's memory) get them, in order."""
    at = 0
    for item in items:
        n = len(item.arrays)
        item.frames = list(arrays[at : at + n])
        item.block = item.spans = None
        at += n
