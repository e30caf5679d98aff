"""HDFDataset: the HDF files RETURNN's SimpleHDFWriter writes, read with h5py.

The layout: ``inputs`` (the frames of key "data" of all seqs, one after the other),
``seqLengths`` (one row per seq: the inputs' length, then one per target key in sorted order;
old files have one length for all), ``seqTags``, ``targets/data/<key>``, ``targets/size``
(attrs ``key: (dim, ndim)`` or just dim) and ``targets/labels/<key>``. The seqs, keys, dtypes,
dims and sort lengths are those of RETURNN's HDFDataset for the same files; h5py is imported
only when such a dataset is built.
"""

from __future__ import annotations

import bisect
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ppserver.datasets.base import Dataset
from ppserver.errors import ConfigError, one_line
from ppserver.mappers.apply import STRING, dtype_text

if TYPE_CHECKING:
    import h5py

__all__ = ["HDFDataset"]


def _decode(text: Any) -> str:
    """A tag or label as RETURNN reads it: utf-8, cut at the first NUL (fixed-size strings pad with them)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return str(text).split("\0")[0]


def _import_h5py() -> Any:
    """h5py, imported only when an HDFDataset is built: other configs do not need it installed."""
    try:
        import h5py
    except ImportError:
        raise ConfigError("dataset", "HDFDataset needs h5py: pip install 'ppserver[hdf]'") from None
    return h5py


class _File:
    """One open file: its h5py datasets per served key and where each seq starts in every column."""

    def __init__(self, path: str, h5: h5py.File, starts: np.ndarray, columns: Dict[str, Tuple[Any, int]]):
        self.path = path
        self.h5 = h5
        self.starts = starts  # (num_seqs + 1, num_columns) int64: cumulative seqLengths
        self.columns = columns  # served key -> (h5py dataset, seqLengths column)
        self.tags = h5["seqTags"]  # h5py looks names up slowly: keep the dataset objects

    @property
    def num_seqs(self) -> int:
        return len(self.starts) - 1


class _Meta:
    """What one file says about the keys; every file of a dataset must say the same."""

    def __init__(self, h5: h5py.File):
        self.has_inputs = "inputs" in h5
        self.has_targets = "targets" in h5
        if self.has_targets:
            self.target_keys = sorted(set(h5["targets/data"].keys()) | set(h5["targets/size"].attrs.keys()))
        else:
            # RETURNN counts a column for a dummy "classes" target that it never serves.
            self.target_keys = ["classes"]
        self.num_outputs: Dict[str, Tuple[int, int]] = {}  # key -> (dim, ndim), RETURNN's num_outputs
        self.datasets: Dict[str, Any] = {}  # key -> h5py dataset
        if self.has_targets:
            for key in self.target_keys:
                if key not in h5["targets/data"]:
                    raise ValueError(f"targets/size names {key!r}, but there is no targets/data/{key}")
                self.datasets[key] = h5["targets/data"][key]
            sizes = h5["targets/size"].attrs
            for key, ds in self.datasets.items():
                if key not in sizes:
                    self.num_outputs[key] = (1 if ds.ndim == 1 else int(ds.shape[-1]), ds.ndim)
                elif np.isscalar(sizes[key]):
                    self.num_outputs[key] = (int(sizes[key]), ds.ndim)
                else:
                    dim, ndim = (int(v) for v in np.asarray(sizes[key]).reshape(-1)[:2])
                    self.num_outputs[key] = (dim, ndim)
        if self.has_inputs:
            if "data" in self.datasets:
                raise ValueError("has both 'inputs' and a target named 'data'")
            inputs = h5["inputs"]
            if inputs.ndim == 1:  # sparse: the dim is in an attribute
                self.num_outputs["data"] = (int(h5.attrs["inputPattSize"]), 1)
            else:
                self.num_outputs["data"] = (int(inputs.shape[1]), inputs.ndim)
            self.datasets = {"data": inputs, **self.datasets}
        self.labels: Dict[str, List[str]] = {}
        if self.has_targets and "targets/labels" in h5:
            for key in h5["targets/labels"]:
                self.labels[key] = [_decode(x) for x in h5["targets/labels"][key][...].tolist()]
        if self.has_inputs and "labels" in h5:
            self.labels["data"] = [_decode(x) for x in h5["labels"][...].tolist()]

    def served(self) -> List[str]:
        """RETURNN's get_data_keys(): "data" if there are inputs of dim > 0, then the targets."""
        keys = ["data"] if self.has_inputs and self.num_outputs["data"][0] > 0 else []
        return keys + (list(self.target_keys) if self.has_targets else [])

    def signature(self, keys: List[str]) -> Dict[str, tuple]:
        """Per key what must agree across files: dims, dtype and the shape after the time axis."""
        return {k: (self.num_outputs[k], str(self.datasets[k].dtype), self.datasets[k].shape[1:]) for k in keys}


class HDFDataset(Dataset):
    """Seqs from one or more RETURNN HDF files, concatenated in the order given.

    Keys: "data" (the inputs) and the sorted target keys. The sort length of the orderings is
    column 0 of seqLengths: the inputs' length, or that of the first target key if there are
    no inputs. `ordering`: the options of Dataset (seq_ordering, order_seed, partition_epoch,
    fixed_random_seed). The files stay open read-only; h5py serialises access to them, so any
    one thread may read after another one built the dataset.
    """

    def __init__(self, *, files: List[Union[str, os.PathLike]], **ordering: Any):
        super().__init__(**ordering)
        h5py = _import_h5py()
        if isinstance(files, (str, os.PathLike)) or not isinstance(files, (list, tuple)) or not files:
            raise ConfigError("files", f"must be a non-empty list of HDF file paths, got {files!r}")
        self.files: List[str] = []
        self._files: List[_File] = []
        self._file_start = [0]  # corpus index of each file's first seq, then the total
        self._meta: Optional[_Meta] = None
        self._keys: List[str] = []
        for path in files:
            if not isinstance(path, (str, os.PathLike)):
                raise ConfigError("files", f"entries must be file paths, got {path!r}")
            self._add_file(h5py, os.fspath(path))
        if self._file_start[-1] == 0:
            raise ConfigError("files", f"no seqs in {', '.join(map(repr, self.files))}")
        self._seq_lens_cache = np.concatenate([np.diff(f.starts[:, 0]) for f in self._files]).astype(np.int64)

    def data_files(self) -> List[str]:
        return list(self.files)

    def _add_file(self, h5py_module: Any, path: str) -> None:
        try:
            h5 = h5py_module.File(path, "r")
        except Exception as exc:
            raise ConfigError("files", f"cannot open HDF file {path!r}: {one_line(exc)}") from None
        try:
            self._files.append(self._parse(h5))
        except ConfigError:
            h5.close()
            raise
        except Exception as exc:
            h5.close()
            raise ConfigError("files", f"{path!r} is not a RETURNN HDF file: {one_line(exc)}") from None
        self.files.append(path)
        self._file_start.append(self._file_start[-1] + self._files[-1].num_seqs)

    def _parse(self, h5: h5py.File) -> _File:
        meta = _Meta(h5)
        lens = np.asarray(h5["seqLengths"][...])
        num_columns = int(meta.has_inputs) + len(meta.target_keys)
        if lens.ndim == 1:  # old files: one length for every key
            lens = np.repeat(lens[:, None], num_columns, axis=1)
        if lens.ndim != 2 or lens.shape[1] != num_columns:
            raise ValueError(f"seqLengths has shape {lens.shape}, expected (num_seqs, {num_columns})")
        if len(h5["seqTags"]) != len(lens):
            raise ValueError(f"{len(h5['seqTags'])} seqTags but {len(lens)} rows of seqLengths")
        first = self._meta
        if first is None:
            self._meta, self._keys = meta, meta.served()
        else:
            if (meta.has_inputs, meta.has_targets) != (first.has_inputs, first.has_targets):
                raise self._mismatch(h5, "inputs/targets present", first.served(), meta.served())
            # As RETURNN: later files may have more targets, only the first file's are served.
            missing = [k for k in first.target_keys if k not in meta.target_keys]
            if missing:
                raise self._mismatch(h5, "target keys", first.target_keys, meta.target_keys)
            offset = int(meta.has_inputs)
            keep = list(range(offset)) + [offset + meta.target_keys.index(k) for k in first.target_keys]
            lens = lens[:, keep]
            want, got = first.signature(self._keys), meta.signature(self._keys)
            if want != got:
                raise self._mismatch(h5, "keys' (dim, ndim), dtype, feature shape", want, got)
        starts = np.zeros((len(lens) + 1, lens.shape[1]), dtype=np.int64)
        np.cumsum(lens, axis=0, dtype=np.int64, out=starts[1:])
        target_keys = (first or meta).target_keys
        columns = {}
        for key in self._keys:
            col = 0 if key == "data" and meta.has_inputs else int(meta.has_inputs) + target_keys.index(key)
            ds = meta.datasets[key]
            if starts[-1, col] > ds.shape[0]:
                raise ValueError(f"seqLengths add up to {starts[-1, col]} frames of {key!r}, it has {ds.shape[0]}")
            columns[key] = (ds, col)
        return _File(h5.filename, h5, starts, columns)

    @staticmethod
    def _mismatch(h5: h5py.File, what: str, want: Any, got: Any) -> ConfigError:
        return ConfigError("files", f"{h5.filename!r} differs from the first file in its {what}: {got}, not {want}")

    def _locate(self, corpus_idx: int) -> Tuple[_File, int]:
        f = bisect.bisect_right(self._file_start, corpus_idx) - 1
        return self._files[f], corpus_idx - self._file_start[f]

    # ---- hooks -------------------------------------------------------------------------------

    def _num_corpus_seqs(self) -> int:
        return self._file_start[-1]

    def _load(self, corpus_idx: int) -> Dict[str, np.ndarray]:
        f, j = self._locate(corpus_idx)
        begin, end = f.starts[j], f.starts[j + 1]
        out = {}
        for key, (ds, col) in f.columns.items():
            arr = ds[begin[col] : end[col]]
            if arr.dtype.hasobject:  # variable-length strings: h5py gives bytes objects, the wire wants str
                arr = np.array([_decode(x) for x in arr.reshape(-1)], dtype=str).reshape(arr.shape)
            out[key] = arr
        return out

    def _tag(self, corpus_idx: int) -> str:
        f, j = self._locate(corpus_idx)
        return _decode(f.tags[j])

    def _seq_len(self, corpus_idx: int) -> int:
        return int(self.seq_lens()[corpus_idx])

    def _key_lens(self, key: str) -> Optional[np.ndarray]:
        if key not in self._keys:
            return None
        parts = []
        for f in self._files:
            col = f.columns[key][1]
            parts.append(np.diff(f.starts[:, col]))
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def _corpus_idx_for_tag(self, tag: str) -> Optional[int]:
        if self._tag_index is None:
            index: Dict[str, int] = {}
            for f, start in zip(self._files, self._file_start):
                for j, raw in enumerate(f.tags[...].tolist()):
                    index[_decode(raw)] = start + j
            self._tag_index = index
        return self._tag_index.get(tag)

    def _compute_data_keys(self) -> Dict[str, Dict[str, Any]]:
        meta = self._meta
        assert meta is not None
        out: Dict[str, Dict[str, Any]] = {}
        for key in self._keys:
            ds = meta.datasets[key]
            dim, ndim = meta.num_outputs[key]
            if ds.dtype.hasobject:
                out[key] = {"shape": [None, *ds.shape[1:]], "dtype": STRING}
                continue
            dtype = np.dtype(ds.dtype).newbyteorder("=")
            entry: Dict[str, Any] = {"shape": [None, *ds.shape[1:]], "dtype": dtype_text(dtype)}
            # RETURNN's is_data_sparse: an integer dtype and at most one axis (the time axis).
            if dtype.kind in "iu" and ndim <= 1:
                entry["sparse_dim"] = dim
                labels = meta.labels.get(key)
                if labels is not None and len(labels) == dim:
                    entry["labels"] = labels
            out[key] = entry
        return out
