"""A worker's session with the server: discovery, registration, heartbeats, losing the server.

The worker learns the worker endpoint from the control address (DiscoverRequest), registers
with its protocol version and config fingerprint (Hello) and then keeps a heartbeat thread
with its own socket, so the server hears from it while a mapper runs, and how far it is into the
batch it maps (a slow batch is progress, a stuck mapper is not). The session is lost
when the server stops answering heartbeats for heartbeat_timeout, says it does not know
this worker (Unknown), or the connection is reset (a reset loses queued messages both
ways); the worker then drops its work and registers afresh under a new identity that names
the old one, so the server redoes the old identity's work at once.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import zmq

from ppclient import endpoints, protocol, shm
from ppclient.keyfiles import ClientKeys
from ppclient.protocol import Channel, Peer
from ppserver.transport import cma

log = logging.getLogger("ppserver.worker")

BACKOFF_START = 0.25
BACKOFF_MAX = 4.0
POLL_MS = 50


class Refused(Exception):
    """The server refused this worker (protocol or config mismatch): retrying cannot help."""


class Stopped(BaseException):
    """The worker is stopping (SIGTERM) or its session is lost. A BaseException: it is raised
    inside a stream's input iterator too, and must not look like the mapper failing."""


class Heartbeat(threading.Thread):
    """Sends heartbeats on its own socket and watches the server's."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        identity: bytes,
        interval: float,
        keys: Optional[ClientKeys],
        stats: Optional[Callable[[], Dict[str, Any]]] = None,
        mapping: Optional[Callable[[], Optional[List[int]]]] = None,
    ):
        super().__init__(name="heartbeat", daemon=True)
        self.stats = stats  # the worker's counters, sent with every beat
        self.mapping = mapping  # the batch being mapped and how far, sent with every beat
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.identity = identity + protocol.HEARTBEAT_SUFFIX
        if keys is not None:
            keys.apply(self.sock)
        self.sock.connect(endpoint)
        self.interval = interval
        self.stop_event = threading.Event()
        self.server_seen = time.monotonic()
        self.forgotten = False

    def run(self) -> None:
        next_send = 0.0
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now >= next_send:
                    beat = protocol.Heartbeat(
                        stats=self.stats() if self.stats is not None else None,
                        mapping=self.mapping() if self.mapping is not None else None,
                    )
                    self.sock.send_multipart(protocol.encode(beat), flags=zmq.NOBLOCK)
                    next_send = now + self.interval
                if self.sock.poll(int(min(self.interval, 0.2) * 1000)):
                    frames = self.sock.recv_multipart()
                    self.server_seen = time.monotonic()
                    try:
                        msg = protocol.decode(frames, Peer.WORKER, (Channel.WORKER,)).msg
                    except protocol.ProtocolError:
                        continue
                    if isinstance(msg, protocol.Unknown):
                        self.forgotten = True
        except zmq.ZMQError:
            pass
        finally:
            self.sock.close(linger=0)


class Session:
    def __init__(
        self,
        ctx: zmq.Context,
        *,
        connect: str,
        fingerprint: str,
        heartbeat_interval: float,
        heartbeat_timeout: float,
        keys: Optional[ClientKeys],
        worker_endpoint: Optional[str] = None,
        local_index: Optional[int] = None,
        shm_mb: int = 0,
        stats: Optional[Callable[[], Dict[str, Any]]] = None,
        mapping: Optional[Callable[[], Optional[List[int]]]] = None,
    ):
        self.ctx = ctx
        self.connect = connect
        self.fingerprint = fingerprint
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.keys = keys
        self.worker_endpoint = worker_endpoint
        self.local_index = local_index
        self.stats = stats
        self.mapping = mapping
        self.host = socket.gethostname()
        self.stopping = False
        self.sock: Optional[zmq.Socket] = None
        self.templates: Dict[str, Any] = {}
        self.inputs: Dict[str, Any] = {}
        # Shared memory: the host id offered in hello (when segments work here), the server's
        # input segment once mapped.
        self.host_id = shm.usable_host_id(log, "inputs and results go") if shm_mb > 0 else ""
        self.input_mapping: Optional[shm.Mapping] = None
        self.input_reader: Optional[cma.Reader] = None  # reads inputs in the server's memory
        self.identity: Optional[bytes] = None
        self.forgotten = False
        self._hb: Optional[Heartbeat] = None
        self._monitor: Optional[zmq.Socket] = None

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        if self.keys is not None:
            self.keys.apply(sock)
        return sock

    # ---- registration ---------------------------------------------------------------------
    def discover(self) -> str:
        """Ask the control address for the worker endpoint, retrying with backoff until it answers."""
        if self.worker_endpoint:  # a local worker of the server: told where to connect
            return self.worker_endpoint
        delay = BACKOFF_START
        attempt = 0
        while not self.stopping:
            attempt += 1
            req = self._socket(zmq.REQ)
            req.connect(self.connect)
            try:
                req.send_multipart(protocol.encode(protocol.DiscoverRequest()))
                if req.poll(int(max(self.heartbeat_interval, 1.0) * 1000)):
                    reply = protocol.decode(req.recv_multipart(), Peer.WORKER, (Channel.CONTROL,)).msg
                    if isinstance(reply, protocol.ErrorReply):
                        raise Refused(reply.error)
                    if isinstance(reply, protocol.DiscoverReply):
                        return endpoints.reachable(reply.worker_endpoint, self.connect)
            except protocol.VersionMismatch as exc:
                raise Refused(protocol.mismatch_text(exc.theirs, "the server")) from None
            except protocol.ProtocolError as exc:
                log.warning("bad reply from %s: %s", self.connect, exc)
            finally:
                req.close(linger=0)
            if attempt == 1 or attempt % 10 == 0:
                log.info("waiting for server at %s (attempt %d)", self.connect, attempt)
            self.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
        raise Stopped()

    def register(self, endpoint: str) -> bool:
        """Say hello; True once welcomed. Raises Refused if the server refuses this worker."""
        identity = f"{self.host}:{os.getpid()}:{random.getrandbits(32):08x}".encode()
        replaces, self.identity = self.identity, identity
        sock = self._socket(zmq.DEALER)
        sock.identity = identity
        sock.rcvhwm = 0
        sock.sndhwm = 0
        sock.connect(endpoint)
        sock.send_multipart(
            protocol.encode(
                protocol.Hello(
                    fingerprint=self.fingerprint,
                    host=self.host,
                    pid=os.getpid(),
                    local_index=self.local_index,
                    replaces=replaces,
                    host_id=self.host_id,
                )
            )
        )
        deadline = time.monotonic() + self.heartbeat_timeout
        while time.monotonic() < deadline and not self.stopping:
            if not sock.poll(POLL_MS):
                continue
            try:
                msg = protocol.decode(sock.recv_multipart(), Peer.WORKER, (Channel.WORKER,)).msg
            except protocol.VersionMismatch as exc:
                sock.close(linger=0)
                raise Refused(protocol.mismatch_text(exc.theirs, "the server")) from None
            except protocol.ProtocolError as exc:
                log.warning("dropped a malformed message from the server: %s", exc)
                continue
            if isinstance(msg, protocol.Refuse):
                sock.close(linger=0)
                raise Refused(msg.reason)
            if isinstance(msg, protocol.Welcome):
                self.templates = msg.templates
                self.inputs = msg.inputs
                self._map_inputs(sock, msg.shm, msg.cma)
                self.sock = sock
                self.forgotten = False
                self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self._hb = Heartbeat(
                    self.ctx, endpoint, identity, self.heartbeat_interval, self.keys, self.stats, self.mapping
                )
                self._hb.start()
                log.info("registered with %s as %s", endpoint, identity.decode())
                return True
        sock.close(linger=0)
        return False

    def unregister(self, *, say_bye: bool) -> None:
        if self._monitor is not None:
            if self.sock is not None:
                self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self.sock is not None:
            if say_bye:
                try:
                    self.sock.send_multipart(protocol.encode(protocol.Bye()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                time.sleep(0.05)  # let the bye leave before the socket closes
            self.sock.close(linger=0)
            self.sock = None
        if self._hb is not None:
            self._hb.stop_event.set()
            self._hb.join(timeout=2)
            self._hb = None
        self._unmap_inputs()

    def _unmap_inputs(self) -> None:
        """The server's input segment is of no use without it (another server offers its own)."""
        if self.input_mapping is not None:
            self.input_mapping.close()  # unmapped once the arrays of it are gone
            self.input_mapping = None
        self.input_reader = None

    # ---- while registered -----------------------------------------------------------------------
    def lost(self) -> bool:
        hb = self._hb
        if hb is None or self.forgotten:
            return True
        if self._monitor is not None and self._monitor.poll(0):
            log.warning("the connection to the server was reset; registering again")
            self.forgotten = True
            return True
        return hb.forgotten or time.monotonic() - hb.server_seen > self.heartbeat_timeout

    def send(self, msg: protocol.Message, items: Any = ()) -> None:
        assert self.sock is not None
        self.sock.send_multipart(protocol.encode(msg, items), copy=False)

    def report(self, dropped: protocol.Dropped) -> None:
        """Tell the server a message of its was dropped, so that it redoes (or fails) what it carried
        instead of waiting for it."""
        where = f" of run {dropped.run}" if dropped.run is not None else ""
        log.warning("dropped a %s message%s from the server: %s", dropped.what or "malformed", where, dropped.reason)
        self.send(dropped)

    def receive(self, timeout_ms: int) -> List[protocol.Decoded]:
        """Every message waiting (waits up to timeout_ms for the first); one that does not decode is
        reported to the server."""
        sock = self.sock
        assert sock is not None
        out: List[protocol.Decoded] = []
        if not sock.poll(timeout_ms):
            return out
        while int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
            frames = sock.recv_multipart(copy=False)
            try:
                decoded = protocol.decode(frames, Peer.WORKER, (Channel.WORKER,))
            except protocol.ProtocolError as exc:
                self.report(protocol.dropped(frames, str(exc)))
                continue
            if isinstance(decoded.msg, protocol.Unknown):
                self.forgotten = True
                raise Stopped()
            if decoded.items:
                decoded.unreadable = cma.resolve_spans(decoded.items, self.input_reader)
                decoded.unreadable += protocol.resolve_blocks(decoded.items, self.input_mapping)
            if (decoded.bad or decoded.unreadable) and self.input_mapping is not None:
                for ref in protocol.unused_blocks(frames, decoded.items):
                    self.input_mapping.discard(ref)  # nobody else would give them back
            out.append(decoded)
        return out

    def _map_inputs(
        self, sock: zmq.Socket, descriptor: Optional[Dict[str, Any]], offer: Optional[Dict[str, Any]]
    ) -> None:
        """Map the server's segment and check whether its memory can be read; say which works."""
        self._unmap_inputs()  # of an earlier registration
        if descriptor is None and offer is None:
            return
        ok, reason = False, "no segment offered"
        if descriptor is not None:
            try:
                self.input_mapping = shm.Mapping.open(descriptor)
                ok, reason = True, ""
            except shm.ShmUnavailable as exc:
                reason = str(exc)[:500]
        self.input_reader, why_not = cma.check_offer(offer) if offer is not None else (None, "not offered")
        if self.input_reader is not None:
            log.info("inputs are read in the server's memory (process_vm_readv)")
        elif ok:
            log.info("inputs come through the server's shared memory (reading its memory: %s)", why_not)
        else:
            log.warning("inputs come over the socket: cannot map the server's shared memory: %s", reason)
        reply = protocol.ShmMapped(ok=ok, reason=reason, cma=self.input_reader is not None)
        sock.send_multipart(protocol.encode(reply))

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.05, end - time.monotonic()))
