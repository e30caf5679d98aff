"""The thread that tells the server, about once a second, that a client lives: a trainer busy with
something else for a while (a validation pass, a checkpoint) keeps its shard and its job."""

from __future__ import annotations

import sys
import threading
from typing import Optional

import zmq

from . import keyfiles, protocol


class AliveThread(threading.Thread):
    """Sends ClientAlive every `interval` seconds from a socket of its own until `stop()`."""

    def __init__(
        self, ctx: zmq.Context, address: str, consumer: bytes, interval: float, keys: Optional[keyfiles.ClientKeys]
    ):
        super().__init__(name="ppclient-alive", daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.sndhwm = 2
        if keys is not None:
            keys.apply(self.sock)
        self.sock.connect(address)
        self.frames = [protocol.DELIMITER, *protocol.encode(protocol.ClientAlive(consumer=consumer))]
        self.interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                try:
                    self.sock.send_multipart(self.frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected yet, or the server is gone: the next beat tries again
                self.stopped.wait(self.interval)
        finally:
            self.sock.close(linger=0)

    def stop(self, timeout: float = 2.0) -> bool:
        """Stop and wait (at most `timeout`); True once the thread has ended and closed its socket.
        While the interpreter finalizes, a daemon thread runs no more: False at once."""
        self.stopped.set()
        if sys.is_finalizing():
            return False
        self.join(timeout)
        return not self.is_alive()
