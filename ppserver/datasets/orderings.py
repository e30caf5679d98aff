"""Epoch orders as RETURNN's Dataset gives them: `seq_ordering` parsed, the seed of an epoch's
shuffle, the full-epoch order of each ordering, and the part of it a sub-epoch serves when the
dataset has a `partition_epoch`."""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

import numpy as np

from ppserver.errors import ConfigError

# As in RETURNN's Dataset.get_seq_order_for_epoch. X is M (M bins) or .M (about M seqs per bin);
# :N makes N consecutive full epochs share one shuffle.
SEQ_ORDERINGS = (
    "default",
    "reverse",
    "sorted",
    "sorted_reverse",
    "random[:N]",
    "laplace[:X[:N]]",
    "sort_bin_shuffle[:X[:N]]",
    "sort_bin_shuffle_x2[:X[:N]]",
)


class Ordering(NamedTuple):
    """A parsed seq_ordering. bins: the bin count, or seqs per bin if per_bin (None: 2 bins);
    nth: how many consecutive full epochs share one seed."""

    kind: str
    bins: Optional[int] = None
    per_bin: bool = False
    nth: int = 1

    def num_bins(self, n: int) -> int:
        if self.bins is None:
            return 2
        return max(n // self.bins, 2) if self.per_bin else self.bins


def _positive(text: str) -> Optional[int]:
    return int(text) if text.isascii() and text.isdigit() and int(text) >= 1 else None


def parse_seq_ordering(value: Any) -> Ordering:
    """Parse once so that bad orderings fail at construction, not at the first epoch."""
    if not isinstance(value, str):
        raise ConfigError("seq_ordering", f"must be a string, got {type(value).__name__}")
    if value in ("default", "reverse", "sorted", "sorted_reverse"):
        return Ordering(value)
    kind, *args = value.split(":")
    if kind == "random" and len(args) <= 1:
        nth = _positive(args[0]) if args else 1
        if nth is not None:
            return Ordering(kind, nth=nth)
        raise ConfigError("seq_ordering", f"bad spec {value!r}; use 'random' or 'random:N' (N >= 1 epochs per seed)")
    if kind in ("laplace", "sort_bin_shuffle", "sort_bin_shuffle_x2") and len(args) <= 2:
        bins, per_bin, bins_ok = None, False, True
        if args:
            per_bin = args[0].startswith(".")
            bins = _positive(args[0][1:] if per_bin else args[0])
            bins_ok = bins is not None
        nth = _positive(args[1]) if len(args) == 2 else 1
        if bins_ok and nth is not None:
            return Ordering(kind, bins, per_bin, nth)
        raise ConfigError(
            "seq_ordering",
            f"bad spec {value!r}; use '{kind}', '{kind}:N' (N bins), '{kind}:.N' (about N seqs per bin),"
            " each optionally followed by ':M' (M >= 1 epochs per seed)",
        )
    raise ConfigError("seq_ordering", f"unknown ordering {value!r}; expected one of {', '.join(SEQ_ORDERINGS)}")


def epoch_random_seed(
    order_seed: int, epoch: int, *, nth: int = 1, partition_epoch: int = 1, fixed_random_seed: Optional[int] = None
) -> int:
    """RETURNN's seed for the epoch's shuffling (order_seed is its random_seed_offset).

    Epoch 0 counts as 1; all sub-epochs of one partitioned full epoch share a seed, and so do
    `nth` consecutive full epochs.
    """
    if fixed_random_seed is not None:
        return int(fixed_random_seed)
    seed = int(epoch) or 1
    if partition_epoch > 1:
        seed = (seed - 1) // partition_epoch + 1
    if nth > 1:
        seed = (seed - 1) // nth + 1
    return seed + int(order_seed)


def full_order(ordering: Ordering, n: int, seed: int, seq_lens: Callable[[], np.ndarray]) -> np.ndarray:
    """The corpus indices of a full epoch (before partition_epoch) of `n` seqs in `ordering`, the
    shuffles seeded with `seed`; `seq_lens()` is called only by the orderings that need lengths."""
    kind = ordering.kind
    if kind == "default":
        return np.arange(n)
    if kind == "reverse":
        return np.arange(n)[::-1]
    if kind == "sorted":
        return np.argsort(seq_lens(), kind="stable")
    if kind == "sorted_reverse":
        return np.argsort(-seq_lens(), kind="stable")
    rng = np.random.RandomState(seed)
    perm = rng.permutation(n)
    if kind == "random":
        return perm
    lens = seq_lens()
    bins = ordering.num_bins(n)
    if kind == "laplace":
        # Random bins, sorted by length alternately up and down: similar lengths meet in a batch.
        parts = []
        for i in range(bins):
            part = perm[i * n // bins : (i + 1) * n // bins]
            part_lens = -lens[part] if i % 2 == 1 else lens[part]
            parts.append(part[np.argsort(part_lens, kind="stable")])
        return np.concatenate(parts)
    # sort_bin_shuffle[_x2]: sort a shuffle by length, cut it into bins, visit the bins in random
    # order (x2: shuffled inside too). The rng calls must come in RETURNN's order to match it.
    by_len = perm[np.argsort(lens[perm], kind="stable")].tolist()
    out: List[int] = []
    for i in rng.permutation(bins):
        part = by_len[i * n // bins : (i + 1) * n // bins]
        if kind == "sort_bin_shuffle_x2":
            rng.shuffle(part)
        out.extend(part)
    return np.asarray(out, dtype=np.int64)


def partition(order: np.ndarray, epoch: int, parts: int) -> np.ndarray:
    """Sub-epoch `epoch` of a full-epoch order cut into `parts`: the first n % parts have one seq more."""
    if parts == 1:
        return order
    q, r = divmod(len(order), parts)
    k = ((epoch or 1) - 1) % parts
    start = k * q + min(k, r)
    return order[start : start + q + (k < r)]
