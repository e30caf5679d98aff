"""The mappers of a config as the runners call them (seq dicts in, seq dicts out), and the
templates their outputs are checked against.

With ``mapper_api = "dict"`` (the default) they are the config's own functions; with
``"returnn"`` they are wrapped to take and return RETURNN TensorDicts (mappers/returnn.py),
which needs the input templates the server sends. The rng of a stream partition follows
the API: ppserver's own seeding, or PostprocessingDataset's for RETURNN mappers. A RETURNN
dataset's audio that left the reader encoded becomes its features before the mappers see
the seq (datasets/returnn_audio.py).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import numpy

from ppserver.config.settings import Config
from ppserver.errors import ConfigError
from ppserver.mappers.apply import TemplateMismatch, partition_rng
from ppserver.mappers.outputs import Templates, Undeclared, declared_outputs, mapper_name


@dataclass(frozen=True)
class Mappers:
    map_seq: Optional[Callable]
    map_seq_stream: Optional[Callable]
    api: str
    seed: int
    partitions: int

    def stream_rng(self, epoch: int, partition: int) -> numpy.random.RandomState:
        if self.api == "returnn":
            from ppserver.mappers.returnn import stream_seed

            return numpy.random.RandomState(stream_seed(self.seed, epoch, partition, self.partitions))
        return partition_rng(self.seed, epoch, partition)


def mappers_for(cfg: Config, in_templates: Dict[str, Any]) -> Mappers:
    map_seq, map_seq_stream = cfg.map_seq, cfg.map_seq_stream
    if cfg.mapper_api == "returnn":
        from ppserver.mappers.returnn import dict_mappers

        map_seq, map_seq_stream = dict_mappers(map_seq, map_seq_stream, in_templates)
    if _audio_in_workers(cfg.dataset):
        map_seq, map_seq_stream = _after_features(map_seq), _stream_after_features(map_seq_stream)
    return Mappers(map_seq, map_seq_stream, cfg.mapper_api, cfg.seed, cfg.partitions)


def failure_hint(cfg: Config, what: str, exc: BaseException) -> str:
    """What may be missing from the config, for the failure `exc` of its `what` ("" if nothing)."""
    return missing_returnn_api_hint(cfg, what, exc) or missing_map_outputs_hint(cfg, exc)


def missing_map_outputs_hint(cfg: Config, exc: BaseException) -> str:
    """An output that does not fit the templates where the config sets no map_outputs: they are the
    dataset's keys, or what its mappers declare, which a mapper that changes keys must say."""
    if not isinstance(exc, TemplateMismatch) or cfg.map_outputs is not None:
        return ""
    return (
        " (map_outputs is not set: outputs are checked against the dataset's keys, or what the mappers declare;"
        " set map_outputs to what the mapper returns)"
    )


def _audio_in_workers(dataset: Dict[str, Any]) -> bool:
    return dataset.get("class") == "returnn" and dataset.get("audio_in_workers", True) is True


def _after_features(map_seq: Optional[Callable]) -> Optional[Callable]:
    if map_seq is None:
        return None
    from ppserver.datasets.returnn_audio import with_features

    def mapped(seq: Dict[str, Any], **kwargs: Any) -> Any:
        return map_seq(with_features(seq), **kwargs)

    return mapped


def _stream_after_features(map_seq_stream: Optional[Callable]) -> Optional[Callable]:
    if map_seq_stream is None:
        return None
    from ppserver.datasets.returnn_audio import with_features

    def mapped(seqs: Any, **kwargs: Any) -> Any:
        return map_seq_stream((with_features(s) for s in seqs), **kwargs)

    return mapped


def missing_returnn_api_hint(cfg: Config, what: str, exc: BaseException) -> str:
    """A hint for the failure `exc` of the config's `what` ("map_seq" or "map_seq_stream") when it
    looks written for RETURNN's TensorDicts but runs with mapper_api "dict" (the default), so it
    got seq dicts: it failed reaching into a dict for an attribute (`tdict.data`), returned a
    TensorDict, or its code names TensorDict (an annotation, an isinstance check) or comes from
    RETURNN (Sequential, LaplaceOrdering). "" otherwise."""
    fn = getattr(cfg, what, None)
    if cfg.mapper_api != "dict" or fn is None:
        return ""
    dict_attribute = isinstance(exc, AttributeError) and "'dict' object has no attribute" in str(exc)
    if not (dict_attribute or "got TensorDict" in str(exc) or _names_tensor_dict(fn)):
        return ""
    return f" (is mapper_api = 'returnn' missing? This {what} looks written for RETURNN TensorDicts but gets dicts)"


def _names_tensor_dict(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    if type(fn).__module__.startswith("returnn."):
        return True  # an object of RETURNN's (Sequential, LaplaceOrdering, ...)
    call = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn).__call__  # a callable object's method
    code = getattr(call, "__code__", None)
    if code is not None and "TensorDict" in code.co_names + code.co_freevars:
        return True  # isinstance(x, TensorDict), TensorDict(...), an import inside the function
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    annotation = params[0].annotation if params else inspect.Parameter.empty
    return annotation is not inspect.Parameter.empty and "TensorDict" in (
        annotation if isinstance(annotation, str) else repr(annotation)
    )


def output_templates(cfg: Config, inputs: Templates) -> Templates:
    """The templates the config's outputs are checked against (and the client is told of), for
    seqs of `inputs` (the dataset's keys); ConfigError, one line, naming `map_outputs` where it is
    required and missing, or naming the mapper whose declaration refuses the dataset's keys."""
    if cfg.map_outputs is not None:
        return cfg.map_outputs
    key, mapper = ("map_seq", cfg.map_seq) if cfg.map_seq is not None else ("map_seq_stream", cfg.map_seq_stream)
    if mapper is None or cfg.mapper_api != "dict":
        return inputs
    try:
        declared = declared_outputs(mapper, inputs)
    except Undeclared as exc:
        raise ConfigError(
            "map_outputs",
            f"needed: {mapper_name(exc.mapper)} declares no outputs and comes after {mapper_name(exc.changed)}, which "
            "changes the dataset's keys; set map_outputs to what the mapper returns",
        ) from None
    except (KeyError, ValueError) as exc:
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
        raise ConfigError(key, " ".join(text.split()) or type(exc).__name__) from None
    return inputs if declared is None else declared
