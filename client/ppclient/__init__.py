"""ppclient: the thin training-side client of ppserver (numpy, pyzmq and msgpack only)."""

from ._version import __version__
from .client import Client, EpochIterator
from .errors import Error, MapperError, ServerUnavailable, Superseded, UsageError
from .protocol import PROTOCOL

__all__ = [
    "Client",
    "EpochIterator",
    "Error",
    "MapperError",
    "ServerUnavailable",
    "Superseded",
    "UsageError",
    "PROTOCOL",
    "__version__",
]
