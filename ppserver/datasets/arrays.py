"""Datasets of arrays in memory: NumpyDataset, from a list of seqs or an npz file (save_npz and
load_npz read and write its layout)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import numpy as np

from ppclient.wire import META_KEYS
from ppserver.datasets.base import Dataset, describe_arrays, length_key_of, same_dtype
from ppserver.errors import ConfigError

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
            len_key = length_key_of(arrays)
            if arrays[len_key].ndim < 1:
                raise ConfigError("seqs", f"key {len_key!r} defines the seq length and must have ndim >= 1")
        elif sig.keys() != ref.keys():
            raise ConfigError("seqs", f"seq {i} has keys {sorted(sig)}, expected {sorted(ref)}")
        else:
            for k, (dt, nd) in sig.items():
                if nd != ref[k][1] or not same_dtype(dt, ref[k][0]):
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
        self._files: List[str] = []
        if path is not None:
            if not isinstance(path, (str, os.PathLike)):
                raise ConfigError("path", f"must be a file path, got {type(path).__name__}")
            seqs, file_tags = load_npz(path)
            self._files.append(os.fspath(path))
        self._seqs = _validate_seqs(seqs)
        n = len(self._seqs)
        if tags is None:
            tags = file_tags
        self._tags = [f"seq-{i}" for i in range(n)] if tags is None else _validate_tags(tags, n)
        self._len_key = length_key_of(self._seqs[0])
        self._views = [{k: _read_only(a) for k, a in seq.items()} for seq in self._seqs]

    def _num_corpus_seqs(self) -> int:
        return len(self._seqs)

    def data_files(self) -> List[str]:
        return list(self._files)  # inline seqs are the dataset dict's, covered by the config fingerprint

    def _load(self, corpus_idx: int) -> Dict[str, np.ndarray]:
        # Read-only views: the server sends them without copying, and nothing may change the corpus
        # (get_seq copies the dict before it adds the meta entries)
        return self._views[corpus_idx]

    def _tag(self, corpus_idx: int) -> str:
        return self._tags[corpus_idx]

    def _seq_len(self, corpus_idx: int) -> int:
        return int(self._seqs[corpus_idx][self._len_key].shape[0])

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        return describe_arrays(self._seqs)

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        if key not in self._seqs[0]:
            return None
        if key == self._len_key:
            return self.seq_lens()  # computed once
        return np.fromiter(
            (seq[key].shape[0] if seq[key].ndim else 1 for seq in self._seqs), dtype=np.int64, count=len(self._seqs)
        )


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view
