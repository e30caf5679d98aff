"""Errors the server raises for its own configuration and data problems."""

from __future__ import annotations


class ConfigError(Exception):
    """A bad config value. `str()` is one line naming the offending key."""

    def __init__(self, key: str, message: str):
        what = "option" if key.startswith("-") else "config key"
        super().__init__(f"{what} {key!r}: {message}")
        self.key = key
