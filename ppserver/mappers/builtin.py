"""Built-in ``map_seq`` functions: ``f(seq, **kwargs) -> seq``.

They return new dicts and never modify the input arrays, since the same seq object may
still be referenced by the caller.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

__all__ = ["spec_augment", "double"]


def _randint(rng: Any, low: int, high: int) -> int:
    """Integer in [low, high]; accepts RandomState and Generator."""
    if hasattr(rng, "integers"):
        return int(rng.integers(low, high + 1))
    return int(rng.randint(low, high + 1))


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"spec_augment: {name} must be a non-negative integer, got {value!r}")
    return int(value)


def spec_augment(
    seq: Dict[str, Any],
    *,
    rng: Any,
    epoch: Optional[int] = None,
    seq_idx: Optional[int] = None,
    max_time_masks: int = 2,
    max_time_width: int = 20,
    max_freq_masks: int = 2,
    max_freq_width: int = 10,
    key: str = "data",
    **kwargs,
) -> Dict[str, Any]:
    """SpecAugment-style masking of ``seq[key]`` (time on axis 0, features on the last axis).

    Draws 1..max_*_masks masks of each kind (none if the max is 0), each 1..max_*_width wide,
    and zeroes them. All randomness comes from `rng`, so a seeded rng reproduces the result.

    - max_time_masks: most masks along time (frames, axis 0); 0: none
    - max_time_width: most frames one time mask zeroes
    - max_freq_masks: most masks along the features (the last axis); 0: none
    - max_freq_width: most features one feature mask zeroes
    - key: the array masked (default ``data``, what ``speech.fbank`` makes)

    Configure it with ``functools.partial(spec_augment, max_time_masks=4, key="feats")``.
    Its outputs are its inputs (same keys, shapes and dtypes): ``spec_augment.outputs``.
    """
    max_time_masks = _check_count("max_time_masks", max_time_masks)
    max_time_width = _check_count("max_time_width", max_time_width)
    max_freq_masks = _check_count("max_freq_masks", max_freq_masks)
    max_freq_width = _check_count("max_freq_width", max_freq_width)
    x = np.array(seq[key], copy=True)
    if x.ndim < 2:
        raise ValueError(f"spec_augment: seq[{key!r}] must have shape (time, ..., features), got {x.shape}")
    for axis, max_masks, max_width in (
        (0, max_time_masks, max_time_width),
        (x.ndim - 1, max_freq_masks, max_freq_width),
    ):
        size = x.shape[axis]
        if max_masks == 0 or max_width == 0 or size == 0:
            continue
        for _ in range(_randint(rng, 1, max_masks)):
            width = min(_randint(rng, 1, max_width), size)
            start = _randint(rng, 0, size - width)
            index = [slice(None)] * x.ndim
            index[axis] = slice(start, start + width)
            x[tuple(index)] = 0
    out = dict(seq)
    out[key] = x
    return out


def _spec_augment_outputs(inputs: Dict[str, Dict[str, Any]], key: str = "data", **kwargs) -> Dict[str, Dict[str, Any]]:
    """spec_augment keeps its seqs' templates; the masked key must have a time and a feature axis."""
    if key not in inputs:
        raise ValueError(f"spec_augment: its seqs have no key {key!r} (they have {', '.join(map(repr, inputs))})")
    if len(inputs[key]["shape"]) < 2:
        raise ValueError(f"spec_augment: {key!r} must have shape (time, ..., features), it has {inputs[key]['shape']}")
    return inputs


spec_augment.outputs = _spec_augment_outputs  # type: ignore[attr-defined]


def double(seq: Dict[str, Any], **kwargs) -> Dict[str, Any]:
    """Multiplies every floating-point array by 2 (dtype kept); a cheap, visible transformation for benchmarks."""
    out = dict(seq)
    for k, v in seq.items():
        if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating):
            out[k] = v * v.dtype.type(2)
    return out
