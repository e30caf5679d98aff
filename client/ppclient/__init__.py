"""ppclient: the thin training-side client of ppserver (numpy, pyzmq and msgpack only)."""

from .client import Client, EpochIterator
from .errors import Error, MapperError, ServerUnavailable
from .wire import PROTOCOL

__all__ = ["Client", "EpochIterator", "Error", "MapperError", "ServerUnavailable", "PROTOCOL"]
