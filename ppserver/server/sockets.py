"""The server's ZeroMQ sockets: binding them (with CURVE where keys are given), watching their
handshakes, sending without blocking, and dropping junk of too many frames as it is read."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, List, Optional

import zmq

from ppclient import curve, keyfiles
from ppclient.throttle import Throttled
from ppserver.worker import memory

log = logging.getLogger("ppserver.server")

# The memory of a message of more frames than allowed (ZeroMQ assembles it whole before the loop
# can look at it) is given back to the OS as it is dropped, at most once in this many seconds.
GIVE_BACK_S = 1.0


def authenticator(ctx: zmq.Context, keys: Optional[keyfiles.ServerKeys], refused: Throttled) -> Any:
    """Accept only clients and workers whose public key is authorised. A refusal is logged through
    the `refused` throttle but counted by the handshake monitor, which sees the handshake fail."""
    if keys is None:
        return None
    auth_log = logging.getLogger("ppserver.auth")
    return curve.authenticator(ctx, keys.authorized, lambda why: refused.hit(why, 0), auth_log)


def router(ctx: zmq.Context, endpoint: str, max_bytes: int, keys: Optional[keyfiles.ServerKeys]) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.router_mandatory = 1
    sock.sndhwm = 0
    sock.rcvhwm = 0
    sock.maxmsgsize = max_bytes
    if keys is not None:
        keys.apply(sock)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise OSError(f"cannot bind {endpoint}: {exc}") from None
    return sock


def endpoint_of(sock: zmq.Socket) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def handshake_monitors(socks: List[zmq.Socket]) -> List[zmq.Socket]:
    """Watch CURVE handshakes so that peers with wrong or missing keys show up in the log."""
    events = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    events |= zmq.EVENT_HANDSHAKE_FAILED_AUTH
    return [sock.get_monitor_socket(events) for sock in socks]


def read_monitor(sock: zmq.Socket, refused: Throttled) -> None:
    from zmq.utils.monitor import recv_monitor_message

    while True:
        try:
            event = recv_monitor_message(sock, flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        refused.hit(
            f"on {event.get('endpoint', b'?').decode(errors='replace')}: CURVE handshake failed "
            f"({zmq.Event(event['event']).name}; wrong or missing keys)"
        )


def send(sock: zmq.Socket, frames: List[Any]) -> bool:
    """False if not sent: the peer is gone (ROUTER_MANDATORY) or it would block."""
    try:
        sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        return True
    except zmq.ZMQError as exc:
        log.debug("send failed: %s", exc)
        return False


class Junk:
    """Receives messages of at most so many frames; longer ones are dropped and counted."""

    def __init__(self, malformed: Throttled):
        self.malformed = malformed
        self.given_back_at = float("-inf")

    def recv_at_most(self, sock: zmq.Socket, max_frames: int) -> Optional[List[zmq.Frame]]:
        """The next message, or None if it has more than `max_frames` frames: such junk is dropped
        frame by frame as it is read (ZeroMQ holds the whole message already), and its memory is
        given back to the OS (at most once a GIVE_BACK_S)."""
        frames = [sock.recv(copy=False)]
        while frames[-1].more and len(frames) <= max_frames:
            frames.append(sock.recv(copy=False))
        if len(frames) <= max_frames:
            return frames
        count, nbytes, more = len(frames), sum(len(f) for f in frames), frames[-1].more
        now = time.monotonic()
        give_back = now - self.given_back_at >= GIVE_BACK_S
        if give_back:
            self.given_back_at = now
        with memory.given_back() if give_back else contextlib.nullcontext():
            frames.clear()
            while more:
                frame = sock.recv(copy=False)
                count, nbytes, more = count + 1, nbytes + len(frame), frame.more
                del frame  # freed at once
        self.malformed.hit(f"a control message of {count} frames ({nbytes} bytes); control messages have {max_frames}")
        return None
