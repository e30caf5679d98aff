"""A worker's connections to the consumers it sends results to directly.

The server names each consumer's direct endpoint (`route`); the worker connects one DEALER
per consumer and says `direct_hello`. Results go there only once the consumer has answered
`direct_welcome`: a consumer the worker cannot reach (a firewall, a wrong address) never
gets results that would then sit in a queue; they go through the server instead. A send
that would block (the consumer's queue is full: it is gone or stuck) also falls back to
the server, so no worker ever waits for a consumer.

A consumer on this host gets the arrays in blocks of this worker's segment (`segment`) and frees
each block itself when it drops the arrays. The blocks of a consumer are freed once its
process has exited (only then can none of its arrays be in use), whether the server said it
is gone, this worker lost the server, or nobody has noticed yet (a kill -9): the worker
looks at its consumers' processes about once a second. A consumer that closed (the server
says so) takes no block any more: those it never made arrays of (unread in its socket, or
on the way when it closed) are freed at once, though its process lives on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import zmq

from ppclient import keyfiles, protocol, shm
from ppclient.protocol import Channel, Item, Peer
from ppclient.throttle import Throttled

log = logging.getLogger("ppserver.worker")

SNDHWM = 64  # messages queued per consumer before sends fall back to the server
UNREACHABLE_S = 10.0  # no welcome within this long: logged once (results keep going through the server)
FALLBACK_LOG_S = 10.0  # at most one log line this often about results that took a slower path

Process = Tuple[int, int]  # pid and start time: a later process reusing the pid is another one


def process(pid: int) -> Optional[Process]:
    """The live process `pid` (on this host), or None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] == b"Z" else (pid, int(fields[19]))  # field 22 of the line: its start time
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Route:
    consumer: bytes
    endpoint: str
    sock: zmq.Socket
    since: float
    ready: bool = False
    shm: bool = False
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
        self.host = ""  # shared-memory host id ("": no shared memory here)
        self.shm_mb = 0
        self.segment: Optional[shm.Segment] = None  # this worker's result segment, made for the first consumer here
        self.holders: Dict[bytes, Process] = {}  # consumers welcomed with shared memory: their process
        self.departed: Dict[bytes, Process] = {}  # consumers gone (or out of reach) whose process may hold blocks
        self._reaped_at = 0.0
        self.over_socket = Throttled(log, "results went over the socket", FALLBACK_LOG_S)  # the segment was full
        self.via_server = Throttled(log, "results went through the server", FALLBACK_LOG_S)  # a send failed

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
        shm = self._segment() if msg.host and msg.host == self.host else None
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

    def drop(self, consumer: bytes, gone: bool = False, closed: bool = False) -> None:
        """Close the connection; `gone`: the consumer left. The blocks it held are free once its
        process has exited (before that, arrays it yielded may still be in use: it frees each
        itself when they are dropped). `closed`: it said it closed, so it will never take the
        blocks it has not taken yet: they are free now."""
        route = self.routes.pop(consumer, None)
        if route is not None:
            route.sock.close(linger=0)
        if closed and self.segment is not None:
            n = self.segment.release_owner(consumer, taken=False)
            if n:
                log.info("freed %d shared-memory blocks consumer %s never took: it closed", n, consumer.hex()[:12])
        if gone:
            self._depart(consumer)

    def _depart(self, consumer: bytes) -> None:
        """Free the consumer's blocks once its process is gone (at once if it is, or never held any)."""
        proc = self.holders.pop(consumer, None)
        if self.segment is None:
            return
        if proc is not None and process(proc[0]) == proc:
            self.departed[consumer] = proc
        else:
            self._free(consumer)

    def _segment(self) -> Optional[Dict[str, Any]]:
        """The descriptor of the result segment for consumers on this host, made on first use (a
        worker with none on its host commits no memory for it); if it cannot be had, results go
        over the socket (logged once)."""
        if self.segment is None and self.host:
            try:
                self.segment = shm.Segment(self.shm_mb << 20)
            except (OSError, ValueError, shm.ShmUnavailable) as exc:
                log.warning(
                    "results go over sockets: no shared-memory segment of %d MiB for them: %s", self.shm_mb, str(exc)
                )
                self.host = ""
                return None
        return self.segment.descriptor.to_dict() if self.segment is not None else None

    def _reap(self) -> None:
        """Free the blocks of consumers whose process has exited (and give them no new ones)."""
        for held in (self.departed, self.holders):
            for consumer, proc in list(held.items()):
                if process(proc[0]) != proc:
                    del held[consumer]
                    self._free(consumer)
                    route = self.routes.get(consumer)
                    if route is not None:
                        route.shm = False

    def _free(self, consumer: bytes) -> None:
        if self.segment is not None:
            n = self.segment.release_owner(consumer)
            if n:
                log.info("freed %d shared-memory blocks of consumer %s, which is gone", n, consumer.hex()[:12])

    def clear(self) -> None:
        """Drop every route (the server was lost). A consumer may come back through the next
        server, or die meanwhile, unheard of: either way its blocks are freed when its process exits."""
        for consumer in list(self.routes):
            self.drop(consumer)
        for consumer in list(self.holders):
            self._depart(consumer)

    def untaken(self) -> int:
        """Result blocks consumers on this host have not taken yet (see Segment.untaken)."""
        return self.segment.untaken() if self.segment is not None else 0

    def stats(self) -> Dict[str, int]:
        """Counters for the worker's heartbeats (see docs/protocol.md)."""
        return {"results_over_socket": self.over_socket.count, "results_via_server": self.via_server.count}

    def poll(self) -> None:
        """Take welcomes; (re)send hellos not yet sent; log consumers that never answer."""
        now = time.monotonic()
        if (self.departed or self.holders) and now - self._reaped_at >= 1.0:
            self._reaped_at = now
            self._reap()
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
                    self._hold(route.consumer, msg.pid if route.shm else 0)
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
        """Whether results for `consumer` go through shared memory (while its segment has room)."""
        route = self.routes.get(consumer)
        return route is not None and route.ready and route.shm and self.segment is not None

    def _hold(self, consumer: bytes, pid: int) -> None:
        """The consumer maps this worker's segment: note its process, whose exit frees its blocks."""
        proc = process(pid) if pid > 0 else None
        if proc is not None:
            self.holders[consumer] = proc

    def block_for(self, consumer: bytes, nbytes: int) -> Optional[shm.Block]:
        """A block of the segment for a result to `consumer` to be laid out in (a padded batch), if it
        takes results through shared memory and the segment has room (else the result is padded in
        ordinary memory, and sending it tries the segment again: see _pack)."""
        if not self.shared(consumer):
            return None
        assert self.segment is not None
        return self.segment.alloc(nbytes, consumer)

    def _full(self, consumer: bytes, n: int) -> None:
        segment = self.segment
        assert segment is not None
        self.over_socket.hit(
            lambda: (
                f"the shared-memory segment is full ({segment.used() / 2**20:.1f} of "
                f"{segment.capacity / 2**20:.1f} MiB in use; consumer {consumer.hex()[:12]})"
            ),
            n,
        )

    def _pack(self, consumer: bytes, items: List[Item]) -> Tuple[List[Item], Optional[shm.Block]]:
        """The items with their arrays in one block of the segment; if it has no room, they keep
        them (counted, logged now and then)."""
        assert self.segment is not None
        wire, block = protocol.to_block(items, self.segment, consumer)
        if block is None:
            loose = sum(1 for item in items if item.block is None and item.frames)
            if loose:
                self._full(consumer, loose)
        return wire, block

    def send(self, consumer: bytes, run: int, items: List[Item]) -> bool:
        """Send results straight to their consumer; False if they must go through the server."""
        route = self.routes.get(consumer)
        if route is None or not route.ready:
            return False
        block: Optional[shm.Block] = None
        wire = items
        if route.shm and self.segment is not None:
            wire, block = self._pack(consumer, items)
        try:
            route.sock.send_multipart(
                protocol.encode(protocol.DirectSeqs(run=run), wire), copy=False, flags=zmq.NOBLOCK
            )
        except BaseException as exc:  # full queue (Again), a socket in trouble, or nothing sent at all
            if block is not None:
                block.release()  # nobody will read it: the results go through the server
            if not isinstance(exc, zmq.ZMQError):
                raise
            route.fell_back += 1
            self.via_server.hit(f"consumer {consumer.hex()[:12]} cannot take them now ({exc})", len(items))
            return False
        route.sent += len(items)
        return True
