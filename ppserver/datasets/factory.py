"""A dataset from its config entry: ``{"class": NAME, **kwargs}``, NAME built in (loaded only when
a config names it, for those with optional dependencies) or 'package.module:Name'."""

from __future__ import annotations

import importlib
from typing import Any, Dict, Type

from ppserver.datasets.arrays import NumpyDataset
from ppserver.datasets.base import Dataset
from ppserver.datasets.demo import DemoDataset
from ppserver.errors import ConfigError, one_line

BUILTIN_DATASETS: Dict[str, Type[Dataset]] = {"NumpyDataset": NumpyDataset, "DemoDataset": DemoDataset}
# Built-in classes in modules of their own, imported only when a config names them (their
# optional dependencies, h5py, RETURNN, lhotse and datasets, are needed only then).
LAZY_DATASETS = {
    "HDFDataset": "ppserver.datasets.hdf:HDFDataset",
    "returnn": "ppserver.datasets.returnn:ReturnnDataset",
    "AudioManifest": "ppserver.datasets.nemo:AudioManifest",
    "LhotseCuts": "ppserver.datasets.lhotse_cuts:LhotseCuts",
    "HFAudio": "ppserver.datasets.hf:HFAudio",
}


def _import_class(name: str) -> Any:
    module_name, _, attr_path = name.partition(":")
    if not module_name or not attr_path:
        raise ConfigError("dataset", f"cannot import class {name!r}: expected 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except Exception as exc:
        raise ConfigError("dataset", f"cannot import class {name!r}: {one_line(exc)}") from None
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
        raise ConfigError("dataset", f"{cls.__name__}: {one_line(exc)}") from None
