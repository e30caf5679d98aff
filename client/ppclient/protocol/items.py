"""Items: the seqs (or padded batches) inside a batch message, and the checks a received item
header passes before any array is built from its frames."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .. import wire
from ..collate import batch_dict
from .messages import META_KEYS, ProtocolError

# ---- items: seqs inside batch messages ----------------------------------------------------
# The most an item's header (position, meta entries, array specs) may have. The items of a batch
# share one header (wire.MAX_HEADER_BYTES), which also needs room for their shared-memory block
# descriptors: a worker refuses an output with a larger item header, and batches its outputs
# so that their item headers together stay within this too.
MAX_ITEM_HEADER_BYTES = wire.MAX_HEADER_BYTES // 4


@dataclass
class Item:
    """One seq inside a batch message: its position, meta entries, array specs and frames.

    `arrays` lists `[key, dtype, shape]` per array; `frames` holds one buffer per array
    (numpy arrays, bytes or zmq.Frames), which a forwarder passes on without decoding.
    Instead of frames, the arrays may lie in a shared-memory block of the sender's segment:
    `block` is `[offset, nbytes, seq, [offset of each array in the block]]` (header key "b");
    the receiver maps it (shm.py) and fills `frames` with views. Or they lie in the sender's
    own memory, for a receiver on its host that reads it there (cross-memory attach): `spans`
    is `[[address, nbytes], ...]`, one per array (header key "m"). `direct` marks a result the
    worker sent to its consumer itself (the server holds only its position and size).

    Batches: `batch` (header key "g") marks a seq of batch `batch` of the epoch, a batch of
    `size` seqs (header key "n"): a batch's inputs, or the seqs of a batch its client pads; they
    may come in several messages. `size` without `batch` marks a padded batch of that many seqs:
    its arrays are the padded ones and their `:lengths`, and each meta entry is a list with one
    value per seq.

    Skipped seqs (map_seq returned None): `skipped` (header key "x") counts the seqs of the task
    the mapper skipped, `skipped_tags` ("xt") names the first few of them. A seq's result that
    was skipped has no arrays (its meta entries name it); a padded batch holds the seqs that
    were not skipped (`size` of them: 0 when all were).
    """

    pos: int
    meta: Dict[str, Any]
    arrays: List[List[Any]]
    frames: List[Any]
    nbytes: int = 0
    block: Optional[List[Any]] = None
    direct: bool = False
    spans: Optional[List[List[int]]] = None
    batch: Optional[int] = None
    size: Optional[int] = None
    skipped: int = 0
    skipped_tags: List[str] = field(default_factory=list)

    def header(self) -> Dict[str, Any]:
        h = {"i": self.pos, "meta": self.meta, "arrays": self.arrays}
        if self.block is not None:
            h["b"] = self.block
        elif self.spans is not None:
            h["m"] = self.spans
        if self.batch is not None:
            h["g"] = self.batch
        if self.size is not None:
            h["n"] = self.size
        if self.skipped:
            h["x"] = self.skipped
            h["xt"] = self.skipped_tags
        return h

    @property
    def wire_frames(self) -> List[Any]:
        """The frames that travel with the header (none when the arrays are elsewhere)."""
        return [] if self.block is not None or self.spans is not None else self.frames

    @property
    def task(self) -> int:
        """The position of the task the item belongs to: its batch's, for a seq of a batch."""
        return self.pos if self.batch is None else self.batch

    @property
    def seq_tag(self) -> Optional[str]:
        """The seq's tag (a padded batch's first one)."""
        tag = self.meta.get("seq_tag")
        return tag[0] if type(tag) is list and tag else tag if type(tag) is str else None

    @property
    def padded(self) -> bool:
        """A padded batch (one item for several seqs)."""
        return self.size is not None and self.batch is None

    @property
    def seqs(self) -> int:
        """How many seqs the item holds (a padded batch holds several, a skipped seq none)."""
        return self.size if self.padded else 0 if self.skipped else 1  # type: ignore[return-value]

    @property
    def skip(self) -> bool:
        """A seq the mapper skipped: a marker that takes its position and holds nothing."""
        return bool(self.skipped) and not self.padded


@dataclass
class Batch:
    """The inputs of batch `pos` of an epoch (the server's cut): its seqs, in the order they are
    padded, each an item naming the batch. The scheduler moves it as one task."""

    pos: int
    items: List[Item]
    nbytes: int = field(init=False)  # of its arrays, counted when made (its items are all there by then)

    def __post_init__(self) -> None:
        self.nbytes = sum(item.nbytes for item in self.items)

    @property
    def seq_tag(self) -> Optional[str]:
        return self.items[0].seq_tag if self.items else None

    @property
    def seqs(self) -> int:
        return len(self.items)

    def tags(self, limit: int = 4) -> str:
        """Its seqs' tags in words (for errors)."""
        tags = [repr(item.seq_tag) for item in self.items[:limit]]
        more = len(self.items) - limit
        return ", ".join(tags) + (f" and {more} more" if more > 0 else "")


def item_header_bytes(item: Item) -> int:
    """The size of an item's header as it travels (without a shared-memory block descriptor)."""
    return len(wire.pack(item.header()))


def oversized_header(item: Item) -> Optional[int]:
    """The size of an item's header if it is over MAX_ITEM_HEADER_BYTES, else None. A bound on the
    size (4 bytes a character, 9 a number, room for msgpack's own bytes) tells the usual small
    header at a fraction of the cost of packing it, on the reader's hot path; only a header the
    bound puts near the limit is packed."""
    bound = 64
    for value in item.meta.values():
        bound += 24 + (4 * len(value) if type(value) is str else 0)
    for key, dtype, shape in item.arrays:
        bound += 24 + 4 * len(key) + len(dtype) + 9 * len(shape)
    if bound <= MAX_ITEM_HEADER_BYTES:
        return None
    size = item_header_bytes(item)
    return size if size > MAX_ITEM_HEADER_BYTES else None


SHORT_TAG = 200  # characters of a seq tag that a message about it names


def short_tag(tag: Optional[str]) -> Optional[str]:
    """A seq tag as messages about it name it: a huge one shortened, so that it fits a header."""
    if tag is None or len(tag) <= SHORT_TAG:
        return tag
    return f"{tag[:SHORT_TAG]}... ({len(tag)} characters)"


def seq_to_item(seq: Dict[str, Any], pos: int) -> Item:
    """A seq dict (data keys -> numpy arrays, plus meta entries) as an Item; see wire.split_seq."""
    meta, arrays, frames, nbytes = wire.split_seq(seq)
    return Item(pos, meta, arrays, frames, nbytes)


def item_to_seq(item: Item) -> Dict[str, Any]:
    """The seq dict of an Item (arrays are views of its frames), or a padded batch's dict (see
    collate.batch_dict)."""
    if not item.padded:
        return wire.build_seq(item.arrays, item.meta, item.frames)
    return batch_dict(wire.build_seq(item.arrays, {}, item.frames), item.meta)


class BadItem(typing.NamedTuple):
    pos: Optional[int]  # the task's position the item claimed (its batch, for a seq of one), if it was an int
    reason: str
    size: Optional[int] = None  # for a seq of a batch: the batch's seqs (if the header said)


def check_item(spec: Any, frames: Sequence[Any]) -> Item:
    """An item header checked against its frames: meta, keys, dtypes and byte counts.

    Raises ProtocolError. Nothing here builds an array, so a forwarder pays only for the checks.
    (Every seq of every message passes here: the checks are written out for speed.)
    """
    if type(spec) is not dict:
        raise ProtocolError("item is not a map")
    pos = spec.get("i")
    meta = spec.get("meta")
    arrays = spec.get("arrays")
    if type(pos) is not int or pos < 0:
        raise ProtocolError(f"item position {pos!r:.40} is not an int >= 0")
    if type(meta) is not dict:
        raise ProtocolError(f"item {pos}: meta is not a map")
    block = spec.get("b")
    spans = spec.get("m")
    if type(arrays) is not list:
        raise ProtocolError(f"item {pos}: the arrays entry is not a list")
    if block is not None:
        if spans is not None:
            raise ProtocolError(f"item {pos}: arrays both in a block and in the sender's memory")
        _check_block(pos, block, arrays, frames)
    elif spans is not None:
        _check_spans(pos, spans, arrays, frames)
    elif len(arrays) != len(frames):
        raise ProtocolError(f"item {pos}: the arrays list does not match its {len(frames)} frames")
    batch = spec.get("g")
    seqs = spec.get("n")
    skipped, skipped_tags = _skipped(pos, spec, batch, arrays, block, spans)
    if batch is not None and (type(batch) is not int or batch < 0 or seqs is None):
        raise ProtocolError(f"item {pos}: batch {batch!r:.40} is not an int >= 0 with a size")
    if seqs is not None and (type(seqs) is not int or seqs < (0 if skipped and batch is None else 1)):
        raise ProtocolError(f"item {pos}: bad batch size {seqs!r:.40}")
    if seqs is None or batch is not None:
        for key, value in meta.items():
            if not _meta_ok(key, value):
                raise ProtocolError(f"item {pos}: bad meta entry {key!r:.40}: {value!r:.40}")
    else:
        for key, values in meta.items():
            if type(values) is not list or len(values) != seqs or not _meta_list_ok(key, values):
                raise ProtocolError(f"item {pos}: bad meta entry {key!r:.40} of a batch of {seqs}: {values!r:.40}")
    sizes = []
    keys = set()
    for spec_ in arrays:
        if type(spec_) is not list or len(spec_) != 3:
            raise ProtocolError(f"item {pos}: bad array spec {spec_!r:.60}")
        key, dtype_str, shape = spec_
        if type(key) is not str or key in META_KEYS or key in keys:
            raise ProtocolError(f"item {pos}: bad or repeated array key {key!r:.40}")
        keys.add(key)
        itemsize = _itemsize(dtype_str) if type(dtype_str) is str else None
        if itemsize is None:
            raise ProtocolError(f"item {pos}: refused dtype {dtype_str!r:.40}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise ProtocolError(f"item {pos}: bad shape {shape!r:.60} for {key!r}")
        count = 1
        nonzero = 1  # numpy must be able to hold the shape even when a zero makes it empty
        for d in shape:
            if type(d) is not int or d < 0:
                raise ProtocolError(f"item {pos}: bad shape {shape!r:.60} for {key!r}")
            count *= d
            nonzero *= d or 1
        if nonzero > MAX_ELEMENTS:
            raise ProtocolError(f"item {pos}: shape {shape!r:.60} of {key!r} is too large")
        sizes.append(count * itemsize)
    nbytes = 0
    if spans is not None:
        for spec_, (_, size), want in zip(arrays, spans, sizes):
            if size != want:
                raise ProtocolError(
                    f"item {pos}: array {spec_[0]!r} spans {size} bytes, not those of {spec_[2]} {spec_[1]}"
                )
            nbytes += size
        return Item(
            pos,
            meta,
            arrays,
            [],
            nbytes,
            spans=spans,
            batch=batch,
            size=seqs,
            skipped=skipped,
            skipped_tags=skipped_tags,
        )
    if block is None:
        for spec_, frame, want in zip(arrays, frames, sizes):
            size = frame.nbytes if type(frame) is not bytes and hasattr(frame, "nbytes") else len(frame)
            if size != want:
                raise ProtocolError(
                    f"item {pos}: array {spec_[0]!r} has {size} bytes, not those of {spec_[2]} {spec_[1]}"
                )
            nbytes += size
        return Item(
            pos, meta, arrays, list(frames), nbytes, batch=batch, size=seqs, skipped=skipped, skipped_tags=skipped_tags
        )
    limit = block[1]
    for offset, size in zip(block[3], sizes):
        if offset + size > limit:
            raise ProtocolError(f"item {pos}: an array lies outside its shared-memory block")
        nbytes += size
    return Item(
        pos, meta, arrays, [], nbytes, block=block, batch=batch, size=seqs, skipped=skipped, skipped_tags=skipped_tags
    )


MAX_SKIPPED_TAGS = 4  # tags of a task's skipped seqs its result names


def _skipped(pos: int, spec: Dict[str, Any], batch: Any, arrays: List[Any], block: Any, spans: Any) -> Any:
    """(count, tags) of an item's skipped seqs (0, [] for none). A skipped seq that is not in a
    padded batch holds nothing; only a worker's result (not a seq of a batch) skips."""
    count = spec.get("x")
    if count is None:
        return 0, []
    tags = spec.get("xt")
    if type(count) is not int or count < 1 or batch is not None:
        raise ProtocolError(f"item {pos}: bad skipped count {count!r:.40}")
    if type(tags) is not list or len(tags) > min(count, MAX_SKIPPED_TAGS) or not all(type(t) is str for t in tags):
        raise ProtocolError(f"item {pos}: bad skipped tags {tags!r:.60}")
    if spec.get("n") is None and (arrays or block is not None or spans is not None or count != 1):
        raise ProtocolError(f"item {pos}: a skipped seq holds arrays")
    return count, tags


def _meta_list_ok(key: str, values: List[Any]) -> bool:
    """A padded batch's meta entry: one value per seq, each of the entry's type."""
    types = set(map(type, values))  # (in C: a batch's meta lists are checked once per message)
    if key == "seq_tag":
        return types <= _STR
    if key == "seq_idx":
        return types <= _INT
    return key == "complete_frac" and types <= _NUMBER


def _meta_ok(key: str, value: Any) -> bool:
    t = type(value)
    return (
        (key == "seq_tag" and t is str)
        or (key == "seq_idx" and t is int)
        or (key == "complete_frac" and (t is float or t is int))
    )


def _check_spans(pos: int, spans: Any, arrays: Any, frames: Sequence[Any]) -> None:
    if frames:
        raise ProtocolError(f"item {pos}: an item in the sender's memory carries frames")
    ok = type(spans) is list and len(spans) == len(arrays)
    if ok:
        for sp in spans:
            if type(sp) is not list or len(sp) != 2:
                ok = False
                break
            for v in sp:
                if type(v) is not int or v < 0:
                    ok = False
    if not ok:
        raise ProtocolError(f"item {pos}: bad memory spans {spans!r:.60}")


def _check_block(pos: int, block: Any, arrays: Any, frames: Sequence[Any]) -> None:
    if frames:
        raise ProtocolError(f"item {pos}: an item in shared memory carries frames")
    ok = type(block) is list and len(block) == 4 and type(block[3]) is list and len(block[3]) == len(arrays)
    if ok:
        for v in block[:3]:
            if type(v) is not int or v < 0:
                ok = False
        for v in block[3]:
            if type(v) is not int or v < 0:
                ok = False
    if not ok:
        raise ProtocolError(f"item {pos}: bad shared-memory block {block!r:.60}")


MAX_NDIM = 64  # numpy's limit


MAX_ELEMENTS = 1 << 56


@functools.lru_cache(maxsize=1024)
def _itemsize(dtype_str: str) -> Optional[int]:
    """The item size of a plain dtype from the network, or None if it is refused (call with a str)."""
    try:
        size = wire.check_dtype(dtype_str).itemsize
    except wire.WireError:
        return None
    return size or None  # 'S0', 'U0': nothing to rebuild an array from


_STR, _INT, _NUMBER = {str}, {int}, {int, float}
