"""Datasets: a corpus of seqs plus a per-epoch order.

A seq is a plain dict of data keys -> numpy arrays plus the meta entries
``seq_tag`` (str), ``seq_idx`` (int, position in the epoch order) and
``complete_frac`` (float in (0, 1], ``(pos + 1) / num_seqs``).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple, Type, Union

import numpy as np

from ppserver.errors import ConfigError

__all__ = [
    "META_KEYS",
    "SEQ_ORDERINGS",
    "UnknownSeqTagError",
    "Dataset",
    "NumpyDataset",
    "DemoDataset",
    "save_npz",
    "load_npz",
    "make_dataset",
    "epoch_random_seed",
    "describe_arrays",
]

META_KEYS = ("seq_tag", "seq_idx", "complete_frac")
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
_MAX_SEED = 2**32 - 1  # numpy.random.RandomState takes seeds in [0, 2**32)


class UnknownSeqTagError(ValueError, KeyError):
    """A seq tag not in the corpus; catchable as ValueError or KeyError."""

    __str__ = BaseException.__str__  # KeyError would quote the message


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


class _Ordering(NamedTuple):
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


def _parse_seq_ordering(value: Any) -> _Ordering:
    """Parse once so that bad orderings fail at construction, not at the first epoch."""
    if not isinstance(value, str):
        raise ConfigError("seq_ordering", f"must be a string, got {type(value).__name__}")
    if value in ("default", "reverse", "sorted", "sorted_reverse"):
        return _Ordering(value)
    kind, *args = value.split(":")
    if kind == "random" and len(args) <= 1:
        nth = _positive(args[0]) if args else 1
        if nth is not None:
            return _Ordering(kind, nth=nth)
        raise ConfigError("seq_ordering", f"bad spec {value!r}; use 'random' or 'random:N' (N >= 1 epochs per seed)")
    if kind in ("laplace", "sort_bin_shuffle", "sort_bin_shuffle_x2") and len(args) <= 2:
        bins, per_bin, bins_ok = None, False, True
        if args:
            per_bin = args[0].startswith(".")
            bins = _positive(args[0][1:] if per_bin else args[0])
            bins_ok = bins is not None
        nth = _positive(args[1]) if len(args) == 2 else 1
        if bins_ok and nth is not None:
            return _Ordering(kind, bins, per_bin, nth)
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


def _check_seed(key: str, value: Any, note: str = "") -> int:
    if not _is_int(value) or not 0 <= value <= _MAX_SEED:
        raise ConfigError(key, f"must be an integer in [0, 2**32){note}, got {value!r}")
    return int(value)


class Dataset:
    """Base class: subclasses provide the corpus, this class owns the epoch order.

    The order of an epoch is the one RETURNN's Dataset gives for the same seq lengths, epoch and
    options: `seq_ordering`, `partition_epoch` (each epoch is the next 1/partition_epoch of a
    full-epoch order), `fixed_random_seed` (one seed for every epoch) and `order_seed` (the
    config's `seed`, added to the epoch's seed as RETURNN's random_seed_offset).

    Hooks: ``_num_corpus_seqs()``, ``_load(corpus_idx)``, ``_tag(corpus_idx)`` and optionally
    ``_seq_len(corpus_idx)`` (the default loads the seq), ``_corpus_idx_for_tag(tag)`` and
    ``_compute_data_keys()`` (the default loads the whole corpus once). The arrays ``_load``
    returns are sent without a copy: return fresh arrays or views of data that never changes,
    not a buffer that the next call overwrites.
    """

    def __init__(
        self,
        *,
        seq_ordering: str = "default",
        order_seed: int = 0,
        partition_epoch: int = 1,
        fixed_random_seed: Optional[int] = None,
    ):
        self._ordering = _parse_seq_ordering(seq_ordering)
        self.seq_ordering = seq_ordering
        self.order_seed = _check_seed("order_seed", order_seed, " (it is the config's seed)")
        if not _is_int(partition_epoch) or partition_epoch < 1:
            raise ConfigError("partition_epoch", f"must be an integer >= 1, got {partition_epoch!r}")
        self.partition_epoch = int(partition_epoch)
        self.fixed_random_seed = (
            None if fixed_random_seed is None else _check_seed("fixed_random_seed", fixed_random_seed)
        )
        self._order: Optional[List[int]] = None
        self._epoch: Optional[int] = None
        # The corpus is static, so these survive across epochs.
        self._seq_lens_cache: Optional[np.ndarray] = None
        self._data_keys_cache: Optional[Dict[str, Dict[str, Any]]] = None
        self._tag_index: Optional[Dict[str, int]] = None

    # ---- hooks -------------------------------------------------------------------------------

    def _num_corpus_seqs(self) -> int:
        raise NotImplementedError

    def _load(self, corpus_idx: int) -> Dict[str, np.ndarray]:
        raise NotImplementedError

    def _tag(self, corpus_idx: int) -> str:
        raise NotImplementedError

    def _seq_len(self, corpus_idx: int) -> int:
        data = self._load(corpus_idx)
        key = "data" if "data" in data else next(iter(data))
        return int(np.shape(data[key])[0])

    def _corpus_idx_for_tag(self, tag: str) -> Optional[int]:
        if self._tag_index is None:
            self._tag_index = {self._tag(i): i for i in range(self.total_num_seqs)}
        return self._tag_index.get(tag)

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        return describe_arrays(self._load(i) for i in range(self.total_num_seqs))

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        """The corpus seqs' lengths (first axes) of `key`, if known without loading them; None: not."""
        return None

    # ---- corpus ------------------------------------------------------------------------------

    @property
    def total_num_seqs(self) -> int:
        return int(self._num_corpus_seqs())

    def data_keys(self) -> Dict[str, Dict[str, Any]]:
        """``{key: {"shape": [None | int, ...], "dtype": str}}``; None marks an axis that varies across seqs.

        Sparse keys (class indices) also have ``"sparse_dim": int`` and may have ``"labels": [str]``.
        """
        if self._data_keys_cache is None:
            self._data_keys_cache = self._compute_data_keys()
        out = {}
        for k, v in self._data_keys_cache.items():
            out[k] = {"shape": list(v["shape"]), "dtype": v["dtype"]}
            if v.get("sparse_dim") is not None:
                out[k]["sparse_dim"] = int(v["sparse_dim"])
            if v.get("labels") is not None:
                out[k]["labels"] = list(v["labels"])
        return out

    def seq_lens(self) -> np.ndarray:
        """Lengths of all corpus seqs (int64), computed once."""
        if self._seq_lens_cache is None:
            n = self.total_num_seqs
            self._seq_lens_cache = np.fromiter((self._seq_len(i) for i in range(n)), dtype=np.int64, count=n)
        return self._seq_lens_cache

    # ---- epoch order -------------------------------------------------------------------------

    def init_seq_order(
        self, epoch: int, seq_list: Optional[List[str]] = None, seq_order: Optional[List[int]] = None
    ) -> None:
        """Fix the order for `epoch`; `seq_list` (tags) or `seq_order` (corpus indices) override the ordering.

        An overriding list is served whole: partition_epoch applies only to the ordering's epochs (as in RETURNN).
        """
        order = self._requested_order(epoch, seq_list, seq_order)
        if order is None:
            full = self._ordered_indices(int(epoch), self.total_num_seqs)
            order = [int(i) for i in self._partition(full, int(epoch))]
        self._order = order
        self._epoch = int(epoch)

    def check_epoch_args(
        self, epoch: int, seq_list: Optional[List[str]] = None, seq_order: Optional[List[int]] = None
    ) -> None:
        """Raise as init_seq_order would for these arguments, without touching the current epoch."""
        self._requested_order(epoch, seq_list, seq_order)

    def _requested_order(
        self, epoch: int, seq_list: Optional[List[str]], seq_order: Optional[List[int]]
    ) -> Optional[List[int]]:
        """The corpus indices `seq_list` or `seq_order` ask for (None: the ordering decides); checks all."""
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if seq_list is not None and seq_order is not None:
            raise ValueError("give at most one of seq_list and seq_order")
        if isinstance(seq_list, str) or isinstance(seq_order, str):
            raise TypeError("seq_list / seq_order must be lists, not a string")
        n = self.total_num_seqs
        if seq_list is not None:
            order = []
            for tag in seq_list:
                idx = self._corpus_idx_for_tag(tag) if isinstance(tag, str) else None
                if idx is None:
                    raise UnknownSeqTagError(f"unknown seq tag {tag!r}")
                order.append(int(idx))
            return order
        if seq_order is not None:
            order = []
            for idx in seq_order:
                if not _is_int(idx) or not 0 <= idx < n:
                    raise ValueError(f"seq_order entry {idx!r} out of range [0, {n})")
                order.append(int(idx))
            return order
        return None

    def epoch_seed(self, epoch: int) -> int:
        """The RandomState seed of `epoch`'s shuffling (random, laplace and sort_bin_shuffle orderings)."""
        return epoch_random_seed(
            self.order_seed,
            epoch,
            nth=self._ordering.nth,
            partition_epoch=self.partition_epoch,
            fixed_random_seed=self.fixed_random_seed,
        )

    def _ordered_indices(self, epoch: int, n: int) -> np.ndarray:
        """The full-epoch order (before partition_epoch): corpus indices."""
        kind = self._ordering.kind
        if kind == "default":
            return np.arange(n)
        if kind == "reverse":
            return np.arange(n)[::-1]
        if kind == "sorted":
            return np.argsort(self.seq_lens(), kind="stable")
        if kind == "sorted_reverse":
            return np.argsort(-self.seq_lens(), kind="stable")
        rng = np.random.RandomState(self.epoch_seed(epoch))
        perm = rng.permutation(n)
        if kind == "random":
            return perm
        lens = self.seq_lens()
        bins = self._ordering.num_bins(n)
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

    def _partition(self, order: np.ndarray, epoch: int) -> np.ndarray:
        """Sub-epoch `epoch` of a full-epoch order: the first n % P parts have one seq more."""
        parts = self.partition_epoch
        if parts == 1:
            return order
        q, r = divmod(len(order), parts)
        k = ((epoch or 1) - 1) % parts
        start = k * q + min(k, r)
        return order[start : start + q + (k < r)]

    def _require_order(self) -> List[int]:
        if self._order is None:
            raise RuntimeError("init_seq_order() has not been called")
        return self._order

    @property
    def epoch(self) -> Optional[int]:
        return self._epoch

    @property
    def order(self) -> List[int]:
        """Corpus indices of the current epoch, in order (a copy)."""
        return list(self._require_order())

    @property
    def num_seqs(self) -> int:
        """Number of seqs in the current epoch; raises RuntimeError before init_seq_order().

        A dataset that cannot tell in advance returns None and answers `is_less_than_num_seqs`
        instead: the reader then reads until it says no."""
        return len(self._require_order())

    def is_less_than_num_seqs(self, n: int) -> bool:
        return n < self.num_seqs

    def epoch_lengths(self, key: str) -> Optional[np.ndarray]:
        """The lengths of `key` of the current epoch's seqs in order, where the dataset knows them
        without reading the seqs (the server then cuts an epoch's batches up front); else None."""
        lens = self._key_lens(key)
        return None if lens is None else lens[np.asarray(self._require_order(), dtype=np.int64)]

    def get_seq(self, pos: int) -> Dict[str, Any]:
        order = self._require_order()
        if not _is_int(pos) or not 0 <= pos < len(order):
            raise IndexError(f"seq position {pos!r} out of range [0, {len(order)})")
        pos = int(pos)
        corpus_idx = order[pos]
        data = self._load(corpus_idx)
        clash = [k for k in META_KEYS if k in data]
        if clash:
            raise ValueError(f"data key(s) {clash} collide with seq meta entries")
        seq: Dict[str, Any] = dict(data)
        seq["seq_tag"] = str(self._tag(corpus_idx))
        seq["seq_idx"] = pos
        seq["complete_frac"] = (pos + 1) / len(order)
        return seq

    def iterate(self) -> Iterator[Dict[str, Any]]:
        for pos in range(self.num_seqs):
            yield self.get_seq(pos)


def describe_arrays(seqs) -> Dict[str, Dict[str, Any]]:
    """data_keys() description from an iterable of key->array dicts; raises ValueError on inconsistency."""
    shapes: Dict[str, list] = {}
    dtypes: Dict[str, np.dtype] = {}
    keys: Optional[List[str]] = None
    for data in seqs:
        if keys is None:
            keys = list(data)
        elif set(data) != set(keys):
            raise ValueError(f"seqs have different keys: {sorted(keys)} vs {sorted(data)}")
        for k in keys:
            arr = np.asarray(data[k])
            if k not in shapes:
                shapes[k] = list(arr.shape)
                dtypes[k] = arr.dtype
                continue
            if arr.dtype != dtypes[k] or arr.ndim != len(shapes[k]):
                raise ValueError(
                    f"key {k!r}: inconsistent dtype/ndim across seqs "
                    f"({dtypes[k]}, ndim {len(shapes[k])} vs {arr.dtype}, ndim {arr.ndim})"
                )
            shapes[k] = [d if d == a else None for d, a in zip(shapes[k], arr.shape)]
    return {k: {"shape": shapes[k], "dtype": str(dtypes[k])} for k in (keys or [])}


# ---- NumpyDataset ---------------------------------------------------------------------------

_NPZ_PREFIX = "seq"


def _validate_seqs(seqs: Any) -> List[Dict[str, np.ndarray]]:
    if not isinstance(seqs, (list, tuple)):
        raise ConfigError("seqs", f"must be a list of dicts, got {type(seqs).__name__}")
    if not seqs:
        raise ConfigError("seqs", "must not be empty")
    out: List[Dict[str, np.ndarray]] = []
    ref: Optional[Dict[str, Tuple[np.dtype, int]]] = None
    for i, seq in enumerate(seqs):
        if not isinstance(seq, dict) or not seq:
            raise ConfigError("seqs", f"seq {i} must be a non-empty dict of key -> array")
        arrays: Dict[str, np.ndarray] = {}
        for k, v in seq.items():
            if not isinstance(k, str) or not k:
                raise ConfigError("seqs", f"seq {i}: keys must be non-empty strings, got {k!r}")
            if k in META_KEYS:
                raise ConfigError("seqs", f"seq {i}: key {k!r} is reserved for seq meta data")
            try:
                arr = np.asarray(v)
            except Exception as exc:
                raise ConfigError("seqs", f"seq {i} key {k!r}: not convertible to an array: {exc}") from None
            if arr.dtype.hasobject:
                raise ConfigError("seqs", f"seq {i} key {k!r}: object arrays are not supported")
            arrays[k] = arr
        sig = {k: (a.dtype, a.ndim) for k, a in arrays.items()}
        if ref is None:
            ref = sig
            len_key = "data" if "data" in arrays else next(iter(arrays))
            if arrays[len_key].ndim < 1:
                raise ConfigError("seqs", f"key {len_key!r} defines the seq length and must have ndim >= 1")
        elif sig.keys() != ref.keys():
            raise ConfigError("seqs", f"seq {i} has keys {sorted(sig)}, expected {sorted(ref)}")
        else:
            for k, (dt, nd) in sig.items():
                if (dt, nd) != ref[k]:
                    raise ConfigError(
                        "seqs", f"seq {i} key {k!r}: dtype {dt} ndim {nd}, expected dtype {ref[k][0]} ndim {ref[k][1]}"
                    )
        out.append(arrays)
    return out


def _validate_tags(tags: Any, n: int) -> List[str]:
    if isinstance(tags, np.ndarray):
        tags = tags.tolist()
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise ConfigError("tags", "must be a list of strings")
    if len(tags) != n:
        raise ConfigError("tags", f"has {len(tags)} entries but there are {n} seqs")
    if len(set(tags)) != len(tags):
        seen: Set[str] = set()
        dup = None
        for t in tags:
            if t in seen:
                dup = t
                break
            seen.add(t)
        raise ConfigError("tags", f"must be unique; {dup!r} occurs more than once")
    return list(tags)


def save_npz(
    path: Union[str, os.PathLike], seqs: List[Dict[str, np.ndarray]], tags: Optional[List[str]] = None
) -> None:
    """Write seqs in NumpyDataset's npz layout: members ``seq{i}/{key}`` and optional ``tags`` (str array)."""
    arrays = _validate_seqs(seqs)
    members: Dict[str, np.ndarray] = {}
    for i, seq in enumerate(arrays):
        for k, a in seq.items():
            members[f"{_NPZ_PREFIX}{i}/{k}"] = a
    if tags is not None:
        members["tags"] = np.array(_validate_tags(tags, len(arrays)), dtype=str)
    # A file object keeps np.savez from appending ".npz" to the name.
    with open(path, "wb") as f:
        np.savez(f, **members)  # type: ignore[arg-type]  # numpy's stub types the first kwarg


def load_npz(path: Union[str, os.PathLike]) -> Tuple[List[Dict[str, np.ndarray]], Optional[List[str]]]:
    """Read the save_npz layout; returns (seqs, tags or None). Problems raise ConfigError("path", ...)."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            members = {name: npz[name] for name in npz.files}
    except Exception as exc:
        raise ConfigError("path", f"cannot read npz file {os.fspath(path)!r}: {exc}") from None
    tags_arr = members.pop("tags", None)
    by_idx: Dict[int, Dict[str, np.ndarray]] = {}
    for name, arr in members.items():
        head, sep, key = name.partition("/")
        num = head[len(_NPZ_PREFIX) :]
        if not sep or not key or not head.startswith(_NPZ_PREFIX) or not num.isdigit():
            raise ConfigError(
                "path", f"unexpected member {name!r} in {os.fspath(path)!r}; expected 'seq<i>/<key>' or 'tags'"
            )
        by_idx.setdefault(int(num), {})[key] = arr
    if sorted(by_idx) != list(range(len(by_idx))):
        raise ConfigError("path", f"seq indices in {os.fspath(path)!r} are not contiguous from 0")
    seqs = [by_idx[i] for i in range(len(by_idx))]
    tags = None if tags_arr is None else [str(t) for t in tags_arr.tolist()]
    return seqs, tags


class NumpyDataset(Dataset):
    """In-memory corpus from a list of key->array dicts or an npz file (see save_npz for the layout).

    `ordering`: the options of Dataset (seq_ordering, order_seed, partition_epoch, fixed_random_seed).
    """

    def __init__(
        self,
        *,
        seqs: Optional[List[Dict[str, np.ndarray]]] = None,
        path: Optional[Union[str, os.PathLike]] = None,
        tags: Optional[List[str]] = None,
        **ordering: Any,
    ):
        super().__init__(**ordering)
        if (seqs is None) == (path is None):
            raise ConfigError("seqs", "give exactly one of 'seqs' or 'path'")
        file_tags = None
        if path is not None:
            if not isinstance(path, (str, os.PathLike)):
                raise ConfigError("path", f"must be a file path, got {type(path).__name__}")
            seqs, file_tags = load_npz(path)
        self._seqs = _validate_seqs(seqs)
        n = len(self._seqs)
        if tags is None:
            tags = file_tags
        self._tags = [f"seq-{i}" for i in range(n)] if tags is None else _validate_tags(tags, n)
        self._len_key = "data" if "data" in self._seqs[0] else next(iter(self._seqs[0]))
        self._views = [{k: _read_only(a) for k, a in seq.items()} for seq in self._seqs]

    def _num_corpus_seqs(self) -> int:
        return len(self._seqs)

    def _load(self, corpus_idx: int) -> Dict[str, np.ndarray]:
        # Read-only views: the server sends them without copying, and nothing may change the corpus.
        return dict(self._views[corpus_idx])

    def _tag(self, corpus_idx: int) -> str:
        return self._tags[corpus_idx]

    def _seq_len(self, corpus_idx: int) -> int:
        return int(self._seqs[corpus_idx][self._len_key].shape[0])

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        return describe_arrays(self._seqs)

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        if key not in self._seqs[0]:
            return None
        return np.fromiter(
            (seq[key].shape[0] if seq[key].ndim else 1 for seq in self._seqs), dtype=np.int64, count=len(self._seqs)
        )


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


# ---- DemoDataset ----------------------------------------------------------------------------

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised integer hash: lengths for any number of seqs without one RNG per seq."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


class DemoDataset(Dataset):
    """Synthetic speech-like corpus, each seq generated on demand from (seed, index).

    "data": float32 (T, num_features) log-mel-like values in [-10, 5];
    "classes": int32 (max(1, T // 8),) labels in [0, num_classes). Tags are "demo-<i>".
    `ordering`: the options of Dataset (seq_ordering, order_seed, partition_epoch, fixed_random_seed).
    """

    def __init__(
        self,
        *,
        num_seqs: int = 200,
        seed: int = 0,
        min_frames: int = 50,
        max_frames: int = 400,
        num_features: int = 80,
        num_classes: int = 40,
        **ordering: Any,
    ):
        super().__init__(**ordering)
        for key, value, low in (
            ("num_seqs", num_seqs, 1),
            ("seed", seed, 0),
            ("min_frames", min_frames, 1),
            ("max_frames", max_frames, 1),
            ("num_features", num_features, 1),
            ("num_classes", num_classes, 1),
        ):
            if not _is_int(value) or value < low:
                raise ConfigError(key, f"must be an integer >= {low}, got {value!r}")
        if seed >= 2**63:
            raise ConfigError("seed", f"must be < 2**63, got {seed!r}")
        if max_frames < min_frames:
            raise ConfigError("max_frames", f"must be >= min_frames ({min_frames}), got {max_frames}")
        self.num_seqs_total = int(num_seqs)
        self.seed = int(seed)
        self.min_frames = int(min_frames)
        self.max_frames = int(max_frames)
        self.num_features = int(num_features)
        self.num_classes = int(num_classes)

    def seq_lens(self) -> np.ndarray:
        if self._seq_lens_cache is None:
            idx = np.arange(self.num_seqs_total, dtype=np.uint64)
            h = _splitmix64(_splitmix64(np.full_like(idx, self.seed)) ^ idx)
            span = np.uint64(self.max_frames - self.min_frames + 1)
            self._seq_lens_cache = (h % span).astype(np.int64) + self.min_frames
        return self._seq_lens_cache

    def _num_corpus_seqs(self) -> int:
        return self.num_seqs_total

    def _seq_len(self, corpus_idx: int) -> int:
        return int(self.seq_lens()[corpus_idx])

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        if key == "data":
            return self.seq_lens()
        return np.maximum(self.seq_lens() // 8, 1) if key == "classes" else None

    def _tag(self, corpus_idx: int) -> str:
        return f"demo-{corpus_idx}"

    def _corpus_idx_for_tag(self, tag: str) -> Optional[int]:
        num = tag[len("demo-") :] if tag.startswith("demo-") else ""
        if num.isdigit() and str(int(num)) == num and int(num) < self.num_seqs_total:
            return int(num)
        return None

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        lens = self.seq_lens()
        labels = np.maximum(lens // 8, 1)
        t_dim = int(lens[0]) if lens.min() == lens.max() else None
        l_dim = int(labels[0]) if labels.min() == labels.max() else None
        return {
            "data": {"shape": [t_dim, self.num_features], "dtype": "float32"},
            "classes": {"shape": [l_dim], "dtype": "int32"},
        }

    def _load(self, corpus_idx: int) -> Dict[str, np.ndarray]:
        num_frames = self._seq_len(corpus_idx)
        rng = np.random.default_rng([self.seed, corpus_idx])
        freqs = np.linspace(0.0, 1.0, self.num_features)[None, :]
        times = np.linspace(0.0, 1.0, num_frames)[:, None]
        # Spectral tilt: loud low frequencies, quiet high ones.
        spec = rng.uniform(1.0, 3.0) - rng.uniform(5.0, 8.0) * freqs
        # A few formant-like bumps whose centres drift slowly over time.
        for _ in range(3):
            centre = rng.uniform(0.05, 0.7) + rng.uniform(0.02, 0.1) * np.sin(
                2 * np.pi * rng.uniform(0.5, 4.0) * times + rng.uniform(0, 2 * np.pi)
            )
            width = rng.uniform(0.02, 0.08)
            spec = spec + rng.uniform(1.0, 3.0) * np.exp(-0.5 * ((freqs - centre) / width) ** 2)
        # Smooth loudness contour with quieter edges, like leading/trailing silence.
        energy = sum(
            rng.uniform(0.3, 1.0) * np.sin(2 * np.pi * rng.uniform(1.0, 8.0) * times + rng.uniform(0, 2 * np.pi))
            for _ in range(3)
        )
        energy = energy - 4.0 * (1.0 - np.sin(np.pi * times) ** 0.5)
        spec = spec + energy + rng.normal(0.0, 0.5, size=(num_frames, self.num_features))
        data = np.clip(spec, -10.0, 5.0).astype(np.float32)
        classes = rng.integers(0, self.num_classes, size=max(1, num_frames // 8), dtype=np.int32)
        return {"data": data, "classes": classes}


# ---- factory --------------------------------------------------------------------------------

BUILTIN_DATASETS: Dict[str, Type[Dataset]] = {"NumpyDataset": NumpyDataset, "DemoDataset": DemoDataset}
# Built-in classes in modules of their own, imported only when a config names them (their
# optional dependencies, h5py and RETURNN, are needed only then).
LAZY_DATASETS = {
    "HDFDataset": "ppserver.datasets.hdf:HDFDataset",
    "returnn": "ppserver.datasets.returnn:ReturnnDataset",
}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_class(name: str) -> Any:
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise ConfigError("dataset", f"cannot import class {name!r}: expected 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except Exception as exc:
        raise ConfigError("dataset", f"cannot import class {name!r}: {_one_line(exc)}") from None
    return obj


def make_dataset(spec: dict, *, order_seed: int = 0) -> Dataset:
    """Build a dataset from ``{"class": NAME, **kwargs}``; NAME is built-in or 'package.module:Name'."""
    if not isinstance(spec, dict):
        raise ConfigError("dataset", f"must be a dict with a 'class' entry, got {type(spec).__name__}")
    kwargs = dict(spec)
    name = kwargs.pop("class", None)
    if name is None:
        raise ConfigError("dataset", "missing 'class' entry")
    if not isinstance(name, str):
        raise ConfigError("dataset", f"'class' must be a string, got {type(name).__name__}")
    if name in BUILTIN_DATASETS:
        cls = BUILTIN_DATASETS[name]
    elif name in LAZY_DATASETS:
        cls = _import_class(LAZY_DATASETS[name])
    elif ":" in name:
        cls = _import_class(name)
    else:
        raise ConfigError(
            "dataset",
            f"unknown class {name!r}; use one of {', '.join([*BUILTIN_DATASETS, *LAZY_DATASETS])}"
            " or 'package.module:Name'",
        )
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        raise ConfigError("dataset", f"class {name!r} is not a subclass of ppserver.datasets.base.Dataset")
    kwargs.setdefault("order_seed", order_seed)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise  # the dataset's own check names its key (seq_ordering, path, ...)
    except (Exception, SystemExit) as exc:
        # One line naming the key instead of a traceback; any caller (the server) gets a ConfigError.
        raise ConfigError("dataset", f"{cls.__name__}: {_one_line(exc)}") from None
