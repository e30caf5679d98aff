"""The Dataset base class: a corpus of seqs plus a per-epoch order.

A seq is a plain dict of data keys -> numpy arrays plus the meta entries
``seq_tag`` (str), ``seq_idx`` (int, position in the epoch order) and
``complete_frac`` (float in (0, 1], ``(pos + 1) / num_seqs``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Iterator, List, Optional

import numpy as np

from ppclient.batching import default_length_key
from ppclient.wire import META_KEYS
from ppserver.datasets.orderings import epoch_random_seed, full_order, parse_seq_ordering, partition
from ppserver.errors import ConfigError
from ppserver.mappers.apply import STRING, dtype_text

_MAX_SEED = 2**32 - 1  # numpy.random.RandomState takes seeds in [0, 2**32)


class UnknownSeqTagError(ValueError, KeyError):
    """A seq tag not in the corpus; catchable as ValueError or KeyError."""

    __str__ = BaseException.__str__  # KeyError would quote the message


def length_key_of(seq: Dict[str, Any]) -> str:
    """The key whose first axis is the seq's length (default_length_key of its arrays)."""
    key = default_length_key({k: (np.asarray(v).dtype, np.shape(v)) for k, v in seq.items()})
    if key is None:
        raise ValueError("a seq without arrays has no length")
    return key


def same_dtype(a: np.dtype, b: np.dtype) -> bool:
    """Whether arrays of two seqs agree in dtype: the same, or both text (str arrays of any width)."""
    return a == b or (a.kind == "U" and b.kind == "U")


def template_dtype(dtype: np.dtype) -> str:
    """A data key's dtype as a template gives it: "string" for text of any width, else its text."""
    return STRING if dtype.kind == "U" else dtype_text(dtype)


def is_int(value: Any) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_seed(key: str, value: Any, note: str = "") -> int:
    if not is_int(value) or not 0 <= value <= _MAX_SEED:
        raise ConfigError(key, f"must be an integer in [0, 2**32){note}, got {value!r}")
    return int(value)


class Dataset:
    """Base class: subclasses provide the corpus, this class owns the epoch order.

    The order of an epoch is the one RETURNN's Dataset gives for the same seq lengths, epoch and
    options: `seq_ordering`, `partition_epoch` (each epoch is the next 1/partition_epoch of a
    full-epoch order), `fixed_random_seed` (one seed for every epoch) and `order_seed` (the
    config's `seed`, added to the epoch's seed as RETURNN's random_seed_offset).

    Hooks (docs/datasets.md; all called from the server's reader thread, one at a time):
    ``_num_corpus_seqs()``, ``_load(corpus_idx)``, ``_tag(corpus_idx)`` and optionally
    ``_seq_len(corpus_idx)`` (the default loads the seq), ``_key_lens(key)`` (lengths known
    up front: batches are cut before reading), ``seq_durations()`` (likewise, by seconds),
    ``_corpus_idx_for_tag(tag)``, ``_compute_data_keys()`` (the default loads the whole corpus
    once) and ``data_files()`` or ``identity()`` (what the served fingerprint covers of the data).
    The arrays ``_load`` returns are sent without a copy: return fresh arrays or views of data
    that never changes, not a buffer that the next call overwrites.
    """

    def __init__(
        self,
        *,
        seq_ordering: str = "default",
        order_seed: int = 0,
        partition_epoch: int = 1,
        fixed_random_seed: Optional[int] = None,
    ):
        self._ordering = parse_seq_ordering(seq_ordering)
        self.order_seed = _check_seed("order_seed", order_seed, " (it is the config's seed)")
        if not is_int(partition_epoch) or partition_epoch < 1:
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
        return int(np.shape(data[length_key_of(data)])[0])

    def _corpus_idx_for_tag(self, tag: str) -> Optional[int]:
        if self._tag_index is None:
            self._tag_index = {self._tag(i): i for i in range(self.total_num_seqs)}
        return self._tag_index.get(tag)

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        return describe_arrays(self._load(i) for i in range(self.total_num_seqs))

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        """The corpus seqs' lengths (first axes) of `key`, if known without loading them; None: not."""
        return None

    def seq_durations(self) -> Optional[np.ndarray]:
        """Every corpus seq's duration in seconds (float64), where the dataset knows them without
        reading the seqs (a manifest of audio files says them); None: not known."""
        return None

    def data_files(self) -> List[str]:
        """The files the seqs are read from, where the dataset knows them ([]: none known)."""
        return []

    def identity(self) -> Any:
        """What the server's fingerprint covers of the data beyond the dataset dict, so that a resume
        state or a restarted server's clients notice data that changed: by default each of
        data_files()'s absolute path, size and mtime_ns (cheap: no file is read). Override it for
        data that is not files (a database's version); a JSON-like value, equal while the data is."""
        return [file_stamp(path) for path in self.data_files()]

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
            full = full_order(self._ordering, self.total_num_seqs, self.epoch_seed(int(epoch)), self.seq_lens)
            order = [int(i) for i in partition(full, int(epoch), self.partition_epoch)]
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
        if not is_int(epoch) or epoch < 0:
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
                if not is_int(idx) or not 0 <= idx < n:
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

    def epoch_durations(self) -> Optional[np.ndarray]:
        """The durations in seconds of the current epoch's seqs in order (seq_durations()), where
        the dataset knows them (the server then cuts batches by max_duration up front); else None."""
        durations = self.seq_durations()
        if durations is None:
            return None
        durations = np.asarray(durations, dtype=np.float64)
        if durations.shape != (self.total_num_seqs,):
            raise ValueError(f"seq_durations() gave {durations.shape} values for {self.total_num_seqs} corpus seqs")
        return durations[np.asarray(self._require_order(), dtype=np.int64)]

    def get_seq(self, pos: int) -> Dict[str, Any]:
        order = self._require_order()
        if not is_int(pos) or not 0 <= pos < len(order):
            raise IndexError(f"seq position {pos!r} out of range [0, {len(order)})")
        pos = int(pos)
        corpus_idx = order[pos]
        data = self._load(corpus_idx)
        if not data.keys().isdisjoint(META_KEYS):
            raise ValueError(f"data key(s) {[k for k in META_KEYS if k in data]} collide with seq meta entries")
        seq: Dict[str, Any] = dict(data)  # (the hook's dict may be its own: the meta entries go in a copy)
        seq["seq_tag"] = str(self._tag(corpus_idx))
        seq["seq_idx"] = pos
        seq["complete_frac"] = (pos + 1) / len(order)
        return seq

    def iterate(self) -> Iterator[Dict[str, Any]]:
        for pos in range(self.num_seqs):
            yield self.get_seq(pos)


def file_stamp(path: Any) -> List[Any]:
    """[absolute path, size, mtime_ns] of a file ([path, None, None] if it cannot be stat'ed)."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
    except OSError:
        return [path, None, None]
    return [path, st.st_size, st.st_mtime_ns]


def describe_arrays(seqs: Iterable[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
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
            if not same_dtype(arr.dtype, dtypes[k]) or arr.ndim != len(shapes[k]):
                raise ValueError(
                    f"key {k!r}: inconsistent dtype/ndim across seqs "
                    f"({dtypes[k]}, ndim {len(shapes[k])} vs {arr.dtype}, ndim {arr.ndim})"
                )
            shapes[k] = [d if d == a else None for d, a in zip(shapes[k], arr.shape)]
    return {k: {"shape": shapes[k], "dtype": template_dtype(dtypes[k])} for k in (keys or [])}
