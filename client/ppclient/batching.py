"""How a job's epochs are cut into batches: the settings a client asks for and a server checks.

The server cuts every epoch of a job that batches into batches of seqs (greedily, as RETURNN
and Lhotse's samplers do: a seq joins the batch while the batch keeps within `max_seqs` seqs,
`max_frames` padded frames, seqs times the longest, and `max_duration` seconds counted as
Lhotse's TimeConstraint counts them), the workers pad each batch into one
array per key, and batch j of the epoch goes to rank j % world_size. The settings travel as
a small dict in the epoch request; `Batching.from_dict` is the one place that checks them, on
both sides, so a bad value is one line naming it before anything is sent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, Mapping, Optional, Sequence, Tuple, Union

import numpy

from .collate import LENGTHS, colliding
from .errors import UsageError

KEYS = ("max_seqs", "max_frames", "max_duration", "quadratic_duration", "length_key", "bucket_window", "pad")
DURATION_KEYS = ("max_duration", "quadratic_duration")  # in the canonical dict only when max_duration is set
MAX_BUCKET_WINDOW = 1 << 20  # seqs the server sorts at a time (it holds their lengths, or the seqs)
PAD_INTS = (-(1 << 63), (1 << 63) - 1)  # an int pad value travels and fills as an int64


def default_length_key(specs: Mapping[str, Tuple[Any, Sequence[Any]]]) -> Optional[str]:
    """The key whose first axis is a seq's length where none is named, of `specs` (key -> (dtype,
    shape): a template's or an array's): `data`, else the first key that has an axis and is not text
    (a transcript, a path: its length says nothing), else the first (None: no keys). The epoch orders
    by length, the cut and the stream cut all measure this one."""
    if "data" in specs:
        return "data"
    return next((k for k, (dtype, shape) in specs.items() if measures_length(dtype, shape)), next(iter(specs), None))


def measures_length(dtype: Any, shape: Sequence[Any]) -> bool:
    """Whether an array of this dtype (numpy's, or a template's, where "string" is text of any
    length) and shape has a first axis that tells a seq's length: it has one, and it is not text."""
    return len(shape) >= 1 and dtype != "string" and numpy.dtype(dtype).kind not in "US"


@dataclass(frozen=True)
class Batching:
    """`max_seqs`: seqs per batch; `max_frames`: padded frames per batch (seqs x the longest, in
    the lengths the cut uses; a longer seq is a batch of its own); `max_duration`: seconds per
    batch as Lhotse's TimeConstraint counts them (seqs x the longest duration, where each seq's
    duration d counts as d + d*d/`quadratic_duration` if that is set; a longer seq is a batch of
    its own); `length_key`: the key whose first axis is a seq's length (None:
    default_length_key); `bucket_window`: seqs sorted by length (by duration with max_duration)
    at a time before cutting (1: the epoch's order is kept); `pad`: the value each key is padded
    with (others: 0)."""

    max_seqs: Optional[int] = None
    max_frames: Optional[int] = None
    max_duration: Optional[float] = None
    quadratic_duration: Optional[float] = None
    length_key: Optional[str] = None
    bucket_window: int = 1
    pad: Tuple[Tuple[str, float], ...] = field(default=())

    @classmethod
    def from_dict(cls, value: Any, where: str = "batching") -> Batching:
        """The settings of a dict; UsageError (one line naming the key) for anything else."""
        if not isinstance(value, dict):
            raise UsageError(f"{where} must be a dict with keys from {', '.join(KEYS)}, got {value!r:.80}")
        unknown = sorted(str(k) for k in value if k not in KEYS)
        if unknown:
            raise UsageError(f"{where}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
        max_seqs = _count(value.get("max_seqs"), f"{where}['max_seqs']")
        max_frames = _count(value.get("max_frames"), f"{where}['max_frames']")
        max_duration = _seconds(value.get("max_duration"), f"{where}['max_duration']")
        quadratic = _seconds(value.get("quadratic_duration"), f"{where}['quadratic_duration']")
        if quadratic is not None and max_duration is None:
            raise UsageError(f"{where}['quadratic_duration'] counts toward max_duration: set max_duration too")
        if max_seqs is None and max_frames is None and max_duration is None:
            raise UsageError(f"{where} needs max_seqs, max_frames or max_duration (or several)")
        key = value.get("length_key")
        if key is not None and (not isinstance(key, str) or not key):
            raise UsageError(f"{where}['length_key'] must be a data key (a non-empty str) or None, got {key!r:.80}")
        window = value.get("bucket_window", 1)
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_BUCKET_WINDOW:
            raise UsageError(f"{where}['bucket_window'] must be an int from 1 to {MAX_BUCKET_WINDOW}, got {window!r}")
        pad = value.get("pad") or {}
        if not isinstance(pad, dict):
            raise UsageError(f"{where}['pad'] must be a dict {{key: number}}, got {pad!r:.80}")
        for k, v in pad.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise UsageError(f"{where}['pad'] must map keys to numbers, got {k!r:.40}: {v!r:.40}")
            if isinstance(v, int) and not PAD_INTS[0] <= v <= PAD_INTS[1]:
                raise UsageError(f"{where}['pad'][{k!r:.40}] must be an int64 (-2**63 to 2**63 - 1), got {v}")
        return cls(max_seqs, max_frames, max_duration, quadratic, key, window, tuple(sorted(pad.items())))

    @property
    def uses_lengths(self) -> bool:
        """Whether the cut needs the seqs' lengths: for `max_frames`, or to sort a bucket window
        (by length unless max_duration sorts it by duration)."""
        return self.max_frames is not None or (self.bucket_window > 1 and self.max_duration is None)

    def check_keys(
        self, measured: Collection[str], side: str, outputs: Mapping[str, Dict[str, Any]], where: str = "batching"
    ) -> None:
        """UsageError (one line naming the key) for a key of these settings the job does not have:
        a `length_key` the cut cannot measure (not in `measured`: the `side` keys, the inputs' with
        map_seq, the outputs' with map_seq_stream), a `pad` key that is not an output key (of the
        output templates `outputs`) or whose value its dtype cannot hold, or an output key a padded
        key's lengths would overwrite (one ending in ':lengths')."""
        if self.length_key is not None and self.length_key not in measured:
            raise UsageError(
                f"{where}['length_key'] {self.length_key!r} is not an {side} key of this server "
                f"({', '.join(map(repr, measured))})"
            )
        for k, v in self.pad:
            if k not in outputs:
                raise UsageError(
                    f"{where}['pad'] key {k!r} is not an output key of this server ({', '.join(map(repr, outputs))})"
                )
            dtype = _dtype(outputs[k].get("dtype"))
            if dtype is not None and dtype.kind in "iub" and not _holds(dtype, v):
                raise UsageError(f"{where}['pad'][{k!r}] {v!r} does not fit the key's dtype {dtype}")
        key = colliding(outputs)
        if key is not None:
            raise UsageError(
                f"data key {key!r} ends in {LENGTHS!r}, which names the lengths of a padded key in a batch: "
                "rename it to batch this data"
            )

    def to_dict(self) -> Dict[str, Any]:
        """The canonical dict (what travels, what a job compares, what a resume state keeps); the
        duration keys only where max_duration is set, so a cut without them travels as before."""
        out: Dict[str, Any] = {"max_seqs": self.max_seqs, "max_frames": self.max_frames}
        if self.max_duration is not None:
            out.update(max_duration=self.max_duration, quadratic_duration=self.quadratic_duration)
        out.update(length_key=self.length_key, bucket_window=self.bucket_window, pad=dict(self.pad))
        return out

    def describe(self) -> str:
        """In words, for errors and logs."""
        parts = []
        if self.max_seqs is not None:
            parts.append(f"max_seqs {self.max_seqs}")
        if self.max_frames is not None:
            parts.append(f"max_frames {self.max_frames}")
        if self.max_duration is not None:
            parts.append(f"max_duration {self.max_duration:g} s")
        if self.quadratic_duration is not None:
            parts.append(f"quadratic_duration {self.quadratic_duration:g} s")
        if self.length_key is not None:
            parts.append(f"length_key {self.length_key!r}")
        if self.bucket_window != 1:
            parts.append(f"bucket_window {self.bucket_window}")
        if self.pad:
            parts.append(f"pad {dict(self.pad)}")
        return ", ".join(parts)


def _dtype(text: Any) -> Optional[numpy.dtype]:
    """A template's dtype (None: a str key, or none given)."""
    try:
        return numpy.dtype(text) if isinstance(text, str) else None
    except TypeError:
        return None


def _holds(dtype: numpy.dtype, value: float) -> bool:
    """Whether an int or bool array can be padded with `value` as it is."""
    info = numpy.iinfo(dtype) if dtype.kind != "b" else numpy.iinfo(numpy.uint8)
    top = 1 if dtype.kind == "b" else info.max
    return float(value).is_integer() and info.min <= value <= top


def describe(value: Union[Batching, Dict[str, Any], None]) -> str:
    """A batching (or a request's canonical dict of one; None or {}: one seq at a time), in words."""
    if not value:
        return "one seq at a time"
    return f"batches of {(value if isinstance(value, Batching) else Batching.from_dict(value)).describe()}"


def argument(value: Union[bool, Dict[str, Any], None]) -> Optional[Dict[str, Any]]:
    """A client's batching argument as it travels: None (the server's default), {} (False: one seq
    at a time) or the checked settings."""
    if value is None:
        return None
    if value is False:
        return {}
    if value is True:
        raise UsageError(
            "batching must be a dict of settings, None (the server's default) or False (one seq at a time)"
        )
    return Batching.from_dict(value).to_dict()


def _count(value: Any, where: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 2**62:
        raise UsageError(f"{where} must be an int >= 1 or None, got {value!r:.80}")
    return value


def _seconds(value: Any, where: str) -> Optional[float]:
    if value is None:
        return None
    seconds = float("nan")
    if not isinstance(value, (bool, numpy.bool_)) and isinstance(value, (int, float, numpy.integer, numpy.floating)):
        try:
            seconds = float(value)
        except OverflowError:
            pass
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"{where} must be a finite number of seconds > 0 or None, got {value!r:.80}")
    return seconds
