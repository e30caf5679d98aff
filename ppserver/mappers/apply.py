"""Running the user's mappers: seeding, meta entries, output validation.

Kept free of I/O so the workers and the reference epoch (ppserver/reference.py) share one
definition of what "the mapped epoch" is.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Callable, Dict, Iterator, Optional

import numpy

from ppclient.wire import META_KEYS

_SEQ_STREAM = 0
_PARTITION_STREAM = 1


class MappingError(Exception):
    """A mapper raised or produced an output that does not fit the templates."""

    def __init__(self, message: str, seq_tag: Optional[str] = None):
        super().__init__(message)
        self.seq_tag = seq_tag


class TemplateMismatch(MappingError):
    """An output that does not fit the output templates (a key missing, its ndim, dtype or dims)."""


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash step."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _seed(seed: int, epoch: int, kind: int, index: int) -> int:
    """A 32-bit RandomState seed from (seed, epoch, kind, index); ~1 us instead of SeedSequence's ~10."""
    return _mix64(_prefix(seed, epoch, kind) ^ (int(index) & _MASK64)) >> 32


@functools.lru_cache(maxsize=64)
def _prefix(seed: int, epoch: int, kind: int) -> int:
    """The hash of (seed, epoch, kind), the same for every seq of an epoch: computed once."""
    h = 0
    for part in (seed, epoch, kind):
        h = _mix64(h ^ (int(part) & _MASK64))
    return h


# Constructing a RandomState costs ~100 us; reseeding one costs ~1 us. map_seq calls run one
# at a time per process, so they share one generator, reseeded for every seq.
_shared_seq_rng = numpy.random.RandomState(0)


def seq_rng(seed: int, epoch: int, seq_idx: int) -> numpy.random.RandomState:
    """The rng given to map_seq for one seq: a function of (seed, epoch, seq_idx) only.

    It is valid for the duration of that call (the next seq reseeds it).
    """
    _shared_seq_rng.seed(_seed(seed, epoch, _SEQ_STREAM, seq_idx))
    return _shared_seq_rng


def partition_rng(seed: int, epoch: int, partition: int) -> numpy.random.RandomState:
    """The rng given to one map_seq_stream partition (its own object: streams run interleaved)."""
    return numpy.random.RandomState(_seed(seed, epoch, _PARTITION_STREAM, partition))


def fwd_compat_kwargs() -> Dict[str, Any]:
    """An extra, randomly named keyword: mappers must take **kwargs to stay forward compatible."""
    return {f"_fwd_compat_arg_{random.randrange(1000)}": None}


@functools.lru_cache(maxsize=256)
def _dtype(name: str) -> numpy.dtype:
    """A template's dtype in native byte order: validation does not check byte order."""
    return _native_dtype(numpy.dtype(name))


def _native_dtype(dtype: numpy.dtype) -> numpy.dtype:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def dtype_text(dtype: numpy.dtype) -> str:
    """How a dtype is written in templates and messages: a string numpy parses back to the same dtype.

    `.name` reads best ("float32") but loses the size of flexible dtypes ("<U5" is "str160")
    and the byte order, so those keep `.str`.
    """
    if dtype.isnative and not numpy.issubdtype(dtype, numpy.flexible):
        return dtype.name
    return dtype.str


STRING = "string"  # a template dtype: str arrays of any length (RETURNN's "string", e.g. OggZip's "raw")


def validate(seq: Any, templates: Dict[str, Dict[str, Any]]) -> None:
    """Check a mapper output against the output templates; the error names the key.

    A template is ``{"shape": [None | int, ...], "dtype": str}`` with optional
    ``"sparse_dim": int`` (values are class indices below it) and ``"labels": [str]``
    (its vocabulary, as long as sparse_dim). None marks an axis that varies across seqs.
    """
    tag = seq.get("seq_tag") if isinstance(seq, dict) else None
    if not isinstance(seq, dict):
        raise MappingError(f"mapper must return a dict, got {type(seq).__name__}")
    for key, value in seq.items():
        if not isinstance(key, str):
            raise MappingError(f"output key {key!r} is a {type(key).__name__}, expected a str", tag)
        if key in META_KEYS:
            continue
        if not isinstance(value, numpy.ndarray):
            raise MappingError(f"output {key!r} is a {type(value).__name__}, expected a numpy array", tag)
    for key, tpl in templates.items():
        if key not in seq:
            raise TemplateMismatch(f"output is missing key {key!r}", tag)
        value = seq[key]
        shape = tpl["shape"]
        if value.ndim != len(shape):
            raise TemplateMismatch(
                f"ndim mismatch for {key!r}: got {value.ndim}, expected {len(shape)} (shape {tuple(shape)})", tag
            )
        if tpl["dtype"] == STRING:
            if value.dtype.kind != "U":
                raise TemplateMismatch(
                    f"dtype mismatch for {key!r}: got {dtype_text(value.dtype)}, expected a str array", tag
                )
            continue
        want_dtype = _dtype(tpl["dtype"])
        if _native_dtype(value.dtype) != want_dtype:
            raise TemplateMismatch(
                f"dtype mismatch for {key!r}: got {dtype_text(value.dtype)}, expected {dtype_text(want_dtype)}", tag
            )
        for axis, (got, want) in enumerate(zip(value.shape, shape)):
            if want is not None and got != want:
                raise TemplateMismatch(f"dim {axis} mismatch for {key!r}: got {got}, expected {want}", tag)
        sparse = tpl.get("sparse_dim")
        if sparse is not None and value.size and (value.min() < 0 or value.max() >= sparse):
            raise TemplateMismatch(f"{key!r} holds class indices outside [0, {sparse}) (its sparse_dim)", tag)
    cf = seq.get("complete_frac")
    if cf is not None and not 0.0 <= float(cf) <= 1.0:
        raise MappingError(f"complete_frac must be in [0, 1], got {cf}", tag)


def native(seq: Dict[str, Any]) -> Dict[str, Any]:
    """Outputs in native byte order (copies where needed): consumers such as torch.from_numpy refuse others."""
    if all(v.dtype.isnative for k, v in seq.items() if k not in META_KEYS):
        return seq
    return {
        k: (v if k in META_KEYS or v.dtype.isnative else v.astype(v.dtype.newbyteorder("="))) for k, v in seq.items()
    }


def writable(seq: Dict[str, Any]) -> Dict[str, Any]:
    """Mappers may work in place: give them writable copies of read-only arrays."""
    ndarray = numpy.ndarray
    for k, v in seq.items():
        if type(v) is ndarray and not v.flags.writeable:
            return {k: (v.copy() if type(v) is ndarray and not v.flags.writeable else v) for k, v in seq.items()}
    return seq


def apply_map_seq(
    map_seq: Callable,
    seq: Dict[str, Any],
    *,
    epoch: int,
    seed: int,
    templates: Dict[str, Dict[str, Any]],
    expected_tag: Optional[str] = None,
) -> Optional[Dict[str, Any]]:
    """Apply map_seq to one seq with its own rng; restore dropped meta entries; validate. None: the
    mapper skipped the seq (a corrupt file, say): it is left out of the epoch."""
    meta = {k: seq[k] for k in META_KEYS if k in seq}
    seq_idx = int(meta["seq_idx"])
    out = map_seq(dict(seq), epoch=epoch, seq_idx=seq_idx, rng=seq_rng(seed, epoch, seq_idx), **fwd_compat_kwargs())
    if out is None:
        return None
    if not isinstance(out, dict):
        raise MappingError(f"map_seq must return a dict, got {type(out).__name__}", meta.get("seq_tag"))
    for k, v in meta.items():
        out.setdefault(k, v)
    validate(out, templates)
    if expected_tag is not None and out["seq_tag"] != expected_tag:
        raise MappingError(f"seq tag mismatch: {out['seq_tag']!r} != {expected_tag!r} (seq_list given)", expected_tag)
    return native(out)


class StreamValidator:
    """Validates one stream's outputs, including a non-decreasing complete_frac."""

    def __init__(self, templates: Dict[str, Dict[str, Any]]):
        self.templates = templates
        self.last_complete_frac = 0.0

    def __call__(self, seq: Any) -> Dict[str, Any]:
        validate(seq, self.templates)
        cf = seq.get("complete_frac")
        if cf is not None:
            cf = float(cf)
            if cf < self.last_complete_frac:
                raise MappingError(
                    f"complete_frac must not decrease: got {cf} after {self.last_complete_frac}", seq.get("seq_tag")
                )
            self.last_complete_frac = cf
        return native(seq)


def run_stream(
    map_seq_stream: Callable,
    inputs: Iterator[Dict[str, Any]],
    *,
    epoch: int,
    seed: int,
    partition: int,
    templates: Dict[str, Dict[str, Any]],
    rng: Optional[numpy.random.RandomState] = None,
) -> Iterator[Dict[str, Any]]:
    """Run map_seq_stream over one partition's inputs, validating every output; `rng` defaults to
    partition_rng."""
    if rng is None:
        rng = partition_rng(seed, epoch, partition)
    out = map_seq_stream(inputs, epoch=epoch, rng=rng, **fwd_compat_kwargs())
    if not isinstance(out, Iterator):
        raise MappingError(f"map_seq_stream must return an iterator, got {type(out).__name__}")
    check = StreamValidator(templates)
    for seq in out:
        yield check(seq)
