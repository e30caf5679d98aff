"""Serving one dataset of a RETURNN config: `--returnn-config FILE --dataset NAME`.

The trainer's config stays the one file: its dataset dict (a PostprocessingDataset's, or
ppclient.returnn.ServerDataset's with the same keys) becomes the server's settings, and the
server and every worker load the file as RETURNN does (Config.load_file, as the global
config), so their mappers are the very functions the trainer's config defines or imports.

    dataset (the wrapped dict)             -> dataset = {"class": "returnn", "dataset": ...}
    map_seq, map_seq_stream, map_outputs,  -> the same settings, mapper_api = "returnn"
    map_seq_stream_preserves_num_seqs
    num_workers (0: in RETURNN's process)  -> num_workers (at least 1); a stream mapper runs
                                              max(num_workers, 1) partitions, as RETURNN does
    buf_size                               -> buf_size
    random_seed_offset (else the config's  -> seed
    dataset_random_seed_offset)
    server_settings (ServerDataset only)   -> any other ppserver setting (worker_threads, shm_mb, ...)

The fingerprint covers the file, the local modules it uses, the dataset's name and what its
dict evaluates to (fingerprint.py); a trainer that holds the loaded config computes the same
(`loaded_returnn_config`) to tell whether a running server serves its dict.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

from ppserver.config.fingerprint import RETURNN_CONFIG_MODULE
from ppserver.config.settings import executing, from_settings, read_source, remember_source
from ppserver.config.table import KNOWN_KEYS, Config, integer
from ppserver.errors import ConfigError

POSTPROCESSING_KEYS = (
    "map_seq",
    "map_seq_stream",
    "map_outputs",
    "map_seq_stream_preserves_num_seqs",
)
# what the dataset dict decides; server_settings holds the other settings
DERIVED_KEYS = {"dataset", "mapper_api", "num_workers", "buf_size", "seed", *POSTPROCESSING_KEYS}


def _load(path: str, source: Optional[bytes] = None) -> Any:
    """RETURNN's Config of the file (its content `source`, where given and snapshot_runs), made the
    global config (as in the trainer); ConfigError in one line."""
    try:
        from returnn.config import Config as ReturnnConfig
        from returnn.config import set_global_config
    except ImportError as exc:
        raise ConfigError("--returnn-config", f"needs RETURNN: pip install 'ppserver[returnn]' ({exc})") from None
    rc = ReturnnConfig()
    with executing(path, "--returnn-config"):
        if source is not None and snapshot_runs(path, source):
            _exec_source(rc, path, source)
        else:
            rc.load_file(path)
    set_global_config(rc)
    try:
        from returnn.util.basic import BehaviorVersion

        BehaviorVersion.set(rc.int("behavior_version", None))
    except Exception:  # set already (to the same value), or a RETURNN without it
        pass
    return rc


def snapshot_runs(path: str, source: bytes) -> bool:
    """Whether a RETURNN config's content can run without its file (a snapshot a server took at its
    start): where RETURNN executes the file's Python directly. A config in RETURNN's other format,
    or a module inside a package (RETURNN imports those), is loaded from its file."""
    if not (path.endswith(".py") or source.lstrip().startswith(b"#!")):
        return False
    return not (path.endswith(".py") and os.path.exists(os.path.join(os.path.dirname(path) or ".", "__init__.py")))


def _exec_source(rc: Any, path: str, source: bytes) -> None:
    """What RETURNN's Config.load_file(path) does for a Python config, with the content given."""
    from returnn import config as returnn_config
    from returnn.util.basic import custom_exec

    rc.files.append(path)
    remember_source(path, source)
    user_ns = rc.typed_dict
    user_ns.update({"config": rc, "__file__": path, "__name__": RETURNN_CONFIG_MODULE})
    custom_exec(source.decode("utf8").strip(), path, user_ns, user_ns)
    returnn_config._global_config_as_py_module_proxy_setup()


def _is_postprocessing(cls: Any) -> bool:
    if cls == "PostprocessingDataset":
        return True
    try:
        from returnn.datasets.postprocessing import PostprocessingDataset

        from ppclient.returnn import ServerDataset
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, (PostprocessingDataset, ServerDataset))


def load_returnn_config(path: str, name: str, source: Optional[bytes] = None) -> Config:
    """The settings of dataset `name` of the RETURNN config at `path`; raises ConfigError.
    `source`: the content the fingerprint covers, if not the file's now (RETURNN reads the file)."""
    if source is None or not snapshot_runs(path, source):
        source = read_source(path, "--returnn-config")
        return loaded_returnn_config(path, source, _load(path), name)
    return loaded_returnn_config(path, source, _load(path, source), name)


def loaded_returnn_config(path: str, source: bytes, rc: Any, name: str) -> Config:
    """The settings of dataset `name` of RETURNN config `rc`, loaded from `path` whose content was
    `source` (a trainer's global config, or one _load made); raises ConfigError."""
    from ppclient.returnn import config_entry

    try:
        entry = config_entry(rc.typed_dict, name)
    except KeyError as exc:
        raise ConfigError("--dataset", str(exc.args[0])) from None
    if not _is_postprocessing(entry.get("class")):
        raise ConfigError(
            "--dataset",
            f"{name!r} has class {entry.get('class')!r}: serve a PostprocessingDataset dict, or a "
            "ppclient.returnn.ServerDataset dict with its keys (dataset, map_seq or map_seq_stream, ...)",
        )
    if "dataset" not in entry:
        raise ConfigError(f"{name}['dataset']", "missing: the dict of the dataset whose seqs the mappers get")
    settings = _settings(rc, name, entry)
    cfg = from_settings(
        settings, path=path, source=source, namespace=rc.typed_dict, salt=f"\0returnn dataset {name}".encode()
    )
    cfg.returnn_dataset = name
    return cfg


def _settings(rc: Any, name: str, entry: Dict[str, Any]) -> Dict[str, Any]:
    settings: Dict[str, Any] = {k: entry[k] for k in POSTPROCESSING_KEYS if entry.get(k) is not None}
    settings["mapper_api"] = "returnn"
    settings["dataset"] = {"class": "returnn", "dataset": entry["dataset"]}
    num_workers = integer(0)(f"{name}['num_workers']", entry.get("num_workers", 0), {})
    settings["num_workers"] = max(num_workers, 1)
    if entry.get("map_seq_stream") is not None:
        settings["stream_partitions"] = max(num_workers, 1)  # RETURNN's rng streams, one per worker
    if "buf_size" in entry:
        settings["buf_size"] = entry["buf_size"]
    seed = entry.get("random_seed_offset")
    settings["seed"] = rc.int("dataset_random_seed_offset", 0) if seed is None else seed
    extra = entry.get("server_settings") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"{name}['server_settings']", f"must be a dict of ppserver settings, got {extra!r}")
    for key, value in extra.items():
        if key in DERIVED_KEYS:
            raise ConfigError(f"{name}['server_settings'][{key!r}]", "is set by the dataset dict itself")
        if key not in KNOWN_KEYS:
            raise ConfigError(f"{name}['server_settings'][{key!r}]", "unknown ppserver setting")
        settings[key] = value
    return settings
