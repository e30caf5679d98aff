"""A client's requests to its server (info, status, epoch) over a REQ socket, each tried again on a
new connection until the client's timeout has passed: a REQ whose reply is lost can never send
again, and a server that restarts meanwhile answers the next try."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import zmq

from . import endpoints, protocol, wire
from .errors import Error, ServerUnavailable, UsageError
from .protocol import Channel, Peer

RETRY_S = 2.5  # a request unanswered this long is sent again on a new connection (the server may have restarted)


class Refused(Error):
    """The server refused a request; `reason` is its error reply's, a protocol.RefusalReason value
    ("job": a conflict with the running job, see docs/protocol.md)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class Requester:
    """Requests to `address`; `new_socket()` makes a REQ socket, `check()` raises if the client
    cannot send (closed, or made in another process)."""

    def __init__(self, address: str, timeout: float, new_socket: Callable[[], zmq.Socket], check: Callable[[], None]):
        self.address = address
        self.timeout = timeout
        self._new_socket = new_socket
        self._check = check
        self.sock: Optional[zmq.Socket] = None

    def ask(self, msg: protocol.Message, expect: Any) -> Any:
        """Send a request and return its checked reply, trying again until `timeout` has passed.
        Requests are safe to repeat: a repeated `epoch` request of one consumer joins the run the
        first one started."""
        frames = self._frames(msg)
        deadline = time.monotonic() + self.timeout
        attempts = 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            reply = self._attempt(frames, min(left, RETRY_S))
            if reply is not None:
                return self._checked_reply(msg, reply, expect)
            if time.monotonic() >= deadline:
                again = f" (asked {attempts} times, on a new connection each time)" if attempts > 1 else ""
                why = endpoints.why_silent(self.address)
                raise ServerUnavailable(
                    f"no answer from {self.address} within {self.timeout:g} s{again}" + (f": {why}" if why else "")
                )

    def probe(self, wait_s: float) -> Optional[protocol.InfoReply]:
        """One `info` request, answered within `wait_s` or not (None): who serves the address now."""
        reply = self._attempt(self._frames(protocol.InfoRequest()), wait_s)
        return None if reply is None else self._checked_reply(protocol.InfoRequest(), reply, protocol.InfoReply)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def _frames(self, msg: protocol.Message) -> List[Any]:
        self._check()
        frames = protocol.encode(msg)
        if len(frames[0]) > wire.MAX_HEADER_BYTES:  # the server would drop the connection unanswered
            lists = [f"{k} has {len(v)} entries" for k in ("seq_list", "seq_order") if (v := getattr(msg, k, None))]
            raise UsageError(
                f"the {msg.kind!r} request is {len(frames[0])} bytes, more than the {wire.MAX_HEADER_BYTES} a request "
                f"may have" + (f" ({', '.join(lists)})" if lists else "")
            )
        return frames

    def _attempt(self, frames: List[Any], wait_s: float) -> Optional[List[bytes]]:
        """One try: the reply's frames, or None when none came within `wait_s` (the REQ is closed)."""
        if self.sock is None:
            self.sock = self._new_socket()
            self.sock.connect(self.address)
        self.sock.send_multipart(frames)
        if self.sock.poll(max(int(wait_s * 1000), 1)):
            return self.sock.recv_multipart()
        self.close()
        return None

    def _checked_reply(self, msg: protocol.Message, frames: List[bytes], expect: Any) -> Any:
        try:
            reply = protocol.decode(frames, Peer.CLIENT, (Channel.CONTROL,)).msg
        except protocol.VersionMismatch as exc:
            raise Error(protocol.mismatch_text(exc.theirs, "the server")) from None
        except protocol.ProtocolError as exc:
            raise Error(f"malformed reply from {self.address}: {exc}") from None
        if isinstance(reply, protocol.ErrorReply):
            raise Refused(reply.error, reply.reason)
        if not isinstance(reply, expect):
            raise Error(f"the server answered {msg.kind!r} with {reply.kind!r}")
        return reply
