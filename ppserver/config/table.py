"""The settings, each declared once: the `Config` dataclass is their table.

Every setting is one field of `Config`, written as `setting(default, check, doc)`: its name
and type (the field's), its default, the check that turns the value a config gives into the
value served (or raises a one-line ConfigError naming the key), and a short doc.
`settings.from_settings` runs the checks in this order, each seeing the values checked before
it, so a setting that depends on another (stream_partitions on map_seq_stream) says so in its
own check. The scheduler, which imports no config, repeats four of these defaults in its
`Settings`; tests/test_config.py checks that they agree, and docs/config.md's table against
`SETTINGS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy

from ppclient import wire
from ppclient.batching import Batching
from ppclient.errors import UsageError
from ppserver.errors import ConfigError
from ppserver.mappers.apply import STRING, dtype_text

# A check: (key, value given or default, the settings checked before) -> the value served.
Check = Callable[[str, Any, Dict[str, Any]], Any]

MAPPER_APIS = ("dict", "returnn")
AUTO = "auto"  # num_workers: the server sizes its pool (ppserver/scheduler/elastic.py)
MAX_SHM_MB = 4096  # a segment per worker and direction; more buys nothing and risks the host's memory


@dataclass(frozen=True)
class Setting:
    key: str  # the name in the config file
    name: str  # the Config field
    default: Any  # dataclasses.MISSING: the setting is required
    check: Check
    doc: str
    shown: str  # the default as docs/config.md shows it
    outputs: bool  # its value may change what is served (the fingerprint covers it)


def setting(
    default: Any,
    check: Check,
    doc: str,
    *,
    key: Optional[str] = None,
    shown: Optional[str] = None,
    outputs: bool = True,
) -> Any:
    """A Config field that is a setting (`key`: its name in the config file, if not the field's;
    `outputs=False`: a resource or timing setting that never changes what is served, so hosts
    may differ in it and the fingerprint leaves it out)."""
    meta = {"check": check, "doc": doc, "key": key, "shown": shown, "outputs": outputs}
    return dataclasses.field(default=default, metadata=meta)


# ---- checks ---------------------------------------------------------------------------------
def integer(minimum: int, maximum: Optional[int] = None) -> Check:
    def check(key: str, value: Any, checked: Dict[str, Any]) -> int:
        if not isinstance(value, bool) and isinstance(value, (int, numpy.integer)):
            if minimum <= value and (maximum is None or value <= maximum):
                return int(value)
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ConfigError(key, f"must be an int {bounds}, got {value!r}")

    return check


def number(*, zero: bool = False) -> Check:
    """A number of seconds, > 0 (`zero`: >= 0)."""

    def check(key: str, value: Any, checked: Dict[str, Any]) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
            raise ConfigError(key, f"must be a number {'>=' if zero else '>'} 0, got {value!r}")
        return float(value)

    return check


def fraction(key: str, value: Any, checked: Dict[str, Any]) -> float:
    """A fraction from 0 to 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError(key, f"must be a number from 0 to 1, got {value!r}")
    return float(value)


def boolean(key: str, value: Any, checked: Dict[str, Any]) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be True or False, got {value!r}")
    return value


def optional(check: Check) -> Check:
    """None stays None (the setting is off, or its default is decided elsewhere)."""
    return lambda key, value, checked: None if value is None else check(key, value, checked)


def stream_only(check: Check) -> Check:
    """A setting that only map_seq_stream takes."""

    def only(key: str, value: Any, checked: Dict[str, Any]) -> Any:
        if value is not None and checked["map_seq"] is not None:
            raise ConfigError(key, "only allowed with map_seq_stream")
        return check(key, value, checked)

    return only


def _dataset(key: str, value: Any, checked: Dict[str, Any]) -> Dict[str, Any]:
    if not isinstance(value, dict) or "class" not in value:
        raise ConfigError(key, "must be a dict with a 'class' entry")
    return value


def _mapper(key: str, value: Any, checked: Dict[str, Any]) -> Optional[Callable]:
    if value is not None and not callable(value):
        raise ConfigError(key, f"must be callable, got {type(value).__name__}")
    return value


def _stream_mapper(key: str, value: Any, checked: Dict[str, Any]) -> Optional[Callable]:
    """map_seq_stream, checked after map_seq: exactly one of the two is set."""
    if (value is None) == (checked["map_seq"] is None):
        both = value is not None
        raise ConfigError(
            key if both else "map_seq",
            f"set exactly one of map_seq and map_seq_stream ({'both are' if both else 'neither is'} set)",
        )
    return _mapper(key, value, checked)


def _preserves(key: str, value: Any, checked: Dict[str, Any]) -> Optional[bool]:
    """As given, else the stream mapper's `preserves_num_seqs` attribute, else unknown (None)."""
    if value is None:
        attr = getattr(checked["map_seq_stream"], "preserves_num_seqs", None)
        return attr if isinstance(attr, bool) else None
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be a bool, got {value!r}")
    return value


def _mapper_api(key: str, value: Any, checked: Dict[str, Any]) -> str:
    if value not in MAPPER_APIS:
        raise ConfigError(key, f"must be one of {', '.join(map(repr, MAPPER_APIS))}, got {value!r}")
    if value == "returnn":
        from ppserver.mappers.returnn import require_returnn

        require_returnn()
    return value


def _map_outputs(key: str, value: Any, checked: Dict[str, Any]) -> Optional[Dict[str, Dict[str, Any]]]:
    if value is None:
        return None
    if checked["mapper_api"] == "returnn":
        from ppserver.mappers.returnn import out_templates

        return out_templates(value)
    if not isinstance(value, dict) or not value:
        raise ConfigError(key, "must be a non-empty dict {key: {'shape': ..., 'dtype': ...}}")
    return {name: _output_template(key, name, spec) for name, spec in value.items()}


def _output_template(key: str, name: Any, spec: Any) -> Dict[str, Any]:
    if not isinstance(name, str) or not isinstance(spec, dict):
        raise ConfigError(key, f"entry {name!r} must map a str key to a dict")
    shape = spec.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(d is None or (isinstance(d, int) and d >= 0) for d in shape):
        raise ConfigError(key, f"{name!r}: 'shape' must be a tuple of ints or None, got {shape!r}")
    if spec.get("dtype") in (STRING, str):  # text of any width (a sized "U5" is held to its width)
        return {"shape": list(shape), "dtype": STRING}
    try:
        dtype = numpy.dtype(spec.get("dtype", "float32"))
    except (TypeError, ValueError):
        raise ConfigError(key, f"{name!r}: unknown dtype {spec.get('dtype')!r}") from None
    if dtype.hasobject or dtype.kind == "V":  # the wire refuses them
        raise ConfigError(
            key, f"{name!r}: dtype {spec.get('dtype')!r} is not a plain (non-object, non-structured) dtype"
        )
    if dtype.itemsize == 0:
        raise ConfigError(
            key, f"{name!r}: dtype {spec.get('dtype')!r} needs a size, e.g. 'U5' (text of any width: 'string')"
        )
    entry: Dict[str, Any] = {"shape": list(shape), "dtype": dtype_text(dtype)}
    sparse = spec.get("sparse_dim")
    if sparse is not None:
        if isinstance(sparse, bool) or not isinstance(sparse, int) or sparse < 1:
            raise ConfigError(key, f"{name!r}: 'sparse_dim' must be an int >= 1, got {sparse!r}")
        if dtype.kind not in "iu":
            raise ConfigError(key, f"{name!r}: a sparse key (class indices) needs an integer dtype")
        entry["sparse_dim"] = sparse
    return entry


def _heartbeat_timeout(key: str, value: Any, checked: Dict[str, Any]) -> float:
    timeout = number()(key, value, checked)
    if timeout <= checked["heartbeat_interval"]:
        raise ConfigError(key, "must be larger than heartbeat_interval")
    return timeout


def _num_workers(key: str, value: Any, checked: Dict[str, Any]) -> Union[int, str]:
    if value == AUTO:
        return AUTO
    try:
        return integer(1)(key, value, checked)
    except ConfigError:
        raise ConfigError(key, f"must be an int >= 1 or 'auto', got {value!r}") from None


def _max_workers(key: str, value: Any, checked: Dict[str, Any]) -> Optional[int]:
    """Local workers only (0: none, the self-sizing hosts make the pool); min_workers counts them all."""
    return None if value is None else integer(0)(key, value, checked)


def _stream_partitions(key: str, value: Any, checked: Dict[str, Any]) -> Optional[int]:
    """A stream's outputs depend on its partitions, never on the workers that run them: with
    num_workers = 'auto' they are max_workers, which must then be given (its default is the host's)."""
    value = stream_only(optional(integer(1)))(key, value, checked)
    if value is None and checked["map_seq_stream"] is not None and checked["num_workers"] == AUTO:
        if not checked["max_workers"]:
            raise ConfigError(key, "set it (or max_workers) with num_workers = 'auto': a stream's outputs depend on it")
        return checked["max_workers"]
    return value


def _batching(key: str, value: Any, checked: Dict[str, Any]) -> Batching:
    try:
        batching = Batching.from_dict(value, key)
    except UsageError as exc:
        raise ConfigError(key, str(exc).removeprefix(key).lstrip(": ")) from None
    if batching.max_duration is not None and checked["map_seq_stream"] is not None:
        raise ConfigError(key, STREAM_DURATIONS)
    return batching


STREAM_DURATIONS = (
    "['max_duration'] is for map_seq only: map_seq_stream's outputs, which its batches are cut from, "
    "have no known durations (cut them by max_frames or max_seqs)"
)


def _batch_length(key: str, value: Any, checked: Dict[str, Any]) -> Callable:
    if not callable(value):
        raise ConfigError(key, f"must be a function seq -> int, got {type(value).__name__}")
    if checked["map_seq_stream"] is not None:
        raise ConfigError(key, "only with map_seq: map_seq_stream batches are cut by their outputs")
    return value


def _batch_duration(key: str, value: Any, checked: Dict[str, Any]) -> Callable:
    if not callable(value):
        raise ConfigError(key, f"must be a function seq -> float (seconds), got {type(value).__name__}")
    if checked["map_seq_stream"] is not None:
        raise ConfigError(key, "only with map_seq: map_seq_stream batches are cut by their outputs")
    return value


# ---- the table ------------------------------------------------------------------------------
@dataclass
class Config:
    """The checked config: `path` and its `source` (the bytes it was loaded from) say where it
    comes from, `fingerprint` and `worker_fingerprint` describe it (fingerprint.py),
    `returnn_dataset` is set when `path` is a RETURNN config (this the dataset served); every
    other field is a setting."""

    path: str
    fingerprint: str
    dataset: Dict[str, Any] = setting(MISSING, _dataset, "the dataset: {'class': NAME, **kwargs}", shown="required")
    map_seq: Optional[Callable] = setting(None, _mapper, "map_seq(seq, *, epoch, seq_idx, rng, **kwargs) -> seq")
    map_seq_stream: Optional[Callable] = setting(
        None, _stream_mapper, "map_seq_stream(seqs, *, epoch, rng, **kwargs) -> seqs; exactly one of the two mappers"
    )
    preserves_num_seqs: Optional[bool] = setting(
        None,
        stream_only(_preserves),
        "every input of map_seq_stream gives one output",
        key="map_seq_stream_preserves_num_seqs",
        shown="the mapper's preserves_num_seqs",
    )
    mapper_api: str = setting("dict", _mapper_api, '"dict": mappers take seq dicts; "returnn": TensorDicts')
    map_outputs: Optional[Dict[str, Dict[str, Any]]] = setting(
        None,
        _map_outputs,
        "templates the outputs are checked against",
        shown="what the mappers declare, else the dataset's keys",
    )
    direct_results: bool = setting(
        True, boolean, "map_seq results go from workers to clients without the server", outputs=False
    )
    shm_mb: int = setting(
        64, integer(0, MAX_SHM_MB), "MiB of shared memory per worker and direction (0: none)", outputs=False
    )
    buf_size: int = setting(1, integer(1), "seqs (or batches) in flight per worker", outputs=False)
    num_workers: Union[int, str] = setting(
        1,
        _num_workers,
        "local worker processes; 'auto': as many as the trainer needs (min_workers to max_workers)",
        outputs=False,
    )
    min_workers: int = setting(1, integer(1), "with num_workers = 'auto': the fewest workers", outputs=False)
    max_workers: Optional[int] = setting(
        None,
        _max_workers,
        "with num_workers = 'auto': the most local workers (0: none)",
        shown="the host's cores less one",
        outputs=False,
    )
    elastic_settle: float = setting(
        2.0, number(), "advanced, 'auto': seconds after a pool change before measuring", outputs=False
    )
    elastic_window: float = setting(
        5.0, number(), "advanced, 'auto': seconds each measurement of the rate lasts", outputs=False
    )
    seed: int = setting(0, integer(0), "seeds the mappers' rngs and offsets the datasets' orderings")
    stream_partitions: Optional[int] = setting(
        None, _stream_partitions, "independent streams of map_seq_stream", shown="num_workers (max_workers if 'auto')"
    )
    heartbeat_interval: float = setting(1.0, number(), "seconds between heartbeats", outputs=False)
    heartbeat_timeout: float = setting(
        5.0, _heartbeat_timeout, "seconds of silence after which a peer is lost", outputs=False
    )
    max_seq_retries: int = setting(
        3, integer(1), "workers a seq may be on when they die before its epoch fails", outputs=False
    )
    max_skipped: float = setting(
        0.01,
        fraction,
        "fraction of an epoch's seqs map_seq may skip (return None) before the epoch fails (0: any skip fails)",
    )
    max_message_bytes: int = setting(
        1 << 30, integer(1024), "largest frame on the worker socket", shown="1 GiB", outputs=False
    )
    max_request_bytes: int = setting(
        wire.MAX_HEADER_BYTES,
        integer(1024, wire.MAX_HEADER_BYTES),
        "largest frame on the control socket",
        shown="1 MiB",
        outputs=False,
    )
    progress_interval: float = setting(
        30.0, number(zero=True), "seconds between progress lines (0: none)", outputs=False
    )
    story_length: int = setting(
        100_000, integer(0), "moves the scheduler keeps for `ppserver status --story` (0: none)", outputs=False
    )
    batching: Optional[Batching] = setting(None, optional(_batching), "how epochs are cut into batches by default")
    batch_length: Optional[Callable] = setting(
        None, optional(_batch_length), "batch_length(seq) -> int: a read seq's length", shown="its length_key's"
    )
    batch_duration: Optional[Callable] = setting(
        None,
        optional(_batch_duration),
        "batch_duration(seq) -> float: a read seq's seconds, for max_duration",
        shown="the dataset's",
    )
    worker_threads: int = setting(
        1, integer(1), "threads of numpy's, torch's, ... pools per worker process", outputs=False
    )
    returnn_dataset: Optional[str] = None
    worker_fingerprint: str = ""
    source: bytes = dataclasses.field(default=b"", repr=False)

    @property
    def is_stream(self) -> bool:
        return self.map_seq_stream is not None

    @property
    def auto_workers(self) -> bool:
        return self.num_workers == AUTO

    @property
    def partitions(self) -> int:
        if self.stream_partitions:
            return self.stream_partitions
        return self.num_workers if isinstance(self.num_workers, int) else self.max_workers or 1

    @property
    def counts_seqs(self) -> bool:
        """An epoch has as many results as inputs (always with map_seq), so its length is known."""
        return not self.is_stream or self.preserves_num_seqs is True


def _table() -> Tuple[Setting, ...]:
    rows: List[Setting] = []
    for f in dataclasses.fields(Config):
        if "check" in f.metadata:
            meta = f.metadata
            shown = meta["shown"] or repr(f.default)
            key = meta["key"] or f.name
            rows.append(Setting(key, f.name, f.default, meta["check"], meta["doc"], shown, meta["outputs"]))
    return tuple(rows)


SETTINGS = _table()
KNOWN_KEYS = frozenset(s.key for s in SETTINGS)
