"""Serving a RETURNN dataset: ``dataset = {"class": "returnn", "dataset": {<RETURNN dataset dict>}}``.

The wrapped dataset keeps its own ``seq_ordering``, ``partition_epoch``, seeds and epoch
handling, and each epoch is read with the calls RETURNN's PostprocessingDataset makes
(``init_seq_order``, ``is_less_than_num_seqs``, ``load_seqs``, ``get_data``, ``get_tag``,
``get_complete_frac``), so the served seqs, tags and order are the ones RETURNN would see.

Most RETURNN datasets (MetaDataset, OggZipDataset, DistributeFilesDataset, every
CachedDataset2) only read forward. This adapter reads them forward and serves the
reader's requests from that one pass:

- a request for the next position reads it;
- a request further ahead reads the seqs in between and keeps them (a bounded cache,
  ``cache_mb``, lowest positions first), since a replay asks for them next;
- a request behind the pass is taken from the cache, or else the epoch is set up again
  and read from its start up to that position (deterministic: RETURNN's order depends
  only on the epoch). That is logged, as it costs reading the epoch's prefix again.

Replays are rare (a stream partition restarted after its worker died, a rank resuming
into an epoch other ranks still read), so the memory stays at most ``cache_mb`` and the
cost of a replay at most a few passes over the prefix. Random-access datasets
(HDFDataset and other CachedDatasets) are read at any position directly.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import Any, ContextManager, Dict, List, Optional

import numpy as np

from ppserver.datasets import returnn_audio
from ppserver.datasets.base import Dataset, UnknownSeqTagError, is_int
from ppserver.errors import ConfigError, one_line
from ppserver.mappers.apply import STRING, dtype_text

log = logging.getLogger("ppserver.dataset")

__all__ = ["ReturnnDataset", "templates_of"]


def _import_returnn() -> Any:
    try:
        from returnn.datasets import basic
    except ImportError as exc:
        raise ConfigError(
            "dataset", f"class 'returnn' needs RETURNN: pip install 'ppserver[returnn]' ({one_line(exc)})"
        ) from None
    return basic


def templates_of(ds: Any) -> Dict[str, Dict[str, Any]]:
    """Templates of a RETURNN dataset's keys, from the calls PostprocessingDataset makes for its
    TensorDict templates: a time axis, then get_data_shape; sparse_dim and labels if sparse."""
    out: Dict[str, Dict[str, Any]] = {}
    for key in ds.get_data_keys():
        dtype = ds.get_data_dtype(key)
        tpl: Dict[str, Any]
        if dtype == STRING:
            tpl = {"shape": [], "dtype": STRING}
        else:
            shape = [None if d is None else int(d) for d in ds.get_data_shape(key)]
            tpl = {"shape": [None, *shape], "dtype": dtype_text(np.dtype(dtype))}
        if ds.is_data_sparse(key):
            dim = ds.get_data_dim(key)
            if dim is not None:
                tpl["sparse_dim"] = int(dim)
                labels = (getattr(ds, "labels", None) or {}).get(key)
                if labels and len(labels) == dim:
                    tpl["labels"] = [str(label) for label in labels]
        out[key] = tpl
    return out


def _nbytes(seq: Dict[str, Any]) -> int:
    return sum(v.nbytes for v in seq.values() if isinstance(v, np.ndarray))


class ReturnnDataset(Dataset):
    """Any RETURNN dataset, built once in the server (RETURNN's ``init_dataset``)."""

    def __init__(
        self,
        *,
        dataset: Dict[str, Any],
        cache_mb: float = 256,
        random_access: Optional[bool] = None,
        order_seed: int = 0,
        audio_in_workers: bool = True,
    ):
        super().__init__(order_seed=order_seed)  # the order is the RETURNN dataset's, not ours
        basic = _import_returnn()
        if not isinstance(dataset, dict) or "class" not in dataset:
            raise ConfigError("dataset", "'dataset' of class 'returnn' must be a RETURNN dataset dict with a 'class'")
        if isinstance(cache_mb, bool) or not isinstance(cache_mb, (int, float)) or cache_mb < 0:
            raise ConfigError("dataset", f"'cache_mb' must be a number >= 0, got {cache_mb!r}")
        if not isinstance(audio_in_workers, bool):
            raise ConfigError("dataset", f"'audio_in_workers' must be True or False, got {audio_in_workers!r}")
        self.spec = dict(dataset)
        self.audio_in_workers = audio_in_workers
        if audio_in_workers:
            returnn_audio.install()
        if order_seed and "random_seed_offset" not in self.spec:
            # the config's seed is the offset of every seed, as RETURNN's random_seed_offset is
            self.spec["random_seed_offset"] = order_seed
        self.ds = basic.init_dataset(self.spec)
        from returnn.datasets.cached import CachedDataset

        self.random_access = isinstance(self.ds, CachedDataset) if random_access is None else bool(random_access)
        self.cache_bytes = int(cache_mb * (1 << 20))
        self._copy = isinstance(self.ds, CachedDataset)  # its get_data returns views into a reused buffer
        self._templates: Optional[Dict[str, Dict[str, Any]]] = None
        self._keys: List[str] = []
        self._args: Optional[tuple] = None
        self._count: Optional[int] = None
        self._end: Optional[int] = None  # the count, once reading found it
        self._cursor = 0  # forward-only: the next position the dataset reads
        self._cache: Dict[int, Dict[str, Any]] = {}
        self._cached = 0
        self.rewinds = 0
        self._all_tags: Optional[set] = None
        self._corpus: Optional[int] = None  # get_total_num_seqs(), asked once; -1: unknown

    def __repr__(self) -> str:
        return f"ReturnnDataset({type(self.ds).__name__})"

    def data_files(self) -> List[str]:
        """The files the RETURNN dataset dict names: every string in it (nested dicts and lists
        included) that is the path of an existing file. RETURNN's datasets take their files under
        many keys (files, path, ...); a file found some other way (a folder listed, a file list
        read) is not seen."""
        out: List[str] = []
        stack: List[Any] = [self.spec]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                stack.extend(value.values())
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, (str, os.PathLike)) and os.path.isfile(value):
                out.append(os.fspath(value))
        return sorted(set(out))

    # ---- description ------------------------------------------------------------------------
    def data_keys(self) -> Dict[str, Dict[str, Any]]:
        if self._templates is None:
            try:
                self._templates = templates_of(self.ds)
            except Exception:
                # Some datasets (DistributeFilesDataset) know their keys only once an epoch is set up,
                # and some read a seq for its dtype: read as RETURNN reads, features and all.
                self.ds.init_seq_order(epoch=1)
                self._args = None  # the reader sets up the epoch it serves again
                self._templates = templates_of(self.ds)
                if self.audio_in_workers:  # sub-epoch processes started here compute features: not those
                    self.ds.finish_epoch(free_resources=True)
            self._keys = list(self._templates)
        return {k: dict(v) for k, v in self._templates.items()}

    @property
    def total_num_seqs(self) -> Optional[int]:  # type: ignore[override]
        """The corpus size if RETURNN tells it and an epoch is all of it (no partition_epoch)."""
        if getattr(self.ds, "partition_epoch", 1) != 1:
            return None
        try:
            return int(self.ds.get_total_num_seqs())
        except Exception:
            return None

    # ---- epochs -----------------------------------------------------------------------------
    def check_epoch_args(
        self, epoch: int, seq_list: Optional[List[str]] = None, seq_order: Optional[List[int]] = None
    ) -> None:
        if not is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if seq_list is not None and seq_order is not None:
            raise ValueError("give at most one of seq_list and seq_order")
        if seq_list is not None:
            tags = self._tags()
            if tags is not None:
                for tag in seq_list:
                    if tag not in tags:
                        raise UnknownSeqTagError(f"unknown seq tag {tag!r}")
        if seq_order is not None:
            n = self._corpus_size()
            for idx in seq_order:
                if not is_int(idx) or idx < 0:
                    raise ValueError(f"seq_order entry {idx!r} is not a corpus index")
                if n is not None and idx >= n:
                    raise ValueError(f"seq_order entry {idx!r} out of range [0, {n})")

    def _corpus_size(self) -> Optional[int]:
        """The seqs of the whole corpus (all parts of a partition_epoch), which seq_order indexes;
        None if the dataset cannot tell (init_seq_order or the reading then fails instead)."""
        if self._corpus is None:
            try:
                self._corpus = int(self.ds.get_total_num_seqs())
            except Exception:
                self._corpus = -1
        return None if self._corpus < 0 else self._corpus

    def _tags(self) -> Optional[set]:
        if self._all_tags is None:
            try:
                self._all_tags = set(self.ds.get_all_tags())
            except Exception:
                return None  # the dataset cannot list them: init_seq_order checks
        return self._all_tags

    def init_seq_order(
        self, epoch: int, seq_list: Optional[List[str]] = None, seq_order: Optional[List[int]] = None
    ) -> None:
        self.check_epoch_args(epoch, seq_list, seq_order)
        self._setup((int(epoch), seq_list, seq_order))

    def _setup(self, args: tuple) -> None:
        """A new epoch: the seqs cached and the end found belong to the one before and are dropped."""
        self._start_pass(args)
        self._end = None
        self._cache = {}
        self._cached = 0

    def _start_pass(self, args: tuple) -> None:
        """Set the wrapped dataset's epoch up and read it from its start again. The cache and the end
        found are not touched: a rewind reads the same epoch, so they stay valid."""
        epoch, seq_list, seq_order = args
        with self._reading():  # a DistributeFilesDataset starts its sub-epochs' processes
            self.ds.init_seq_order(epoch=epoch, seq_list=seq_list, seq_order=seq_order)
        if not self._keys:
            self.data_keys()
        self._args = args
        self._epoch = epoch
        self._cursor = 0
        try:
            self._count = int(self.ds.num_seqs)
        except NotImplementedError:
            self._count = None

    def _require_args(self) -> tuple:
        if self._args is None:
            raise RuntimeError("init_seq_order() has not been called")
        return self._args

    @property
    def num_seqs(self) -> Optional[int]:  # type: ignore[override]
        """The epoch's count, or None when the dataset learns it only by reading (then the reader
        asks is_less_than_num_seqs)."""
        self._require_args()
        return self._count

    @property
    def order(self) -> List[int]:
        raise NotImplementedError("a RETURNN dataset's order is its own")

    def _reading(self) -> ContextManager[None]:
        """The dataset's calls that may read seqs: an OggZipDataset's audio leaves them encoded, for
        the workers (returnn_audio.py), unless audio_in_workers is off."""
        return returnn_audio.reading() if self.audio_in_workers else nullcontext()

    def is_less_than_num_seqs(self, n: int) -> bool:
        with self._reading():
            return self._is_less_than_num_seqs(n)

    def _is_less_than_num_seqs(self, n: int) -> bool:
        self._require_args()
        if self._count is not None:
            return n < self._count
        if self._end is not None and n >= self._end:
            return False  # once the end is found it stays (a dataset asked again may answer otherwise)
        if n in self._cache or (not self.random_access and n < self._cursor):
            return True
        if not self.random_access and n > self._cursor and not self._skip_to(n):
            self._end = self._cursor  # the epoch ended on the way
            return False
        if not self.ds.is_less_than_num_seqs(n):
            self._end = n
            return False
        return True

    def epoch_lengths(self, key: str) -> Optional[Any]:
        """The lengths of `key` in the epoch, where RETURNN knows them before the seqs are read (a
        CachedDataset such as HDFDataset, with its count); else None (the batches are cut as the
        reader reads)."""
        self._require_args()
        if not self.random_access or self._count is None:
            return None
        import numpy

        try:
            return numpy.fromiter(
                (int(self.ds.get_seq_length(i)[key]) for i in range(self._count)), numpy.int64, self._count
            )
        except Exception:  # (not known before reading, after all)
            return None

    def get_seq(self, pos: int) -> Dict[str, Any]:
        with self._reading():
            return self._get_seq(pos)

    def _get_seq(self, pos: int) -> Dict[str, Any]:
        self._require_args()
        if not is_int(pos) or pos < 0 or (self._count is not None and pos >= self._count):
            raise IndexError(f"seq position {pos!r} out of range [0, {self._count})")
        pos = int(pos)
        if self._end is not None and pos >= self._end:
            raise IndexError(f"seq position {pos} is past the end of the epoch ({self._end} seqs)")
        if self.random_access:
            return self._read(pos)
        seq = self._cache.pop(pos, None)
        if seq is not None:
            self._cached -= _nbytes(seq)
            return seq
        if pos < self._cursor:
            self._rewind(pos)
        if not self._skip_to(pos):
            raise IndexError(f"seq position {pos} is past the end of the epoch ({self._cursor} seqs)")
        seq = self._read(pos)
        self._cursor = pos + 1
        return seq

    def _skip_to(self, pos: int) -> bool:
        """Read forward up to (not including) `pos`, keeping what fits in the cache; False if the
        epoch ends before."""
        while self._cursor < pos:
            i = self._cursor
            if self._count is None and not self.ds.is_less_than_num_seqs(i):
                return False
            seq = self._read(i)
            self._cursor = i + 1
            size = _nbytes(seq)
            if i not in self._cache and self._cached + size <= self.cache_bytes:
                self._cache[i] = seq
                self._cached += size
        return True

    def _rewind(self, pos: int) -> None:
        """Set the epoch up again to reach `pos`, which a forward-only dataset has passed and the cache
        does not hold; what the cache holds is kept, as the epoch read again is the same."""
        self.rewinds += 1
        log.warning(
            "re-reading epoch %s from its start to reach seq %d again: %s reads forward only and the seq is no "
            "longer cached (cache_mb %.0f); %d such re-reads so far",
            self._epoch,
            pos,
            type(self.ds).__name__,
            self.cache_bytes / (1 << 20),
            self.rewinds,
        )
        self._start_pass(self._require_args())

    def _read(self, i: int) -> Dict[str, Any]:
        """Seq `i` of the epoch as PostprocessingDataset reads it; complete_frac rounded to float32 as
        RETURNN passes it on."""
        ds = self.ds
        if self._count is None and not ds.is_less_than_num_seqs(i):
            raise IndexError(f"seq position {i} is past the end of the epoch")
        ds.load_seqs(i, i + 1)
        seq: Dict[str, Any] = {}
        for key in self._keys:
            value = ds.get_data(i, key)
            seq[key] = np.array(value, copy=True) if self._copy else np.asarray(value)
        seq["seq_tag"] = str(ds.get_tag(i))
        seq["seq_idx"] = i
        frac = ds.get_complete_frac(i, allow_only_lr_suitable=True)
        if frac is None:
            try:
                frac = ds.get_complete_frac(i)  # the dataset's own estimate
            except Exception:
                frac = None
        if frac is not None:
            seq["complete_frac"] = float(np.float32(frac))
        return seq
