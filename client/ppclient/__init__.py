"""ppclient: the thin training-side client of ppserver (numpy, pyzmq and msgpack only)."""

from ._version import __version__
from .client import Client, EpochIterator
from .errors import DatasetError, Error, MapperError, ServerUnavailable, Superseded, UsageError
from .protocol import PROTOCOL

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
