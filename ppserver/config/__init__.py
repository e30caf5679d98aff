"""The config: a Python file whose top-level names are the settings, read by the server and by
every worker; checked at load (table.py declares the settings), and fingerprinted
(fingerprint.py) so that all sides agree on what maps a seq."""

from ppserver.config.fingerprint import (
    FINGERPRINT_COVERS,
    config_fingerprint,
    local_modules,
    served_fingerprint,
    worker_fingerprint,
)
from ppserver.config.settings import from_settings, load, load_config
from ppserver.config.table import KNOWN_KEYS, SETTINGS, Config

__all__ = [
    "FINGERPRINT_COVERS",
    "KNOWN_KEYS",
    "SETTINGS",
    "Config",
    "config_fingerprint",
    "from_settings",
    "load",
    "load_config",
    "local_modules",
    "served_fingerprint",
    "worker_fingerprint",
]
