"""The config: a Python file whose top-level names are the settings, read by the server and by
every worker; checked at load (table.py declares the settings), and fingerprinted
(fingerprint.py) so that all sides agree on what maps a seq."""

from ppserver.config.fingerprint import FINGERPRINT_COVERS, fingerprint, local_modules
from ppserver.config.settings import from_settings, load, load_config
from ppserver.config.table import KNOWN_KEYS, SETTINGS, Config

__all__ = [
    "FINGERPRINT_COVERS",
    "KNOWN_KEYS",
    "SETTINGS",
    "Config",
    "fingerprint",
    "from_settings",
    "load",
    "load_config",
    "local_modules",
]
