"""Reading and checking the Python config file that the server and every worker load.

The config is a Python file, as in RETURNN: its top-level names are the settings (table.py
declares them). Modules, functions (callables), classes and names starting with ``_`` or
written in UPPER_CASE are helpers and are ignored; any other name must be a known key, so a
typo (``buf_sise``, ``numWorkers``) is an error instead of a silently ignored setting.
"""

from __future__ import annotations
import __future__

import contextlib
import difflib
import linecache
import os
import re
import sys
import types
from dataclasses import MISSING
from typing import Any, Dict, Iterator, Optional

from ppserver.config.fingerprint import CONFIG_MODULE, config_fingerprint, worker_fingerprint
from ppserver.config.table import KNOWN_KEYS, SETTINGS, Config
from ppserver.errors import ConfigError, Stopped, one_line

# Config and KNOWN_KEYS are table.py's, here too for the modules that load configs
__all__ = ["KNOWN_KEYS", "Config", "executing", "from_settings", "load", "load_config", "read_source"]

_FUNCTION_SETTINGS = ("map_seq", "map_seq_stream", "batch_length", "batch_duration")


def load(path: str, returnn_dataset: Optional[str] = None, source: Optional[bytes] = None) -> Config:
    """A ppserver config, or (`returnn_dataset` given) that dataset of a RETURNN config; `source`:
    the file's content as it was when a running server loaded it (else it is read now)."""
    if returnn_dataset is None:
        return load_config(path, source)
    from ppserver.config.returnn import load_returnn_config

    return load_returnn_config(path, returnn_dataset, source)


def load_config(path: str, source: Optional[bytes] = None) -> Config:
    """Execute the config file (`source`: its content, if not read now) and return the checked
    settings; raises ConfigError."""
    if source is None:
        source = read_source(path, "config")
    namespace: Dict[str, Any] = {"__file__": os.path.abspath(path), "__name__": CONFIG_MODULE}
    # Modules next to the config import as they would in RETURNN ("mymod:MyDataset", helpers).
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    remember_source(path, source)
    with executing(path, "config"):
        exec(compile(source, path, "exec"), namespace)
    settings = {k: v for k, v in namespace.items() if k != "__builtins__" and not _is_helper(k, v)}
    unknown = sorted(set(settings) - KNOWN_KEYS)
    if unknown:
        raise _unknown_key(unknown[0])
    return from_settings(settings, path=path, source=source, namespace=namespace)


def from_settings(
    settings: Dict[str, Any],
    *,
    path: str = "<settings>",
    source: bytes = b"",
    namespace: Optional[Dict[str, Any]] = None,
    salt: bytes = b"",
) -> Config:
    """Check settings (table.py runs each setting's check, in its order); `source` (the config file),
    `namespace` (the whole config, helpers included), `salt` and the values of the settings that
    decide outputs make the fingerprints."""
    if "dataset" not in settings:
        raise ConfigError("dataset", "missing: set dataset = {'class': ..., ...}")
    checked: Dict[str, Any] = {}
    for s in SETTINGS:
        value = settings.get(s.key, None if s.default is MISSING else s.default)
        checked[s.name] = s.check(s.key, value, checked)
    mappers = [checked["map_seq"], checked["map_seq_stream"], checked["batch_length"], checked["batch_duration"]]
    roots = (namespace or settings).values()
    values = {s.name: checked[s.name] for s in SETTINGS if s.outputs and s.name != "dataset"}
    if checked["map_seq_stream"] is not None:  # its partitions are num_workers' unless set
        values["stream_partitions"] = checked["stream_partitions"] or checked["num_workers"]
    worker = worker_fingerprint(source, mappers, roots, salt, values)
    return Config(
        path=path,
        fingerprint=config_fingerprint(worker, checked["dataset"]),
        worker_fingerprint=worker,
        source=source,
        **checked,
    )


def read_source(path: str, key: str) -> bytes:
    """The bytes of a config file; `key` names it in the error (the config, or an option)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(key, f"{path!r} cannot be read: {exc.strerror}") from None


def remember_source(path: str, source: bytes) -> None:
    """Make `source` what Python shows as the lines of file `path` (inspect.getsource of the
    config's functions, tracebacks): the content that runs, even where the file was edited since."""
    lines = source.decode("utf8", "replace").splitlines(keepends=True)
    linecache.cache[path] = (len(source), None, lines, path)  # no mtime: never checked against the file


@contextlib.contextmanager
def executing(path: str, key: str) -> Iterator[None]:
    """What goes wrong while a config file runs, as one ConfigError line naming the file and its line."""
    try:
        yield
    except Exception as exc:
        raise ConfigError(key, f"{path!r} failed to load{_error_line(exc, path)}: {one_line(exc)}") from None
    except Stopped:
        raise
    except BaseException as exc:  # SystemExit, KeyboardInterrupt: must not end the server silently
        if isinstance(exc, SystemExit):
            what = "called sys.exit()" if exc.code is None else f"called sys.exit({exc.code!r})"
        else:
            what = f"raised {type(exc).__name__}"
        raise ConfigError(key, f"{path!r} stopped while loading{_error_line(exc, path)}: {what}") from None


def _error_line(exc: BaseException, path: str) -> str:
    """' (line N)' of the deepest traceback frame in the config file, or ''."""
    line = ""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = f" (line {tb.tb_lineno})"
        tb = tb.tb_next
    return line


def _is_helper(name: str, value: Any) -> bool:
    """Names the config may define freely; everything else must be a setting (see KNOWN_KEYS)."""
    if name.startswith("_") or name.isupper():
        return True
    if isinstance(value, type(__future__.annotations)):  # from __future__ import annotations
        return True
    return isinstance(value, (types.ModuleType, type)) or (callable(value) and name not in _FUNCTION_SETTINGS)


def _unknown_key(name: str) -> ConfigError:
    """The error for a name that is neither a helper nor a setting, with the likely intended setting."""
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()
    known = sorted(KNOWN_KEYS)
    matches = difflib.get_close_matches(snake, known, n=1) or difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {matches[0]!r}?)" if matches else ""
    return ConfigError(name, f"unknown setting{hint}; helpers must be UPPER_CASE or start with '_'")
