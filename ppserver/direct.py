"""A worker's connections to the consumers it sends results to directly.

The server names each consumer's direct endpoint (`route`); the worker connects one DEALER
per consumer and says `direct_hello`. Results go there only once the consumer has answered
`direct_welcome`: a consumer the worker cannot reach (a firewall, a wrong address) never
gets results that would then sit in a queue; they go through the server instead. A send
that would block (the consumer's queue is full: it is gone or stuck) also falls back to
the server, so no worker ever waits for a consumer.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import zmq

from ppclient import keyfiles, protocol, shm
from ppclient.protocol import Channel, Item, Peer

log = logging.getLogger("ppserver.worker")

SNDHWM = 64  # messages queued per consumer before sends fall back to the server
UNREACHABLE_S = 10.0  # no welcome within this long: logged once (results keep going through the server)


@dataclass
class Route:
    consumer: bytes
    endpoint: str
    sock: zmq.Socket
    since: float
    ready: bool = False
    shm: bool = False
    pid: int = 0  # the consumer's process (shared memory: its exit frees what it held)
    warned: bool = False
    sent: int = 0
    fell_back: int = 0
    pending: List[Any] = field(default_factory=list)


class Routes:
    def __init__(self, ctx: zmq.Context, keys: Optional[keyfiles.ClientKeys]):
        self.ctx = ctx
        self.keys = keys
        self.identity = b""
        self.routes: Dict[bytes, Route] = {}
        self.shm_descriptor: Optional[Dict[str, Any]] = None  # offered to consumers on this host
        self.host = ""
        self.ring: Optional[shm.Ring] = None  # this worker's result segment
        self.departed: Dict[bytes, int] = {}  # consumers gone, whose process still holds blocks: their pid
        self._reaped_at = 0.0

    def set(self, msg: protocol.ConsumerRoute) -> None:
        old = self.routes.get(msg.consumer)
        if old is not None and old.endpoint == msg.endpoint:
            return
        self.drop(msg.consumer)
        if self.keys is not None and not msg.key:
            log.warning("consumer %r has no CURVE key: its results go through the server", msg.consumer[:16])
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = self.identity
        sock.sndhwm = SNDHWM
        sock.immediate = True  # nothing queues for a consumer not connected (yet)
        if self.keys is not None:
            sock.curve_publickey = self.keys.public
            sock.curve_secretkey = self.keys.secret
            sock.curve_serverkey = msg.key
        try:
            sock.connect(msg.endpoint)
        except zmq.ZMQError as exc:
            log.warning("cannot connect to consumer %r at %s: %s", msg.consumer[:16], msg.endpoint, exc)
            sock.close(linger=0)
            return
        route = Route(msg.consumer, msg.endpoint, sock, time.monotonic())
        self.routes[msg.consumer] = route
        shm = self.shm_descriptor if msg.host and msg.host == self.host else None
        route.pending = protocol.encode(protocol.DirectHello(worker=self.identity, shm=shm))
        self._hello(route)

    def _hello(self, route: Route) -> None:
        """Send the hello once the connection is up (immediate: sends before that fail)."""
        if not route.pending:
            return
        try:
            route.sock.send_multipart(route.pending, flags=zmq.NOBLOCK)
            route.pending = []
        except zmq.Again:
            pass

    def drop(self, consumer: bytes, gone: bool = False) -> None:
        """Close the connection; `gone`: the consumer left. The blocks it held are free once its
        process has exited (before that, arrays it yielded may still be in use: it frees each
        itself when they are dropped)."""
        route = self.routes.pop(consumer, None)
        if route is not None:
            route.sock.close(linger=0)
        if gone and self.ring is not None:
            pid = route.pid if route is not None and route.shm else 0
            if pid and os.path.exists(f"/proc/{pid}"):
                self.departed[consumer] = pid
            else:
                self.ring.release_owner(consumer)

    def _reap_departed(self) -> None:
        for consumer, pid in list(self.departed.items()):
            if not os.path.exists(f"/proc/{pid}"):
                del self.departed[consumer]
                if self.ring is not None:
                    self.ring.release_owner(consumer)

    def clear(self) -> None:
        for consumer in list(self.routes):
            self.drop(consumer)

    def poll(self) -> None:
        """Take welcomes; (re)send hellos not yet sent; log consumers that never answer."""
        now = time.monotonic()
        if self.departed and now - self._reaped_at >= 1.0:
            self._reaped_at = now
            self._reap_departed()
        for route in self.routes.values():
            if route.ready:
                continue
            self._hello(route)
            while route.sock.poll(0):
                try:
                    msg = protocol.decode(route.sock.recv_multipart(), Peer.WORKER, (Channel.DIRECT,)).msg
                except protocol.ProtocolError as exc:
                    log.warning("dropped a malformed message from consumer %r: %s", route.consumer[:16], exc)
                    continue
                if isinstance(msg, protocol.DirectWelcome):
                    route.ready = True
                    route.shm = msg.shm
                    route.pid = msg.pid
                    log.info(
                        "sending results directly to consumer %s at %s%s",
                        route.consumer.hex()[:12],
                        route.endpoint,
                        " (shared memory)" if msg.shm else "",
                    )
            if not route.ready and not route.warned and now - route.since > UNREACHABLE_S:
                route.warned = True
                log.warning(
                    "consumer %s at %s has not answered for %.0f s: its results go through the server",
                    route.consumer.hex()[:12],
                    route.endpoint,
                    now - route.since,
                )

    def shared(self, consumer: bytes) -> bool:
        """Whether results for `consumer` go through shared memory (while its ring has room)."""
        route = self.routes.get(consumer)
        return route is not None and route.ready and route.shm and self.ring is not None

    def send(self, consumer: bytes, run: int, items: List[Item]) -> bool:
        """Send results straight to their consumer; False if they must go through the server."""
        route = self.routes.get(consumer)
        if route is None or not route.ready:
            return False
        block = None
        wire = items
        if route.shm and self.ring is not None:
            wire, block = protocol.to_block(items, self.ring, consumer)
        try:
            route.sock.send_multipart(
                protocol.encode(protocol.DirectSeqs(run=run), wire), copy=False, flags=zmq.NOBLOCK
            )
        except zmq.ZMQError:  # full queue (Again), or a socket in trouble
            if block is not None:
                block.release()  # nobody will read it: the results go through the server
            route.fell_back += 1
            return False
        route.sent += len(items)
        return True
