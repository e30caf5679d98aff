"""Reading and checking the Python config file that the server and every worker load.

The config is a Python file, as in RETURNN: its top-level names are the settings.
Modules, functions (callables), classes and names starting with ``_`` or written in
UPPER_CASE are helpers and are ignored; any other name must be a known key, so a typo
(``buf_sise``, ``numWorkers``) is an error instead of a silently ignored setting.
"""

from __future__ import annotations
import __future__

import difflib
import hashlib
import inspect
import os
import re
import site
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional

import numpy

from ppclient import wire
from ppclient.batching import Batching
from ppclient.errors import UsageError
from ppserver.errors import ConfigError
from ppserver.mappers.apply import dtype_text

KNOWN_KEYS = {
    "dataset",
    "map_seq",
    "map_seq_stream",
    "map_outputs",
    "map_seq_stream_preserves_num_seqs",
    "mapper_api",
    "direct_results",
    "shm_mb",
    "buf_size",
    "num_workers",
    "seed",
    "stream_partitions",
    "heartbeat_interval",
    "heartbeat_timeout",
    "max_seq_retries",
    "max_message_bytes",
    "max_request_bytes",
    "progress_interval",
    "batching",
    "batch_length",
    "worker_threads",
}


MAPPER_APIS = ("dict", "returnn")
MAX_SHM_MB = 4096  # a segment per worker and direction; more buys nothing and risks the host's memory


@dataclass
class Config:
    path: str
    fingerprint: str
    dataset: Dict[str, Any]
    map_seq: Optional[Callable] = None
    map_seq_stream: Optional[Callable] = None
    map_outputs: Optional[Dict[str, Dict[str, Any]]] = None
    preserves_num_seqs: Optional[bool] = None
    mapper_api: str = "dict"  # "returnn": the mappers take and return RETURNN TensorDicts
    direct_results: bool = True  # map_seq results go from workers to clients without the server
    shm_mb: int = 64  # shared memory per worker for its inputs and per worker for its results (0: off)
    buf_size: int = 1
    num_workers: int = 1
    seed: int = 0
    stream_partitions: Optional[int] = None
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    max_seq_retries: int = 3
    max_message_bytes: int = 1 << 30
    max_request_bytes: int = wire.MAX_HEADER_BYTES  # per frame on the control socket: a request is one header
    progress_interval: float = 30.0  # seconds between the server's progress lines; 0: none
    batching: Optional[Batching] = None  # how epochs are cut into batches for requests that do not say
    batch_length: Optional[Callable] = None  # a read seq's length for the cut (default: its length_key's)
    worker_threads: int = 1  # threads of numpy's, torch's, ... pools in each worker process
    returnn_dataset: Optional[str] = None  # set: `path` is a RETURNN config, and this its dataset served

    @property
    def is_stream(self) -> bool:
        return self.map_seq_stream is not None

    @property
    def partitions(self) -> int:
        return self.stream_partitions or self.num_workers


def _is_helper(name: str, value: Any) -> bool:
    """Names the config may define freely; everything else must be a setting (see KNOWN_KEYS)."""
    if name.startswith("_") or name.isupper():
        return True
    if isinstance(value, type(__future__.annotations)):  # from __future__ import annotations
        return True
    return isinstance(value, (types.ModuleType, type)) or (callable(value) and name not in _FUNCTION_SETTINGS)


_FUNCTION_SETTINGS = ("map_seq", "map_seq_stream", "batch_length")


def _unknown_key(name: str) -> ConfigError:
    """The error for a name that is neither a helper nor a setting, with the likely intended setting."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
    known = sorted(KNOWN_KEYS)
    matches = difflib.get_close_matches(snake, known, n=1) or difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {matches[0]!r}?)" if matches else ""
    return ConfigError(name, f"unknown setting{hint}; helpers must be UPPER_CASE or start with '_'")


def _error_line(exc: BaseException, path: str) -> str:
    """' (line N)' of the deepest traceback frame in the config file, or ''."""
    line = ""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = f" (line {tb.tb_lineno})"
        tb = tb.tb_next
    return line


def load_config(path: str) -> Config:
    """Execute the config file and return the checked settings; raises ConfigError."""
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        raise ConfigError("config", f"{path!r} cannot be read: {exc.strerror}") from None
    namespace: Dict[str, Any] = {"__file__": os.path.abspath(path), "__name__": "__ppserver_config__"}
    # Modules next to the config import as they would in RETURNN ("mymod:MyDataset", helpers).
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        exec(compile(source, path, "exec"), namespace)
    except Exception as exc:
        message = " ".join(str(exc).split())
        raise ConfigError(
            "config", f"{path!r} failed to load{_error_line(exc, path)}: {type(exc).__name__}: {message}"
        ) from None
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: must not end the server silently
        if isinstance(exc, SystemExit):
            what = "called sys.exit()" if exc.code is None else f"called sys.exit({exc.code!r})"
        else:
            what = f"raised {type(exc).__name__}"
        raise ConfigError("config", f"{path!r} stopped while loading{_error_line(exc, path)}: {what}") from None
    settings = {k: v for k, v in namespace.items() if k != "__builtins__" and not _is_helper(k, v)}
    unknown = sorted(set(settings) - KNOWN_KEYS)
    if unknown:
        raise _unknown_key(unknown[0])
    return from_settings(settings, path=path, source=source, namespace=namespace)


def load(path: str, returnn_dataset: Optional[str] = None) -> Config:
    """A ppserver config, or (`returnn_dataset` given) that dataset of a RETURNN config."""
    if returnn_dataset is None:
        return load_config(path)
    from ppserver.config.returnn import load_returnn_config

    return load_returnn_config(path, returnn_dataset)


def from_settings(
    settings: Dict[str, Any],
    *,
    path: str = "<settings>",
    source: bytes = b"",
    namespace: Optional[Dict[str, Any]] = None,
) -> Config:
    """Check settings; `namespace` (the whole config, helpers included) decides the fingerprint's modules."""
    if "dataset" not in settings:
        raise ConfigError("dataset", "missing: set dataset = {'class': ..., ...}")
    dataset = settings["dataset"]
    if not isinstance(dataset, dict) or "class" not in dataset:
        raise ConfigError("dataset", "must be a dict with a 'class' entry")
    map_seq = settings.get("map_seq")
    map_seq_stream = settings.get("map_seq_stream")
    if map_seq is None and map_seq_stream is None:
        raise ConfigError("map_seq", "set exactly one of map_seq and map_seq_stream (neither is set)")
    if map_seq is not None and map_seq_stream is not None:
        raise ConfigError("map_seq_stream", "set exactly one of map_seq and map_seq_stream (both are set)")
    for key, fn in (("map_seq", map_seq), ("map_seq_stream", map_seq_stream)):
        if fn is not None and not callable(fn):
            raise ConfigError(key, f"must be callable, got {type(fn).__name__}")

    preserves = settings.get("map_seq_stream_preserves_num_seqs")
    if preserves is not None:
        if map_seq is not None:
            raise ConfigError("map_seq_stream_preserves_num_seqs", "only allowed with map_seq_stream")
        if not isinstance(preserves, bool):
            raise ConfigError("map_seq_stream_preserves_num_seqs", f"must be a bool, got {preserves!r}")
    elif map_seq_stream is not None:
        attr = getattr(map_seq_stream, "preserves_num_seqs", None)
        preserves = attr if isinstance(attr, bool) else None

    mapper_api = settings.get("mapper_api", "dict")
    if mapper_api not in MAPPER_APIS:
        raise ConfigError("mapper_api", f"must be one of {', '.join(map(repr, MAPPER_APIS))}, got {mapper_api!r}")
    if mapper_api == "returnn":
        from ppserver.mappers.returnn import out_templates, require_returnn

        require_returnn()

        map_outputs = None if settings.get("map_outputs") is None else out_templates(settings["map_outputs"])
    else:
        map_outputs = _check_map_outputs(settings.get("map_outputs"))

    cfg = Config(
        path=path,
        fingerprint=fingerprint(
            source, [map_seq, map_seq_stream, settings.get("batch_length")], roots=(namespace or settings).values()
        ),
        dataset=dataset,
        map_seq=map_seq,
        map_seq_stream=map_seq_stream,
        map_outputs=map_outputs,
        preserves_num_seqs=preserves,
        mapper_api=mapper_api,
        direct_results=_bool(settings, "direct_results", True),
        shm_mb=_int(settings, "shm_mb", 64, minimum=0, maximum=MAX_SHM_MB),
        buf_size=_int(settings, "buf_size", 1, minimum=1),
        num_workers=_int(settings, "num_workers", 1, minimum=1),
        seed=_int(settings, "seed", 0, minimum=0),
        max_seq_retries=_int(settings, "max_seq_retries", 3, minimum=1),
        max_message_bytes=_int(settings, "max_message_bytes", 1 << 30, minimum=1024),
        max_request_bytes=_int(
            settings, "max_request_bytes", wire.MAX_HEADER_BYTES, minimum=1024, maximum=wire.MAX_HEADER_BYTES
        ),
        heartbeat_interval=_float(settings, "heartbeat_interval", 1.0),
        heartbeat_timeout=_float(settings, "heartbeat_timeout", 5.0),
        progress_interval=_float(settings, "progress_interval", 30.0, zero=True),
        worker_threads=_int(settings, "worker_threads", 1, minimum=1),
    )
    if settings.get("stream_partitions") is not None:
        cfg.stream_partitions = _int(settings, "stream_partitions", 1, minimum=1)
        if map_seq is not None:
            raise ConfigError("stream_partitions", "only allowed with map_seq_stream")
    if cfg.heartbeat_timeout <= cfg.heartbeat_interval:
        raise ConfigError("heartbeat_timeout", "must be larger than heartbeat_interval")
    if settings.get("batching") is not None:
        try:
            cfg.batching = Batching.from_dict(settings["batching"], "batching")
        except UsageError as exc:
            raise ConfigError("batching", str(exc).removeprefix("batching").lstrip(": ")) from None
    batch_length = settings.get("batch_length")
    if batch_length is not None:
        if not callable(batch_length):
            raise ConfigError("batch_length", f"must be a function seq -> int, got {type(batch_length).__name__}")
        if map_seq_stream is not None:
            raise ConfigError("batch_length", "only with map_seq: map_seq_stream batches are cut by their outputs")
        cfg.batch_length = batch_length
    return cfg


def _int(settings, key, default, *, minimum, maximum=None):
    value = settings.get(key, default)
    if (
        not isinstance(value, bool)
        and isinstance(value, (int, numpy.integer))
        and minimum <= value <= (value if maximum is None else maximum)
    ):
        return int(value)
    bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    raise ConfigError(key, f"must be an int {bounds}, got {value!r}")


def _bool(settings, key, default):
    value = settings.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(key, f"must be True or False, got {value!r}")
    return value


def _float(settings, key, default, *, zero=False):
    value = settings.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero else value > 0):
        raise ConfigError(key, f"must be a number {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


def _check_map_outputs(map_outputs) -> Optional[Dict[str, Dict[str, Any]]]:
    if map_outputs is None:
        return None
    if not isinstance(map_outputs, dict) or not map_outputs:
        raise ConfigError("map_outputs", "must be a non-empty dict {key: {'shape': ..., 'dtype': ...}}")
    out = {}
    for key, spec in map_outputs.items():
        if not isinstance(key, str) or not isinstance(spec, dict):
            raise ConfigError("map_outputs", f"entry {key!r} must map a str key to a dict")
        shape = spec.get("shape")
        if not isinstance(shape, (list, tuple)) or not all(d is None or (isinstance(d, int) and d >= 0) for d in shape):
            raise ConfigError("map_outputs", f"{key!r}: 'shape' must be a tuple of ints or None, got {shape!r}")
        try:
            dtype = numpy.dtype(spec.get("dtype", "float32"))
        except (TypeError, ValueError):
            raise ConfigError("map_outputs", f"{key!r}: unknown dtype {spec.get('dtype')!r}") from None
        if dtype.hasobject or dtype.kind == "V":  # the wire refuses them
            raise ConfigError(
                "map_outputs", f"{key!r}: dtype {spec.get('dtype')!r} is not a plain (non-object, non-structured) dtype"
            )
        if dtype.itemsize == 0:
            raise ConfigError("map_outputs", f"{key!r}: dtype {spec.get('dtype')!r} needs a size, e.g. 'U5'")
        entry: Dict[str, Any] = {"shape": list(shape), "dtype": dtype_text(dtype)}
        out[key] = entry
        sparse = spec.get("sparse_dim")
        if sparse is not None:
            if isinstance(sparse, bool) or not isinstance(sparse, int) or sparse < 1:
                raise ConfigError("map_outputs", f"{key!r}: 'sparse_dim' must be an int >= 1, got {sparse!r}")
            if dtype.kind not in "iu":
                raise ConfigError("map_outputs", f"{key!r}: a sparse key (class indices) needs an integer dtype")
            entry["sparse_dim"] = sparse
    return out


def _source_of(obj: Any, seen: set) -> List[str]:
    if obj is None or id(obj) in seen:
        return []
    seen.add(id(obj))
    parts = []
    target = obj if inspect.isfunction(obj) or inspect.isclass(obj) else type(obj)
    try:
        parts.append(inspect.getsource(target))
    except (OSError, TypeError):
        parts.append(f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}")
    for inner in getattr(obj, "funcs", ()) or ():  # composed mappers such as Sequential
        parts.extend(_source_of(inner, seen))
    return parts


def _semantics_source() -> bytes:
    """What decides a mapped seq besides the config: rng seeding, meta entries, validation, the wire."""
    from ppclient import __version__, protocol
    from ppserver.mappers import apply

    return f"{protocol.PROTOCOL}\n{__version__}\n{inspect.getsource(apply)}".encode()


_OWN_PACKAGES = ("ppserver", "ppclient")  # covered by _semantics_source, wherever they are installed
# RETURNN's view of its loaded config as a module (the functions a RETURNN config defines name it):
# the config file itself is hashed as the source
RETURNN_CONFIG_MODULE = "__returnn_config__"


def _installed_dirs() -> List[str]:
    """Folders whose modules are the interpreter's or installed packages: the same on hosts that agree."""
    paths = sysconfig.get_paths()
    dirs = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        dirs += list(site.getsitepackages()) + [site.getusersitepackages()]
    except AttributeError:  # site replaced by an old virtualenv
        pass
    return sorted({os.path.realpath(d) for d in dirs if d})


def _is_local(module: types.ModuleType, installed: List[str]) -> bool:
    name = module.__name__
    if name in ("__main__", RETURNN_CONFIG_MODULE) or name.split(".")[0] in _OWN_PACKAGES:
        return False
    file = getattr(module, "__file__", None)
    if not isinstance(file, str) or not os.path.isfile(file):
        return False  # built-in, frozen or namespace package
    file = os.path.realpath(file)
    parts = file.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return False
    return not any(file.startswith(d + os.sep) for d in installed)


def _referenced(value: Any, seen: Dict[int, Any]) -> Iterable[types.ModuleType]:
    """Modules a config or module global leads to: its own, its defining module's, and those of what it holds.

    `seen` maps id -> object and keeps the objects alive, so an id is never reused during the walk.
    """
    stack = [value]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, complex, numpy.ndarray)):
            continue
        seen[id(obj)] = obj
        if isinstance(obj, types.ModuleType):
            yield obj
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if not callable(obj):
            continue
        for owner in {getattr(obj, "__module__", None), type(obj).__module__}:
            if isinstance(owner, str) and owner in sys.modules:
                yield sys.modules[owner]
        if inspect.isfunction(obj):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _cell_is_set(c))
            stack.extend(obj.__defaults__ or ())
            stack.extend((obj.__kwdefaults__ or {}).values())
            stack.extend(obj.__dict__.values())  # __wrapped__ of decorated functions
        elif inspect.ismethod(obj):
            stack.extend((obj.__func__, obj.__self__))
        elif not isinstance(obj, type):
            # callable instances: composed mappers (Sequential(...).funcs), functools.partial, ...
            stack.extend((_attr(obj, "__dict__") or {}).values())
            stack.extend(_attr(obj, k) for k in ("func", "args", "keywords", "funcs"))


def _attr(obj: Any, name: str) -> Any:
    """getattr that survives objects whose __getattr__ raises anything."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def _cell_is_set(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def local_modules(roots: Iterable[Any]) -> Dict[str, str]:
    """{name: file} of the modules reachable from `roots` that are neither stdlib, installed nor ppserver's.

    A kept module's globals are followed further (and its parent packages are kept), so a
    helper a helper imports counts too. Only what the config reaches counts, so the result does
    not depend on what else the process imported before.
    """
    installed = _installed_dirs()
    seen: Dict[int, Any] = {}
    checked: Dict[str, bool] = {}
    found: Dict[str, str] = {}
    pending = list(roots)
    while pending:
        for module in _referenced(pending.pop(), seen):
            name = module.__name__
            if name not in checked:
                checked[name] = _is_local(module, installed)
            if name in found or not checked[name]:
                continue
            found[name] = module.__file__ or ""
            pending.extend(list(vars(module).values()))
            parent = name.rpartition(".")[0]
            if parent and parent in sys.modules:
                pending.append(sys.modules[parent])
    return found


FINGERPRINT_COVERS = "the config file, the local modules it imports, the mapper source and ppserver's mapping code"


def fingerprint(source: bytes, mappers: List[Optional[Callable]], roots: Iterable[Any] = ()) -> str:
    """Hash of what decides the mapped seqs (FINGERPRINT_COVERS): equal on hosts that agree.

    Local modules are hashed by name and file bytes, never by path, so copies of the same
    files in different folders (as on another host) agree.
    """
    h = hashlib.sha256(source)
    h.update(_semantics_source())
    seen: set = set()
    for fn in mappers:
        for part in _source_of(fn, seen):
            h.update(part.encode("utf8", "replace"))
    for name, file in sorted(local_modules(list(roots) + list(mappers)).items()):
        try:
            with open(file, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ConfigError("config", f"module {name!r} ({file}) cannot be read: {exc.strerror}") from None
        h.update(f"\0module {name} {len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]
