"""``mapper_api = "returnn"``: mappers written for RETURNN's PostprocessingDataset, unchanged.

Such a ``map_seq(tdict, *, epoch, seq_idx, rng, **kwargs)`` or ``map_seq_stream(tdicts, *,
epoch, rng, **kwargs)`` takes and returns RETURNN ``TensorDict``s. Each worker builds the
input TensorDicts as PostprocessingDataset does (one ``Tensor`` per data key: a
``<key>_frame`` time dim, ``<key>_dim<i>`` feature dims, a ``<key>_sparse`` sparse dim
with the dataset's vocabulary; then ``complete_frac`` float32, ``seq_idx`` int32 and
``seq_tag`` string scalars) and turns the returned ones back into seq dicts, so
everything else (dispatch, validation, the wire) stays as for plain dict mappers.

``map_outputs`` is in RETURNN's form too: each entry holds the keyword arguments of a
``Tensor`` (``{"dims": [...], "dtype": ...}``, or ``{"shape": (None, 80), ...}``).
RETURNN is imported only here, only in processes whose config asks for this API.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional

import numpy as np

from ppserver.errors import ConfigError
from ppserver.mappers.apply import STRING, MappingError, dtype_text

Templates = Dict[str, Dict[str, Any]]

_META_TEMPLATES = {
    "complete_frac": {"dims": (), "dtype": "float32"},
    "seq_idx": {"dims": (), "dtype": "int32"},
    "seq_tag": {"dims": (), "dtype": "string"},
}


def _returnn_tensor() -> Any:
    try:
        from returnn.tensor import Dim, Tensor, TensorDict
    except ImportError as exc:
        raise ConfigError("mapper_api", f"'returnn' needs RETURNN: pip install 'ppserver[returnn]' ({exc})") from None
    return Dim, Tensor, TensorDict


def require_returnn() -> None:
    """Fail at config load, not at the first seq, where RETURNN is missing."""
    _returnn_tensor()


def _tensor(key: str, tpl: Dict[str, Any]) -> Any:
    """The input Tensor template PostprocessingDataset makes for data key `key`."""
    Dim, Tensor, _ = _returnn_tensor()
    shape = tpl["shape"]
    dims = []
    if shape:
        dims = [Dim(dimension=None, name=f"{key}_frame")]
        dims += [Dim(dimension=d, name=f"{key}_dim{i + 1}") for i, d in enumerate(shape[1:])]
    sparse_dim = None
    if tpl.get("sparse_dim") is not None:
        sparse_dim = Dim(dimension=int(tpl["sparse_dim"]), name=f"{key}_sparse")
        labels = tpl.get("labels")
        if labels and len(labels) == sparse_dim.dimension:
            from returnn.datasets.util.vocabulary import Vocabulary

            sparse_dim.vocab = Vocabulary.create_vocab_from_labels(list(labels))
    return Tensor(key, dims=dims, dtype=tpl["dtype"], sparse_dim=sparse_dim)


def out_templates(map_outputs: Dict[str, Any]) -> Templates:
    """Templates from RETURNN-form map_outputs, built into Tensors as PostprocessingDataset builds them."""
    _, Tensor, _ = _returnn_tensor()
    if not isinstance(map_outputs, dict) or not map_outputs:
        raise ConfigError("map_outputs", "must be a non-empty dict {key: Tensor keyword arguments}")
    out: Templates = {}
    for key, spec in map_outputs.items():
        if not isinstance(key, str) or not isinstance(spec, dict):
            raise ConfigError("map_outputs", f"entry {key!r} must map a str key to a dict of Tensor arguments")
        kwargs = dict(spec)
        if "shape" in kwargs and "batch_dim_axis" not in kwargs:
            kwargs["batch_dim_axis"] = None
        kwargs.setdefault("name", key)
        try:
            t = Tensor(**kwargs)
        except Exception as exc:
            text = " ".join(str(exc).split())
            raise ConfigError("map_outputs", f"{key!r}: not a RETURNN Tensor: {type(exc).__name__}: {text}") from None
        if t.batch_dim_axis is not None:
            raise ConfigError("map_outputs", f"{key!r}: a seq has no batch dim (set batch_dim_axis=None)")
        tpl: Dict[str, Any] = {
            "shape": [d.dimension for d in t.dims],
            "dtype": STRING if t.dtype == STRING else dtype_text(np.dtype(t.dtype)),
        }
        if t.sparse_dim is not None and t.sparse_dim.dimension is not None:
            tpl["sparse_dim"] = int(t.sparse_dim.dimension)
            if t.vocab is not None and len(t.vocab.labels) == tpl["sparse_dim"]:
                tpl["labels"] = [str(label) for label in t.vocab.labels]
        out[key] = tpl
    return out


class TensorDicts:
    """Seq dicts <-> the TensorDicts RETURNN mappers see, for one set of input templates."""

    def __init__(self, in_templates: Templates):
        _, _, TensorDict = _returnn_tensor()
        self.keys = list(in_templates)
        self.template = TensorDict({k: _tensor(k, t) for k, t in in_templates.items()})
        self.template.update(_META_TEMPLATES, auto_convert=True)
        self._TensorDict = TensorDict

    def to_tdict(self, seq: Dict[str, Any]) -> Any:
        td = self.template.copy_template()
        for key in self.keys:
            td.data[key].raw_tensor = seq[key]
        if seq.get("complete_frac") is not None:
            td.data["complete_frac"].raw_tensor = np.array(seq["complete_frac"], dtype=np.float32)
        td.data["seq_idx"].raw_tensor = np.array(seq["seq_idx"], dtype=np.int32)
        td.data["seq_tag"].raw_tensor = np.array(str(seq["seq_tag"]))
        return td

    def to_seq(self, td: Any, what: str) -> Dict[str, Any]:
        if not isinstance(td, self._TensorDict):
            raise MappingError(f"{what} must produce a TensorDict, got {type(td).__name__}")
        seq: Dict[str, Any] = {}
        for key, t in td.data.items():
            raw = t.raw_tensor
            if key == "complete_frac":
                if raw is not None:
                    seq[key] = float(raw)
            elif key == "seq_idx":
                seq[key] = int(raw)
            elif key == "seq_tag":
                seq[key] = str(raw)
            elif raw is None:
                raise MappingError(f"output {key!r} has no raw_tensor")
            else:
                seq[key] = raw
        return seq


def wrap_map_seq(fn: Callable, in_templates: Templates) -> Callable:
    """A dict-API map_seq running the RETURNN-API `fn` (None, a skipped seq, stays None)."""
    conv = TensorDicts(in_templates)

    def map_seq(seq: Dict[str, Any], *, epoch: int, seq_idx: int, rng: Any, **kwargs: Any) -> Optional[Dict[str, Any]]:
        out = fn(conv.to_tdict(seq), epoch=epoch, seq_idx=seq_idx, rng=rng, **kwargs)
        return None if out is None else conv.to_seq(out, "map_seq")

    return map_seq


def wrap_map_seq_stream(fn: Callable, in_templates: Templates) -> Callable:
    """A dict-API map_seq_stream running the RETURNN-API `fn`."""
    conv = TensorDicts(in_templates)

    def map_seq_stream(seqs: Iterator[Dict[str, Any]], *, epoch: int, rng: Any, **kwargs: Any) -> Iterator[Any]:
        out = fn((conv.to_tdict(s) for s in seqs), epoch=epoch, rng=rng, **kwargs)
        if not isinstance(out, Iterator):
            raise MappingError(f"map_seq_stream must return an iterator, got {type(out).__name__}")
        return (conv.to_seq(td, "map_seq_stream") for td in out)

    return map_seq_stream


def stream_seed(seed: int, epoch: int, partition: int, partitions: int) -> int:
    """RandomState seed of a partition as PostprocessingDataset seeds its workers: one partition is
    num_workers=0 (the epoch's seed), P > 1 partitions are num_workers=P (worker i has partition i:
    both deal seq k to k mod P). The epoch's seed is RETURNN's, `seed` its random_seed_offset."""
    epoch_seed = (epoch or 1) + seed
    if partitions == 1:
        return epoch_seed
    return (epoch_seed * 683859 * partitions + 30411 * partition) % (2**32 - 1)


def dict_mappers(map_seq: Optional[Callable], map_seq_stream: Optional[Callable], in_templates: Templates) -> Any:
    return (
        None if map_seq is None else wrap_map_seq(map_seq, in_templates),
        None if map_seq_stream is None else wrap_map_seq_stream(map_seq_stream, in_templates),
    )
