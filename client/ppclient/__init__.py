"""ppclient: the thin training-side client of ppserver (numpy, pyzmq and msgpack only).

`Client`, `EpochIterator` and `PROTOCOL` are imported when first used: the server's and the
workers' processes, which import ppclient for its protocol, do not pay for the client at start.
"""

from typing import Any

from ._version import __version__
from .errors import DatasetError, Error, MapperError, ServerUnavailable, Superseded, UsageError

__all__ = [
    "Client",
    "EpochIterator",
    "Error",
    "DatasetError",
    "MapperError",
    "ServerUnavailable",
    "Superseded",
    "UsageError",
    "PROTOCOL",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in ("Client", "EpochIterator"):
        from . import client

        return getattr(client, name)
    if name == "PROTOCOL":
        from .protocol import PROTOCOL

        return PROTOCOL
    raise AttributeError(f"module 'ppclient' has no attribute {name!r}")
