"""Padding the seqs of a batch into one array per key (numpy only: workers and clients share it).

A batch of B seqs becomes, for every data key, one array `[B, T_max, ...]` (each seq's array
at the front of its row, the rest filled with the key's pad value) plus `key:lengths`, the
int64 lengths `[B]`; a key whose arrays are scalars becomes `[B]`. Meta entries become
`seq_tag` (a list of str), `seq_idx` (int64 `[B]`) and `complete_frac` (float64 `[B]`).
String keys pad with empty strings; clients hand them to the trainer as lists.

Workers lay the padded arrays out first (`layout`) and fill them where they will travel
(a shared-memory block, on one host), so padding is the only copy between the mapper's
output and the trainer.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy

from .wire import META_KEYS

LENGTHS = ":lengths"  # suffix of the key holding a padded key's lengths


class BatchError(ValueError):
    """The seqs of a batch cannot be padded together (keys, dtypes or feature axes differ)."""

    def __init__(self, message: str, seq_tag: Optional[str] = None):
        super().__init__(message)
        self.seq_tag = seq_tag


class Column(NamedTuple):
    """One padded array of a batch: its key, dtype, shape and the rows' lengths (None: scalars)."""

    key: str
    dtype: numpy.dtype
    shape: tuple
    lengths: Optional[List[int]]


def colliding(keys: Iterable[str]) -> Optional[str]:
    """The first key that ends in LENGTHS (None: none): a padded key's lengths travel under such
    a name, so a batching job's data may have no key of its own named so."""
    return next((key for key in keys if key.endswith(LENGTHS)), None)


Shapes = Dict[str, Any]  # a seq's arrays as (dtype, shape) by key, meta entries left out


def layout(seqs: Sequence[Dict[str, Any]]) -> List[Column]:
    """The padded arrays of a batch, keys in the first seq's order; BatchError naming the seq
    whose arrays do not fit the first one's, or that has a key ending in LENGTHS."""
    return layout_of(
        [
            (
                seq.get("seq_tag"),
                {k: (v.dtype, v.shape) for k, v in seq.items() if k not in META_KEYS and isinstance(v, numpy.ndarray)},
            )
            for seq in seqs
        ]
    )


def layout_of(seqs: Sequence[Tuple[Optional[str], Shapes]]) -> List[Column]:
    """layout() of the seqs' (tag, {key: (dtype, shape)}): what a server that holds only the
    arrays' descriptions checks of a batch its client will pad."""
    for tag, shapes in seqs:
        key = colliding(shapes)
        if key is not None:
            raise BatchError(
                f"batch: seq {tag!r} has array {key!r}: a key ending in {LENGTHS!r} names the lengths of a padded "
                "key in a batch (rename it)",
                tag,
            )
    head = f"seq {seqs[0][0]!r}, the batch's first,"  # each error names both seqs
    first = seqs[0][1]
    columns = []
    for key, (first_dtype, first_shape) in first.items():
        dtype = first_dtype
        ndim, trailing = len(first_shape), tuple(first_shape[1:])
        lengths = []
        for tag, shapes in seqs:
            spec = shapes.get(key)
            if spec is None:
                raise BatchError(f"batch: seq {tag!r} has no array {key!r}, {head} has", tag)
            seq_dtype, shape = spec
            if len(shape) != ndim or tuple(shape[1:]) != trailing:
                raise BatchError(
                    f"batch: {key!r} of seq {tag!r} has shape {tuple(shape)}, {head} has {tuple(first_shape)}: "
                    "only the first axis may differ",
                    tag,
                )
            if seq_dtype != dtype:
                if seq_dtype.kind in "US" and seq_dtype.kind == dtype.kind:
                    dtype = max(dtype, seq_dtype, key=lambda d: d.itemsize)  # the longest string fits all
                else:
                    raise BatchError(
                        f"batch: {key!r} of seq {tag!r} has dtype {seq_dtype}, {head} has {first_dtype}", tag
                    )
            if ndim:
                lengths.append(shape[0])
        if ndim:
            columns.append(Column(key, dtype, (len(seqs), max(lengths), *trailing), lengths))
        else:
            columns.append(Column(key, dtype, (len(seqs),), None))
    for tag, shapes in seqs:
        extra = next((k for k in shapes if k not in first), None)
        if extra is not None:
            raise BatchError(f"batch: seq {tag!r} has array {extra!r}, {head} has not", tag)
    return columns


def fill(
    seqs: Sequence[Dict[str, Any]],
    columns: Sequence[Column],
    out: Dict[str, numpy.ndarray],
    pad: Mapping[str, float],
) -> None:
    """Write the seqs' arrays into `out` (one array per column and per lengths key, e.g. views of a
    shared-memory block), padding each row's tail with the key's `pad` value (others: 0)."""
    for col in columns:
        dest = out[col.key]
        key = col.key
        if col.lengths is None:
            for i, seq in enumerate(seqs):
                dest[i] = seq[key]
            continue
        value = "" if col.dtype.kind in "US" else pad.get(key, 0)
        longest = col.shape[1]
        for i, (seq, n) in enumerate(zip(seqs, col.lengths)):
            row = dest[i]
            row[:n] = seq[key]
            if n < longest:
                try:
                    row[n:] = value
                except (OverflowError, ValueError, TypeError):
                    raise BatchError(
                        f"batch: pad value {value!r} of {key!r} does not fit its dtype {col.dtype}"
                    ) from None
        out[key + LENGTHS][...] = col.lengths


def arrays_of(columns: Sequence[Column]) -> List[tuple]:
    """(key, dtype, shape) of every array of a padded batch, in the order they travel."""
    out = []
    for col in columns:
        out.append((col.key, col.dtype, col.shape))
        if col.lengths is not None:
            out.append((col.key + LENGTHS, numpy.dtype(numpy.int64), (col.shape[0],)))
    return out


def meta_of(seqs: Sequence[Dict[str, Any]]) -> Dict[str, List[Any]]:
    """The batch's meta entries as lists (one entry per seq), as they travel in its header."""
    meta: Dict[str, List[Any]] = {}
    for key in META_KEYS:
        if any(key in seq for seq in seqs):
            meta[key] = [seq.get(key) for seq in seqs]
    return meta


def pad(seqs: Sequence[Dict[str, Any]], values: Optional[Mapping[str, float]] = None) -> Dict[str, Any]:
    """The seqs as one batch dict (new arrays), each key padded with its value in `values` (others:
    0): what a client makes of a batch whose seqs came unpadded."""
    columns = layout(seqs)
    out = {key: numpy.empty(shape, dtype) for key, dtype, shape in arrays_of(columns)}
    fill(seqs, columns, out, values or {})
    return batch_dict(out, meta_of(seqs))


def batch_dict(arrays: Dict[str, Any], meta: Dict[str, List[Any]]) -> Dict[str, Any]:
    """A batch as the trainer gets it: the padded arrays, `seq_tag` as a list, `seq_idx` and
    `complete_frac` as arrays, string keys as lists (one str, or list of str, per seq)."""
    batch: Dict[str, Any] = {}
    for key, array in arrays.items():
        if isinstance(array, numpy.ndarray) and array.dtype.kind in "US" and not key.endswith(LENGTHS):
            lengths = arrays.get(key + LENGTHS)
            if lengths is None:
                batch[key] = array.tolist()
            else:
                batch[key] = [row[:n].tolist() for row, n in zip(array, lengths.tolist())]
        else:
            batch[key] = array
    if "seq_tag" in meta:
        batch["seq_tag"] = list(meta["seq_tag"])
    if "seq_idx" in meta:
        batch["seq_idx"] = numpy.array(meta["seq_idx"], dtype=numpy.int64)
    if "complete_frac" in meta:
        batch["complete_frac"] = numpy.array(meta["complete_frac"], dtype=numpy.float64)
    return batch
