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

The fingerprint covers the file, the local modules its values lead to and the dataset's name.
"""

from __future__ import annotations

from typing import Any, Dict

from ppserver.config.settings import executing, from_settings, read_source
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


def _load(path: str) -> Any:
    """RETURNN's Config of the file, made the global config (as in the trainer); ConfigError in one line."""
    try:
        from returnn.config import Config as ReturnnConfig
        from returnn.config import set_global_config
    except ImportError as exc:
        raise ConfigError("--returnn-config", f"needs RETURNN: pip install 'ppserver[returnn]' ({exc})") from None
    rc = ReturnnConfig()
    with executing(path, "--returnn-config"):
        rc.load_file(path)
    set_global_config(rc)
    try:
        from returnn.util.basic import BehaviorVersion

        BehaviorVersion.set(rc.int("behavior_version", None))
    except Exception:  # set already (to the same value), or a RETURNN without it
        pass
    return rc


def _is_postprocessing(cls: Any) -> bool:
    if cls == "PostprocessingDataset":
        return True
    try:
        from returnn.datasets.postprocessing import PostprocessingDataset

        from ppclient.returnn import ServerDataset
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, (PostprocessingDataset, ServerDataset))


def load_returnn_config(path: str, name: str) -> Config:
    """The settings of dataset `name` of the RETURNN config at `path`; raises ConfigError."""
    source = read_source(path, "--returnn-config")
    rc = _load(path)
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
