"""Where a client's epoch messages come in: the data socket (from the server) and the result socket
(straight from the workers). A message of one live run that comes while another is awaited is
kept for that run's iterator, so no run loses its seqs to another."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Deque, Dict, Optional

import zmq

from . import protocol
from .errors import Error
from .protocol import Channel, Peer
from .results import DirectResults


class Inbox:
    """The messages of the client's live runs (`runs`: those not taken yet, by run)."""

    def __init__(self, address: str):
        self.address = address  # the server's
        self.runs: Dict[int, Deque[protocol.Decoded]] = {}
        self.data: Optional[zmq.Socket] = None  # the DEALER the server sends an epoch's messages to
        self.results: Optional[DirectResults] = None  # and the workers' results, once bound
        self._poller: Optional[zmq.Poller] = None
        self._flip = False  # which socket is read first next time

    def open(self, run: int) -> None:
        """Keep `run`'s messages from now on."""
        self.runs[run] = deque()

    def drop(self, run: int) -> None:
        """Keep no more of `run`'s messages (its iterator is done with it)."""
        self.runs.pop(run, None)

    def next(self, run: int, deadline: float) -> Optional[protocol.Decoded]:
        """The next message of `run` (None at the deadline); others' go to their runs' queues."""
        queued = self.runs.get(run)
        if queued:
            return queued.popleft()
        data = self.data
        assert data is not None
        direct = self.results.sock if self.results is not None else None
        while True:
            # What is queued already is taken without a poll (a system call per message saved),
            # also after the deadline (what came while the trainer was busy tells that the server lives).
            ready: Any = [s for s in (data, direct) if s is not None and int(s.get(zmq.EVENTS)) & zmq.POLLIN]
            left = deadline - time.monotonic()
            if not ready and left <= 0:
                return None
            if not ready:
                if direct is None:
                    ready = (data,) if data.poll(int(left * 1000) + 1) else ()
                else:
                    ready = dict(self._poll(data, direct, int(left * 1000) + 1))
            # in turn, so that neither starves the other: a worker's hello waits in the result
            # socket while the server's messages keep coming, and its results go the slow way
            self._flip = not self._flip
            for sock in (direct, data) if self._flip else (data, direct):
                if sock is None or sock not in ready:
                    continue
                decoded = self._recv(sock, sock is data)
                if decoded is None:
                    continue
                owner = getattr(decoded.msg, "run", None)
                if owner == run:
                    return decoded
                if owner in self.runs:
                    self.runs[owner].append(decoded)  # a live run's: keep it for that iterator

    def _poll(self, data: zmq.Socket, direct: zmq.Socket, timeout_ms: int) -> Any:
        if self._poller is None:
            self._poller = zmq.Poller()
            self._poller.register(data, zmq.POLLIN)
            self._poller.register(direct, zmq.POLLIN)
        return self._poller.poll(timeout_ms)

    def _recv(self, sock: zmq.Socket, from_server: bool) -> Optional[protocol.Decoded]:
        """One message from the data socket (the server's) or the result socket (a worker's)."""
        frames = sock.recv_multipart(copy=False)
        if not from_server:
            assert self.results is not None
            return self.results.receive(frames)
        if len(frames) < 2 or len(frames[0]) != 0:
            return None
        try:
            return protocol.decode(frames[1:], Peer.CLIENT, (Channel.DATA,))
        except protocol.ProtocolError as exc:
            raise Error(f"malformed message from {self.address}: {exc}") from None
