"""Errors the server raises for its own configuration and data problems."""

from __future__ import annotations


class ConfigError(Exception):
    """A bad config value. `str()` is one line naming the offending key."""

    def __init__(self, key: str, message: str):
        what = "option" if key.startswith("-") else "config key"
        super().__init__(f"{what} {key!r}: {message}")
        self.key = key


def check_endpoint(option: str, endpoint: str) -> str:
    """A ZeroMQ endpoint given on the command line: tcp://HOST:PORT (0 <= PORT <= 65535) or ipc://PATH."""
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return endpoint
    proto, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if proto != "tcp" or not sep or not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(option, f"expected tcp://HOST:PORT with PORT 0-65535 (or ipc://PATH), got {endpoint!r}")
    return endpoint
