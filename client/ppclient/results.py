"""The socket a client binds for its map_seq results straight from the workers (docs/data-path.md).

Workers connect to it and say hello; the client welcomes each, mapping the result segment of a
worker on its host, so that from then on a result is a header naming a block of that segment.
With keys, only authorised worker keys are admitted. A malformed message or item from a worker
is dropped (the scheduler has it made again once the client reports it missing), its blocks
given back; both refusals and drops are counted and logged at most once a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Dict, List, Optional

import zmq

from . import abstract, curve, endpoints, keyfiles, protocol, shm
from .protocol import Channel, Peer
from .throttle import Throttled

log = logging.getLogger("ppclient")


class DirectResults:
    """A client's result socket (a ROUTER, bound by `bind()`) and the workers' segments it maps."""

    def __init__(self, ctx: zmq.Context, keys_dir: Optional[str], keys: Optional[keyfiles.ClientKeys], at: str = ""):
        self._ctx = ctx
        self._keys = keys
        self._authorized = tuple(keyfiles.authorized_keys(keys_dir)) if keys_dir and keys is not None else ()
        self._at = at  # the address to bind ("": a free port on the interface that reaches the server)
        self.sock: Optional[zmq.Socket] = None
        self.endpoint = ""  # where workers connect, once bound
        self.host = ""  # shared-memory host id, once bound ("": segments do not work here)
        self._dir: Optional[str] = None  # of an ipc endpoint
        self._same_user = False  # an abstract socket: only peers of this user are heard
        self._auth: Any = None
        self._mappings: Dict[bytes, shm.Mapping] = {}  # worker identity -> its result segment, mapped
        self.malformed = Throttled(log, "dropped a malformed direct result")
        self.refused = Throttled(log, "refused a worker's connection to the result socket")

    def bind(self, server: str) -> bool:
        """Bind beside the route to `server`'s address; False (logged): results come through the server."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.rcvhwm = 0
        if self._keys is not None:
            self._auth = curve.authenticator(self._ctx, self._authorized, self.refused.hit)
            sock.curve_server = True
            sock.curve_publickey = self._keys.public
            sock.curve_secretkey = self._keys.secret
        try:
            self._bind(sock, server)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning("cannot bind the socket for direct results (%s): they come through the server", str(exc))
            return False
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        bound = last.decode() if isinstance(last, bytes) else str(last)
        if endpoints.is_wildcard(bound):  # workers connect to the address this host reaches the server from
            host = endpoints.host_port(server)[0] if server.startswith("tcp://") else "127.0.0.1"
            bound = f"tcp://{endpoints.local_address_toward(host)}:{endpoints.host_port(bound)[1]}"
        self.endpoint = bound
        self.sock = sock
        self.host = shm.usable_host_id(log, "results from workers on this host come")
        return True

    def _bind(self, sock: zmq.Socket, server: str) -> None:
        """Bind where workers reach the socket: the address asked for; beside an ipc server an
        abstract socket (no file to leave behind), else one in a private folder; else TCP."""
        if not self._at and server.startswith("ipc://"):
            if abstract.bind(self._ctx, sock, "ppclient", check_user=self._keys is None):
                self._same_user = self._keys is None  # with keys, CURVE admits the workers
                return
            self._dir = tempfile.mkdtemp(prefix="ppclient-")
        sock.bind(self._at or endpoints.direct_bind(server, self._dir or "", "direct"))

    def receive(self, frames: List[Any]) -> Optional[protocol.Decoded]:
        """A worker's message (`frames`: its identity, then the message) as the client takes it;
        None for a hello (welcomed) or a message dropped as malformed."""
        if len(frames) < 2:
            return None
        if self._same_user and abstract.peer_uid(frames[-1]) != os.getuid():
            self.refused.hit(f"a peer of user {abstract.peer_uid(frames[-1])} is not this user")
            return None
        try:
            decoded = protocol.decode(frames[1:], Peer.CLIENT, (Channel.DIRECT,))
        except protocol.ProtocolError as exc:
            self._drop_malformed(frames, str(exc))
            return None  # a worker's bad message: what it should have carried is made again (missing)
        if isinstance(decoded.msg, protocol.DirectHello):
            self._welcome(frames[0].bytes, decoded.msg)
            return None
        if any(item.block is not None for item in decoded.items):
            decoded.bad += protocol.resolve_blocks(decoded.items, self._mappings.get(frames[0].bytes))
        if decoded.bad:  # bad items: reported missing in time, made again
            self._drop_malformed(frames, decoded.bad[0].reason, decoded)
        return decoded

    def _welcome(self, ident: bytes, hello: protocol.DirectHello) -> None:
        """A worker connected: it may send results directly from now on."""
        assert self.sock is not None
        self.unmap_gone()
        mapped = self._map(ident, hello.shm)
        try:
            self.sock.send_multipart(
                [ident, *protocol.encode(protocol.DirectWelcome(shm=mapped, pid=os.getpid()))], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass

    def _map(self, ident: bytes, descriptor: Optional[Dict[str, Any]]) -> bool:
        """Map the result segment a worker on this host offers; what that identity had mapped
        before is given back. False: its results come in the messages."""
        old = self._mappings.pop(ident, None)
        try:
            if descriptor is None or not self.host or descriptor.get("host") != self.host:
                return False  # none offered, another host, or no shared memory here
            try:
                mapping = self._mappings[ident] = shm.Mapping.open(descriptor)
                self._unmap_older(ident, mapping)
                return True
            except shm.ShmUnavailable as exc:
                log.warning(  # the text, not the exception: a kept log record would keep its frames alive
                    "results of worker %s come over the socket: cannot map its shared memory: %s",
                    ident.decode(errors="replace"),
                    str(exc),
                )
                return False
        finally:
            if old is not None:
                old.close()

    def _unmap_older(self, ident: bytes, mapping: shm.Mapping) -> None:
        """A worker that registered again (its server restarted, say) says hello under a new identity:
        the segment mapped for its old one is given back."""
        for other, old in list(self._mappings.items()):
            if other != ident and old.descriptor.pid == mapping.descriptor.pid:
                del self._mappings[other]
                old.close()

    def unmap_gone(self) -> None:
        """Give back the segments of workers that exited or closed them (no block will come from
        them any more); each is unmapped once the arrays of it are dropped."""
        for ident, mapping in list(self._mappings.items()):
            if mapping.producer_gone():
                del self._mappings[ident]
                mapping.close()

    def _drop_malformed(self, frames: List[Any], reason: str, decoded: Optional[protocol.Decoded] = None) -> None:
        """Count and log (now and then) a worker's message, or the items of it, that cannot be
        used, and give back the shared-memory blocks they name: nobody else would."""
        ident = frames[0].bytes
        bad = decoded.bad if decoded is not None else []
        self.malformed.hit(f"from worker {ident.decode(errors='replace')}: {reason}", max(len(bad), 1))
        mapping = self._mappings.get(ident)
        if mapping is not None:
            for ref in protocol.unused_blocks(frames[1:], decoded.items if decoded is not None else []):
                mapping.discard(ref)  # a block good seqs of the message use stays theirs
        if decoded is not None:
            decoded.bad = []

    def stop(self) -> None:
        """Take no more results: what is still in the socket or on its way is left to the workers."""
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    def close(self) -> bool:
        """Stop, and give back every segment, the authenticator and an ipc endpoint's directory.
        False: the authenticator's thread could not be stopped (the interpreter finalizes, so the
        thread runs no more), and its socket stays open."""
        self.stop()
        mappings, self._mappings = list(self._mappings.values()), {}
        for mapping in mappings:
            mapping.close()
        stopped = True
        if self._auth is not None:
            if sys.is_finalizing():  # its stop() would join the thread without a timeout
                stopped = False
            else:
                self._auth.stop()
            self._auth = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        return stopped
