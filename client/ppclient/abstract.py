"""A client's result socket beside an ipc server, as a Linux abstract Unix socket (``ipc://@NAME``).

An abstract socket has no file: nothing is left when its process ends without its cleanup
(kill -9, or a DataLoader worker's os._exit). It has no folder either, whose mode would keep
other users out, so the socket admits only peers of this user: ZeroMQ tells a Unix peer's
credentials (SO_PEERCRED) in each message's Peer-Address property, ``...:UID:GID:PID``.
Where that cannot be checked (not Linux, or the check fails at bind), the caller binds in a
private folder instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

import zmq

PROBE_MS = 2000  # the bind's one message to itself, which shows that peers' users can be told


def peer_uid(frame: Any) -> Optional[int]:
    """The user id of the process that sent a message over a Unix socket (None: not told)."""
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return None
    parts = str(address).rsplit(":", 3)
    try:
        return int(parts[1]) if len(parts) == 4 else None
    except ValueError:
        return None


def bind(ctx: zmq.Context, sock: zmq.Socket, name: str, *, check_user: bool) -> str:
    """Bind `sock` (a ROUTER) to a new abstract address and return it; "" where that did not work
    (the socket stays unbound). `check_user` (a socket without CURVE, whose peers are told apart
    by their user): only once a message of this process to it has shown its user id."""
    if not sys.platform.startswith("linux"):
        return ""
    endpoint = f"ipc://@{name}-{os.getpid()}-{os.urandom(8).hex()}"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        return ""
    if not check_user:
        return endpoint
    probe = ctx.socket(zmq.DEALER)
    probe.linger = 0
    try:
        probe.connect(endpoint)
        probe.send(b"", flags=zmq.NOBLOCK)
        if sock.poll(PROBE_MS):
            frames = sock.recv_multipart(copy=False)
            if peer_uid(frames[-1]) == os.getuid():
                return endpoint
    except zmq.ZMQError:
        pass
    finally:
        probe.close(linger=0)
    sock.unbind(endpoint)
    return ""
