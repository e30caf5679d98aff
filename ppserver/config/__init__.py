"""The config: a Python file whose top-level names are the settings, read by the server and by
every worker; checked at load, and fingerprinted so that all sides agree on what maps a seq."""

from ppserver.config.settings import (
    FINGERPRINT_COVERS,
    KNOWN_KEYS,
    Config,
    fingerprint,
    from_settings,
    load,
    load_config,
    local_modules,
)

__all__ = [
    "FINGERPRINT_COVERS",
    "KNOWN_KEYS",
    "Config",
    "fingerprint",
    "from_settings",
    "load",
    "load_config",
    "local_modules",
]
