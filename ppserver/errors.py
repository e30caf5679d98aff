"""Errors the server raises for its own configuration and data problems."""

from __future__ import annotations


class ConfigError(Exception):
    """A bad config value. `str()` is one line naming the offending key, option or file.

    The key "config" stands for the config file itself (its message names the file).
    """

    def __init__(self, key: str, message: str):
        if key == "config":
            text = f"config file {message}"
        else:
            what = "option" if key.startswith("-") else "config key"
            text = f"{what} {key!r}: {message}"
        super().__init__(text)
        self.key = key


class Stopped(BaseException):
    """SIGTERM or SIGINT before the server serves (server.loop.stop_on_signals). A BaseException,
    and not the config's doing: no `except Exception` of a dataset or config that is loading
    catches it, and a config's load lets it through. The start is abandoned; what tidies still runs."""


def one_line(exc: BaseException) -> str:
    """An exception as one line naming its type, for an error that names a key instead of a traceback."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
