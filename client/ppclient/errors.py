"""Errors raised by the client; all derive from ppclient.Error."""

from __future__ import annotations

from typing import Optional


class Error(Exception):
    """Any failure reported by or about the server."""


class UsageError(Error, ValueError):
    """A bad argument given to the client (an address, a keys directory): nothing was sent."""


class ServerUnavailable(Error):
    """The server did not answer within the client's timeout."""


class Superseded(Error):
    """Another request (of this or another client) started a newer epoch; this one ended."""


class RemoteTraceback(Exception):
    """The traceback of an exception in another process, as text: the cause of a DatasetError or
    MapperError, so that one the trainer does not catch prints where the dataset or mapper failed."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return f'\n"""\n{self.text.rstrip()}\n"""'


class DatasetError(Error):
    """The server's dataset raised (reading, or setting the epoch up); `remote_traceback` says where."""

    def __init__(self, message: str, *, remote_traceback: str = ""):
        super().__init__(message)
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)


class MapperError(Error):
    """A mapper raised on the server (or its output failed validation); `remote_traceback` says
    where (and is printed as its cause)."""

    def __init__(self, message: str, *, seq_tag: Optional[str] = None, remote_traceback: str = ""):
        super().__init__(f"{message} (seq {seq_tag!r})" if seq_tag is not None else message)
        self.seq_tag = seq_tag
        self.remote_traceback = remote_traceback
        if remote_traceback:
            self.__cause__ = RemoteTraceback(remote_traceback)
