"""The training-side client: ask for an epoch (this rank's shard of it), iterate its seqs in order.

Requests go over a REQ socket; a request that gets no answer within `timeout` closes the
socket (a REQ whose reply is lost can never send again) and raises ServerUnavailable.
An epoch's seqs arrive on a DEALER socket: the client grants the server credit for
`window` seqs and tops it up as it consumes them, so the server never sends more than
the trainer takes. While a run is live the server sends a keepalive every heartbeat
interval, which tells a slow epoch (an Error naming what it waits for) from a dead server
(ServerUnavailable); a wait for other readers of the job whose clients live (room in their
windows) is neither, and lasts as long as they do. A small thread
with its own socket tells the server, about once a second, that this client lives, so a
trainer busy with something else for a while (a validation pass, a checkpoint) keeps its
shard and its job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, NoReturn, Optional, Tuple, Union

import msgpack
import zmq

from . import collate, endpoints, keyfiles, protocol, shm, wire
from .batching import Batching
from .errors import DatasetError, Error, MapperError, ServerUnavailable, Superseded, UsageError
from .protocol import Batch, Channel, Item, Peer
from .throttle import Throttled

log = logging.getLogger("ppclient")

# The server is alive if something came within this many of its heartbeat intervals.
KEEPALIVE_MISSES = 2
MISSING_AFTER = 2.0  # heartbeat intervals a client waits for its next direct seq before saying it is missing
ALIVE_INTERVAL_S = 1.0  # how often the client tells the server it lives (at most a quarter of its timeout)
STATE_KEYS = ("job", "epoch", "rank", "world_size", "position", "fingerprint", "drop_last", "subshard")
REQUEST_RETRY_S = (
    2.5  # a request unanswered this long is sent again on a new connection (the server may have restarted)
)
PROBE_WAIT_S = 1.0  # how long a client that hears nothing of its run waits for the answer to `info`
PROBE_EVERY_S = 1.0  # and how often it asks again while the silence lasts
MAX_INT = 2**63 - 1  # what a message can carry
MAX_TIMEOUT_S = 365 * 86400.0


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_INT:
        raise UsageError(f"{name} must be an int from {minimum} to 2**63 - 1, got {value!r}")
    return value


def seq_selection(seq_list: Optional[List[str]], seq_order: Optional[List[int]]) -> Optional[str]:
    """A digest of an epoch's seq_list or seq_order (None: the whole epoch), kept in resume states
    so that a state is resumed only with the same selection."""
    if seq_list is None and seq_order is None:
        return None
    kind, values = ("seq_list", seq_list) if seq_list is not None else ("seq_order", seq_order)
    digest = hashlib.sha256(msgpack.packb([kind, values])).hexdigest()[:32]
    return f"{kind} of {len(values or ())} entries, sha256 {digest}"


class Client:
    """Connection to one ppserver, as rank `rank` of `world_size` ranks of job `job`.

    Each rank gets the seqs at positions i with i % world_size == rank (strided, as PyTorch's
    DistributedSampler), in order; with drop_last (the default) every rank gets the same
    number, the remainder of the epoch being dropped, so DDP ranks take equally many steps.
    `subshard=(i, n)` splits the rank's shard among n readers (a DataLoader's workers): this
    client takes every n-th seq of it from the i-th on; n readers taken from in turn yield the
    rank's seqs in their order. Use as a context manager or call close().

    `direct`: map_seq results come straight from the workers to a socket this client binds
    (True: a free port on the interface that reaches the server, or loopback/ipc beside a local
    server; "tcp://HOST:PORT": that address, e.g. a port a firewall lets through; False: every
    result through the server). Workers on this host hand over array bytes in shared memory.

    `batching`: how the job's epochs are cut into batches (a dict of ppclient.batching's keys:
    max_seqs, max_frames, length_key, bucket_window, pad), the same for every rank of a job;
    None: as the server's config says; False: one seq at a time. With batches, an epoch yields
    padded batches and every count, `start` and `window` counts batches.

    Bad arguments (an address that is not tcp://HOST:PORT or ipc://PATH, a missing keys
    directory or key file, a rank not below world_size) raise UsageError here, before any
    socket exists.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 30.0,
        window: int = 32,
        keys: Optional[str] = None,
        rank: int = 0,
        world_size: int = 1,
        job: str = "default",
        drop_last: bool = True,
        subshard: Tuple[int, int] = (0, 1),
        direct: Union[bool, str] = True,
        batching: Union[bool, Dict[str, Any], None] = None,
    ):
        self.address = endpoints.check(address, "address")
        self.batching = _batching_arg(batching)
        _int_arg("window", window, 1)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise UsageError(f"timeout must be a number of seconds > 0 and at most {MAX_TIMEOUT_S:g}, got {timeout!r}")
        self.world_size = _int_arg("world_size", world_size, 1)
        self.rank = _int_arg("rank", rank, 0)
        if rank >= world_size:
            raise UsageError(f"rank {rank} must be below world_size {world_size}")
        if not isinstance(job, str) or not job:
            raise UsageError(f"job must be a non-empty str, got {job!r}")
        self.job = job
        self.drop_last = bool(drop_last)
        if not (isinstance(subshard, tuple) and len(subshard) == 2):
            raise UsageError(f"subshard must be a pair (index, count), got {subshard!r}")
        self.subshards = _int_arg("subshard count", subshard[1], 1)
        self.subshard = _int_arg("subshard index", subshard[0], 0)
        if self.subshard >= self.subshards:
            raise UsageError(f"subshard index {self.subshard} must be below its count {self.subshards}")
        self.timeout = float(timeout)
        self.window = window
        self.keys = keys
        self._keys = keyfiles.client_keys(keys) if keys else None
        self._pid = os.getpid()  # sockets do not survive fork(): a child must make its own client
        self._ctx = zmq.Context()
        self._req: Optional[zmq.Socket] = None
        self._data: Optional[zmq.Socket] = None
        self._consumer = b"ppc-" + os.urandom(12)
        self._current: Optional[EpochIterator] = None
        # Messages of each live run, so one run's seqs are not lost while another one is awaited.
        self._inbox: Dict[int, Deque[protocol.Decoded]] = {}
        self._alive: Optional[_Alive] = None
        # Results straight from workers (map_seq): a ROUTER they connect to.
        self._direct_bind = endpoints.check(direct, "direct") if isinstance(direct, str) else None
        self.direct = bool(direct)
        self._direct: Optional[zmq.Socket] = None
        self._direct_endpoint = ""
        self._direct_dir: Optional[str] = None
        self._auth: Any = None
        self._poller: Optional[zmq.Poller] = None
        self._authorized: Tuple[bytes, ...] = ()
        self._mappings: Dict[bytes, shm.Mapping] = {}  # worker identity -> its result segment, mapped
        self._host = ""  # shared-memory host id, once known ("": segments do not work here)
        # Direct results (or whole messages) from workers that were dropped as malformed (each is
        # made again as missing), and workers whose CURVE key was refused; both logged now and then.
        self._malformed = Throttled(log, "dropped a malformed direct result")
        self._refused = Throttled(log, "refused a worker's connection to the result socket")
        if self.direct and self._keys is not None:
            self._authorized = tuple(keyfiles.authorized_keys(keys))  # type: ignore[arg-type]

    # ---- sockets ------------------------------------------------------------------------
    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = 0
        if self._keys is not None:
            self._keys.apply(sock)
        return sock

    def _request(self, msg: protocol.Message, expect: Any) -> Any:
        """Send a request and return its checked reply, trying again (a new REQ: one whose reply is
        lost can never send again) until `timeout` has passed: a server that restarts meanwhile
        answers. Requests are safe to repeat: a repeated `epoch` request of one consumer joins
        the run the first one started."""
        frames = self._request_frames(msg)
        deadline = time.monotonic() + self.timeout
        attempts = 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            reply = self._attempt(frames, min(left, REQUEST_RETRY_S))
            if reply is not None:
                return self._checked_reply(msg, reply, expect)
            if time.monotonic() >= deadline:
                again = f" (asked {attempts} times, on a new connection each time)" if attempts > 1 else ""
                raise ServerUnavailable(f"no answer from {self.address} within {self.timeout:g} s{again}")

    def _request_frames(self, msg: protocol.Message) -> List[Any]:
        self._check_process()
        if self._ctx.closed:
            raise Error("client is closed")
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
        if self._req is None:
            self._req = self._socket(zmq.REQ)
            self._req.connect(self.address)
        self._req.send_multipart(frames)
        if self._req.poll(max(int(wait_s * 1000), 1)):
            return self._req.recv_multipart()
        self._req.close(linger=0)
        self._req = None
        return None

    def _checked_reply(self, msg: protocol.Message, frames: List[bytes], expect: Any) -> Any:
        try:
            reply = protocol.decode(frames, Peer.CLIENT, (Channel.CONTROL,)).msg
        except protocol.VersionMismatch as exc:
            raise Error(protocol.mismatch_text(exc.theirs, "the server")) from None
        except protocol.ProtocolError as exc:
            raise Error(f"malformed reply from {self.address}: {exc}") from None
        if isinstance(reply, protocol.ErrorReply):
            raise Error(reply.error)
        if not isinstance(reply, expect):
            raise Error(f"the server answered {msg.kind!r} with {reply.kind!r}")
        return reply

    def _probe(self, wait_s: float) -> Optional[protocol.InfoReply]:
        """One `info` request, answered within `wait_s` or not (None): who serves the address now."""
        reply = self._attempt(self._request_frames(protocol.InfoRequest()), wait_s)
        return None if reply is None else self._checked_reply(protocol.InfoRequest(), reply, protocol.InfoReply)

    def _check_process(self) -> None:
        """ZeroMQ sockets do not survive fork(): a child that used them would block for ever."""
        if os.getpid() != self._pid:
            raise UsageError(
                f"this Client was made in process {self._pid} and cannot be used in its forked child "
                f"{os.getpid()}: make a new Client in the child"
            )

    def _data_socket(self) -> zmq.Socket:
        if self._data is None:
            sock = self._socket(zmq.DEALER)
            sock.identity = self._consumer
            sock.rcvhwm = 0
            sock.connect(self.address)
            self._data = sock
        return self._data

    def _direct_socket(self) -> Optional[zmq.Socket]:
        """The ROUTER workers send this client's results to (None: everything through the server)."""
        if not self.direct:
            return None
        if self._direct is None:
            import tempfile

            sock = self._ctx.socket(zmq.ROUTER)
            sock.linger = 0
            sock.rcvhwm = 0
            if self._keys is not None:
                self._auth = _authenticator(self._ctx, self._authorized, self._refused)
                sock.curve_server = True
                sock.curve_publickey = self._keys.public
                sock.curve_secretkey = self._keys.secret
            if self.address.startswith("ipc://"):
                self._direct_dir = tempfile.mkdtemp(prefix="ppclient-")
            endpoint = self._direct_bind or endpoints.direct_bind(self.address, self._direct_dir or "", "direct")
            try:
                sock.bind(endpoint)
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                self.direct = False
                log.warning("cannot bind %s for direct results (%s): they come through the server", endpoint, str(exc))
                return None
            last = sock.getsockopt(zmq.LAST_ENDPOINT)
            bound = last.decode() if isinstance(last, bytes) else str(last)
            if endpoints.is_wildcard(bound):  # workers connect to the address this host reaches the server from
                server = endpoints.host_port(self.address)[0] if self.address.startswith("tcp://") else "127.0.0.1"
                bound = f"tcp://{endpoints.local_address_toward(server)}:{endpoints.host_port(bound)[1]}"
            self._direct_endpoint = bound
            self._direct = sock
            self._host = shm.usable_host_id(log, "results from workers on this host come")
            self._poller = zmq.Poller()
            self._poller.register(self._data_socket(), zmq.POLLIN)
            self._poller.register(sock, zmq.POLLIN)
        return self._direct

    def _welcome(self, ident: bytes, hello: protocol.DirectHello) -> None:
        """A worker connected: it may send results directly from now on."""
        assert self._direct is not None
        self._unmap_gone()
        mapped = self._map(ident, hello.shm)
        try:
            self._direct.send_multipart(
                [ident, *protocol.encode(protocol.DirectWelcome(shm=mapped, pid=os.getpid()))], flags=zmq.NOBLOCK
            )
        except zmq.ZMQError:
            pass

    def _map(self, ident: bytes, descriptor: Optional[Dict[str, Any]]) -> bool:
        """Map the result segment a worker on this host offers; what that identity had mapped
        before is given back. False: its results come in the messages."""
        old = self._mappings.pop(ident, None)
        try:
            if descriptor is None or not self._host or descriptor.get("host") != self._host:
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

    def _unmap_gone(self) -> None:
        """Give back the segments of workers that exited or closed them (no block will come from
        them any more); each is unmapped once the arrays of it are dropped."""
        for ident, mapping in list(self._mappings.items()):
            if mapping.producer_gone():
                del self._mappings[ident]
                mapping.close()

    def _unmap_all(self) -> None:
        mappings, self._mappings = list(self._mappings.values()), {}
        for mapping in mappings:
            mapping.close()

    @property
    def malformed_results(self) -> int:
        """Direct results (or whole messages) dropped as malformed; each seq was made again."""
        return self._malformed.count

    @property
    def refused_workers(self) -> int:
        """Connections to the result socket refused for a worker key that is not authorised."""
        return self._refused.count

    # ---- API ----------------------------------------------------------------------------
    def info(self) -> Dict[str, Any]:
        """Data keys of the mapped outputs (and of the inputs), num_seqs (or None), mode, protocol, the
        config fingerprint (what a resume state is checked against) and the config's batching."""
        reply = self._request(protocol.InfoRequest(), protocol.InfoReply)
        return {
            "data_keys": reply.data_keys,
            "input_keys": reply.input_keys,
            "num_seqs": reply.num_seqs,
            "mode": reply.mode,
            "stream_partitions": reply.stream_partitions,
            "buf_size": reply.buf_size,
            "version": reply.version,
            "protocol": protocol.PROTOCOL,
            "fingerprint": reply.fingerprint,
            "batching": reply.batching,
        }

    def status(self) -> Dict[str, Any]:
        """The server's status: the same dict `ppserver status --json` prints."""
        reply = self._request(protocol.StatusRequest(), protocol.StatusReply)
        return reply.status

    def epoch(
        self,
        epoch: Optional[int] = None,
        *,
        start: int = 0,
        state: Optional[Dict[str, Any]] = None,
        seq_list: Optional[List[str]] = None,
        seq_order: Optional[List[int]] = None,
    ) -> EpochIterator:
        """This rank's shard of an epoch, from its `start`-th seq on (a resume), as an iterator.

        `state` (from `EpochIterator.state_dict()`) resumes exactly where that iterator was;
        a state of another job, rank, world size or config is refused, and so is one taken with
        another `seq_list`/`seq_order` than the one given here. Any other epoch this client was
        reading is superseded. Returns once the server's dataset has set the epoch up, so `len()`
        (the seqs still to come) works at once.
        """
        self._check_process()
        tags = [str(t) for t in seq_list] if seq_list is not None else None
        order = [_int_arg("seq_order entry", i, 0) for i in seq_order] if seq_order is not None else None
        fingerprint = None  # not resuming a state: nothing to check
        batching = self.batching
        if state is not None:
            epoch, start, fingerprint, batching = self._resume(state, epoch, seq_selection(tags, order))
        _int_arg("epoch", epoch, 0)
        _int_arg("start", start, 0)
        assert isinstance(epoch, int)
        accepted = self._ask(epoch, start, tags, order, fingerprint, batching)
        it = EpochIterator(self, self._data_socket(), accepted, epoch, start, tags, order)
        self._inbox[it.run] = deque()
        try:
            it._wait_started()
        except Error:
            self._inbox.pop(it.run, None)
            raise  # a refused request leaves the current epoch as it was
        old, self._current = self._current, it
        if old is not None:
            old._supersede(f"epoch {old.epoch} was superseded by epoch {epoch} of this client")
            self._inbox.pop(old.run, None)
        return it

    def _ask(
        self,
        epoch: int,
        start: int,
        seq_list: Optional[List[str]],
        seq_order: Optional[List[int]],
        fingerprint: Optional[str],
        batching: Optional[Dict[str, Any]],
    ) -> protocol.EpochAccepted:
        """Ask for this client's part of an epoch from its `start`-th seq (also again, from where an
        iterator was, after the server restarted)."""
        self._data_socket()  # connect before asking, so nothing waits for a missing peer
        self._direct_socket()
        self._unmap_gone()
        self._keep_alive()
        return self._request(
            protocol.EpochRequest(
                epoch=epoch,
                consumer=self._consumer,
                seq_list=seq_list,
                seq_order=seq_order,
                job=self.job,
                rank=self.rank,
                world_size=self.world_size,
                start=start,
                drop_last=self.drop_last,
                timeout=self.timeout,
                fingerprint=fingerprint,
                subshard=self.subshard,
                subshards=self.subshards,
                direct=self._direct_endpoint if self._direct is not None else "",
                direct_key=self._keys.public if self._keys is not None and self._direct is not None else b"",
                host=self._host,
                batching=batching,
            ),
            protocol.EpochAccepted,
        )

    def _resume(self, state: Dict[str, Any], epoch: Optional[int], selection: Optional[str]) -> Any:
        if not isinstance(state, dict) or any(k not in state for k in STATE_KEYS):
            raise UsageError(f"state must be a dict from EpochIterator.state_dict() with {', '.join(STATE_KEYS)}")
        mine = {
            "job": self.job,
            "rank": self.rank,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
            "subshard": [self.subshard, self.subshards],
        }
        for key, value in mine.items():
            theirs = list(state[key]) if isinstance(state[key], (list, tuple)) else state[key]
            if theirs != value:
                raise UsageError(f"the state is of {key} {state[key]!r}, this client's is {value!r}")
        if epoch is not None and epoch != state["epoch"]:
            raise UsageError(f"the state is of epoch {state['epoch']}, not {epoch}")
        # (a state of ppclient 0.2.0 has no seq_selection: it cannot be checked)
        if "seq_selection" in state and state["seq_selection"] != selection:
            saved = state["seq_selection"] or "the whole epoch"
            raise UsageError(
                f"the state was taken of {saved}, this request asks for {selection or 'the whole epoch'}: "
                "resume with the seq_list or seq_order the state's epoch was asked for"
            )
        fingerprint = state["fingerprint"]
        if not isinstance(fingerprint, str) or not fingerprint:
            raise UsageError(
                f"the state has no config fingerprint (fingerprint={fingerprint!r}); EpochIterator.state_dict() "
                "always gives one"
            )
        _int_arg("the state's position", state["position"], 0)
        # the state's position counts its batches: it resumes with its cut (a state of ppclient 0.2.0
        # was read seq by seq)
        saved = _batching_arg(state.get("batching") or False)
        if self.batching is not None and self.batching != saved:
            raise UsageError(
                f"the state was taken of an epoch read in {_words(saved)}, this client asks for {_words(self.batching)}"
            )
        return state["epoch"], state["position"], fingerprint, saved

    def _keep_alive(self) -> None:
        if self._alive is None:
            interval = min(ALIVE_INTERVAL_S, self.timeout / 4)
            self._alive = _Alive(self._ctx, self.address, self._consumer, interval, self._keys)
            self._alive.start()

    def _next_message(self, run: int, deadline: float) -> Optional[protocol.Decoded]:
        """The next message of `run` (None at the deadline); others' go to their inboxes."""
        inbox = self._inbox.get(run)
        if inbox:
            return inbox.popleft()
        data = self._data_socket()
        direct = self._direct
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
                    assert self._poller is not None
                    ready = dict(self._poller.poll(int(left * 1000) + 1))
            for sock in (data, direct):
                if sock is None or sock not in ready:
                    continue
                decoded = self._recv(sock, sock is data)
                if decoded is None:
                    continue
                owner = getattr(decoded.msg, "run", None)
                if owner == run:
                    return decoded
                if owner in self._inbox:
                    self._inbox[owner].append(decoded)  # a live run's: keep it for that iterator

    def _recv(self, sock: zmq.Socket, from_server: bool) -> Optional[protocol.Decoded]:
        """One message from the data socket (the server's) or the direct socket (a worker's)."""
        frames = sock.recv_multipart(copy=False)
        if from_server:
            if len(frames) < 2 or len(frames[0]) != 0:
                return None
            try:
                return protocol.decode(frames[1:], Peer.CLIENT, (Channel.DATA,))
            except protocol.ProtocolError as exc:
                raise Error(f"malformed message from {self.address}: {exc}") from None
        if len(frames) < 2:
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

    def _drop_malformed(self, frames: List[Any], reason: str, decoded: Optional[protocol.Decoded] = None) -> None:
        """Count and log (now and then) a worker's message, or the items of it, that cannot be
        used, and give back the shared-memory blocks they name: nobody else would."""
        ident = frames[0].bytes
        bad = decoded.bad if decoded is not None else []
        self._malformed.hit(f"from worker {ident.decode(errors='replace')}: {reason}", max(len(bad), 1))
        mapping = self._mappings.get(ident)
        if mapping is not None:
            for ref in protocol.unused_blocks(frames[1:], decoded.items if decoded is not None else []):
                mapping.discard(ref)  # a block good seqs of the message use stays theirs
        if decoded is not None:
            decoded.bad = []

    def close(self) -> None:
        """Tell the server (its shards may be taken over at once) and close every socket."""
        if os.getpid() != self._pid:  # a forked child: the sockets are its parent's, which goes on using them
            self._req = self._data = self._direct = self._alive = self._current = None
            self._inbox, self._mappings = {}, {}
            return
        if self._alive is not None:
            self._alive.stop()
            self._alive = None
        self._drop_unread()
        if self._data is not None:  # (after the last block was taken: the workers free the others)
            try:
                self._data.send_multipart(
                    [protocol.DELIMITER, *protocol.encode(protocol.ClientClosed(consumer=self._consumer))],
                    flags=zmq.NOBLOCK,
                )
            except zmq.ZMQError:
                pass
        for sock in (self._req, self._data):
            if sock is not None:
                sock.close(linger=100 if sock is self._data else 0)
        self._req = self._data = None
        self._current = None
        self._unmap_all()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._direct_dir is not None:
            import shutil

            shutil.rmtree(self._direct_dir, ignore_errors=True)
            self._direct_dir = None
        if not self._ctx.closed:
            self._ctx.term()

    def _drop_unread(self) -> None:
        """Take no more results, and let go of those not yielded: their shared-memory blocks are
        freed (by the workers, for those still in the socket or on the way: see ClientClosed).
        The arrays already yielded stay valid while they are held."""
        if self._direct is not None:
            self._direct.close(linger=0)
            self._direct = None
        self._inbox.clear()  # seqs of runs no iterator holds
        if self._current is not None:
            self._current._closed()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _batching_arg(value: Union[bool, Dict[str, Any], None]) -> Optional[Dict[str, Any]]:
    """A batching argument as it travels: None (the server's default), {} (one seq at a time) or
    the checked settings."""
    if value is None:
        return None
    if value is False:
        return {}
    if value is True:
        raise UsageError(
            "batching must be a dict of settings, None (the server's default) or False (one seq at a time)"
        )
    return Batching.from_dict(value).to_dict()


def _words(batching: Optional[Dict[str, Any]]) -> str:
    if not batching:
        return "one seq at a time"
    return f"batches of {Batching.from_dict(batching).describe()}"


def _authenticator(ctx: zmq.Context, authorized: Tuple[bytes, ...], refused: Throttled) -> Any:
    """Only workers with an authorised key may send results to this client; refusals are logged."""
    from zmq.auth.thread import ThreadAuthenticator

    keys = set(authorized)

    class KeyRing:
        def callback(self, domain: str, client_key: bytes) -> bool:
            if client_key in keys:
                return True
            refused.hit(f"CURVE key {client_key.decode(errors='replace')[:16]}... is not authorised")
            return False

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=KeyRing())
    return auth


class _Alive(threading.Thread):
    """Tells the server, from its own socket, that this client lives (the trainer may be busy)."""

    def __init__(self, ctx: zmq.Context, address: str, consumer: bytes, interval: float, keys: Any):
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

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=2.0)


class EpochIterator(Iterator[Dict[str, Any]]):
    """This rank's seqs (or batches) of one epoch in order. Raises MapperError, Superseded or
    ServerUnavailable, never hangs; once it has raised, every later next() raises the same error.

    A server that stops sending anything (not even keepalives) is asked `info` now and then;
    when a restarted one (another instance, the same config fingerprint) answers at the address
    within the timeout, the iterator asks it for the epoch again from its position, as a resume
    state would, and goes on: the rest of the epoch is the same as it would have been."""

    def __init__(
        self,
        client: Client,
        sock: zmq.Socket,
        accepted: protocol.EpochAccepted,
        epoch: int,
        start: int = 0,
        seq_list: Optional[List[str]] = None,
        seq_order: Optional[List[int]] = None,
    ):
        self._client = client
        self._sock = sock
        self.run = accepted.run
        self.epoch = epoch
        self.start = start  # index in the shard of the first seq (or batch) this iterator yields
        self.rank = client.rank
        self.world_size = client.world_size
        self.num_seqs: Optional[int] = None  # seqs (batches, when the job batches) it yields in all
        self.batching: Optional[Dict[str, Any]] = None  # the job's cut, once started (None: seq by seq)
        self.fingerprint = accepted.fingerprint
        self._instance = accepted.instance  # the server process that serves the run
        self._seq_list, self._seq_order = seq_list, seq_order
        self.reconnects = 0  # times the epoch was asked for again from a restarted server
        self._consumed = 0
        self._base = 0  # seqs yielded before the current run began (the server counts from there)
        self._granted = 0  # credit granted to the current run so far (cumulative)
        self._told = 0  # seqs taken, as the server last heard it
        self._done = False
        self._end: Optional[int] = None  # seqs the current run has for this iterator, once End came
        self._error: Optional[Error] = None
        # Seqs by position: direct results may come out of order, twice, or before the server's End.
        self._buffer: Dict[int, Union[Item, Batch]] = {}
        self._partial: Dict[int, Batch] = {}  # seqs of batches the server cut but did not pad, not all here yet
        self._lanes = client.world_size * client.subshards
        self._first = client.rank + client.subshard * client.world_size + start * self._lanes
        self._direct = client._direct is not None
        self._arrived = self._first  # without direct results: the position the next message must have
        self._awaited = -1  # direct results: the position waited for since _ask_at's count began
        self._ask_at = 0.0  # when to say it is missing
        self.duplicates = 0  # seqs that came twice (a worker died after sending one) and were dropped
        self._alive_at = 0.0  # when the last keepalive (or anything) came from the server
        self._probe_at = 0.0  # when to ask who serves the address, if nothing comes until then
        self._probes = 0  # `info` requests of the current silence, and how many were answered
        self._answered = 0
        self._interval = 1.0
        self._waiting_for = ""
        self._workers = 0
        self._started = False
        self._sized = False  # num_seqs was set by the first run to start

    def __len__(self) -> int:
        """Seqs (batches, when the job batches) this iterator yields in all (from its start), if the
        server knows it in advance."""
        if self.num_seqs is None:
            what = "batches" if self.batching else "seqs"
            raise TypeError(f"the number of {what} of this epoch is not known in advance")
        return self.num_seqs

    @property
    def position(self) -> int:
        """Index in this rank's shard of the next seq or batch (start + those yielded so far)."""
        return self.start + self._consumed

    def state_dict(self) -> Dict[str, Any]:
        """Where this iterator is: small and msgpack-able. `client.epoch(state=...)` resumes from it,
        delivering exactly what this iterator would have delivered next."""
        return {
            "job": self._client.job,
            "epoch": self.epoch,
            "rank": self.rank,
            "world_size": self.world_size,
            "position": self.position,
            "fingerprint": self.fingerprint,
            "drop_last": self._client.drop_last,
            "subshard": [self._client.subshard, self._client.subshards],
            "seq_selection": seq_selection(self._seq_list, self._seq_order),
            "batching": self.batching,
        }

    def __iter__(self) -> EpochIterator:
        return self

    def _grant(self, n: int) -> None:
        """Grants are cumulative (total so far), so one lost on a reset connection is repaired by the next."""
        self._granted += n
        self._told = self._consumed
        credit = protocol.Credit(run=self.run, total=self._granted, consumed=self._consumed - self._base)
        self._sock.send_multipart([protocol.DELIMITER, *protocol.encode(credit)])

    def _top_up(self, held: int = 0, end: bool = False) -> None:
        """Credit for `window` seqs beyond those taken (and the `held` ones received meanwhile),
        granted half a window at a time, with the number taken (also `end`: at the end)."""
        window, taken = self._client.window, self._consumed - self._told
        due = self._consumed - self._base + held + window - self._granted
        if due * 2 >= window or taken * 2 >= window or (end and taken):
            self._grant(max(due, 0))

    def _supersede(self, message: str) -> None:
        if self._error is None and not self._finished():
            self._error = Superseded(message)
        self._buffer.clear()  # never yielded now: their shared-memory blocks go

    def _closed(self) -> None:
        """The client closed: nothing more is yielded, and the seqs that arrived are let go."""
        if self._error is None and not self._finished():
            self._error = Error(f"epoch {self.epoch}: the client is closed")
        self._buffer.clear()

    def _raise(self, error: Error) -> NoReturn:
        self._error = error
        self._client._inbox.pop(self.run, None)
        self._buffer.clear()
        raise error

    def _wait_started(self) -> None:
        self._heard(time.monotonic())
        self._grant(self._client.window)
        while not self._started:
            self._receive("started")

    def _finished(self) -> bool:
        return self._done and (self._end is None or self._consumed - self._base >= self._end)

    @property
    def _expected(self) -> int:
        return self._first + self._consumed * self._lanes

    def __next__(self) -> Dict[str, Any]:
        if self._error is not None:
            raise self._error
        self._client._check_process()
        expected = self._expected
        while expected not in self._buffer:
            if self._finished():
                self._top_up(end=True)
                self._client._inbox.pop(self.run, None)
                raise StopIteration
            self._receive("progress")
        item = self._buffer.pop(expected)
        seq = self._build(item)
        self._consumed += 1
        self._top_up(end=self._finished())  # (at the end, tells the server how many were taken)
        return seq

    def _build(self, item: Union[Item, Batch]) -> Dict[str, Any]:
        """What the trainer gets: a seq, a padded batch, or the seqs of a batch padded here."""
        if isinstance(item, Item):
            return protocol.item_to_seq(item)
        pad = self.batching.get("pad", {}) if self.batching else {}
        return collate.pad([protocol.item_to_seq(i) for i in item.items], lambda key: pad.get(key, 0))

    def _receive(self, what: str) -> None:
        """Take the next message of this run (`what`: "started" or "progress"); raise when none
        comes within the timeout. Keepalives that say the run
        waits for other readers whose clients live extend it: a paused reader fails no one. Waiting
        for a seq sent directly, say every 2 heartbeat intervals that it is missing (it may be lost).
        When nothing at all comes for 2 heartbeat intervals, ask who serves the address: a
        restarted server is asked for the epoch again from here (and this returns)."""
        timeout = self._client.timeout
        began = time.monotonic()
        deadline = began + timeout
        ask = deadline
        if self._direct and what == "progress":
            if self._awaited != self._expected:  # the wait for this seq begins now, not at every message
                self._awaited, self._ask_at = self._expected, began + MISSING_AFTER * self._interval
            ask = self._ask_at
        while True:
            try:
                decoded = self._client._next_message(self.run, min(deadline, ask, max(self._probe_at, began)))
            except Error as exc:
                self._raise(exc)
            if decoded is None:
                now = time.monotonic()
                if now >= deadline:
                    self._timed_out(what, timeout, began)
                if now >= self._probe_at and self._restarted(deadline):
                    self._resume_run()
                    return
                if now >= ask:
                    self._missing()
                    ask = self._ask_at = now + MISSING_AFTER * self._interval
                continue
            msg = decoded.msg
            self._heard(time.monotonic())
            if isinstance(msg, protocol.Keepalive):
                self._interval, self._workers, self._waiting_for = msg.interval, msg.workers, msg.waiting_for
                self._probe_at = self._alive_at + KEEPALIVE_MISSES * self._interval + 0.25
                if msg.waits_on_readers and what != "started":
                    deadline = self._alive_at + timeout
                continue
            self._on(msg, decoded)
            return

    def _heard(self, now: float) -> None:
        """Something came from the server: it lives, and the next silence begins now."""
        self._alive_at = now
        self._probe_at = now + KEEPALIVE_MISSES * self._interval + 0.25
        self._probes = self._answered = 0

    def _restarted(self, deadline: float) -> bool:
        """Nothing came for a while: ask `info` whose server answers at the address. True: another
        instance of the same config (a restart); another config is an error naming both."""
        client = self._client
        self._probes += 1
        try:
            info = client._probe(max(0.05, min(PROBE_WAIT_S, deadline - time.monotonic())))
        except Error as exc:
            self._raise(exc)
        self._probe_at = time.monotonic() + PROBE_EVERY_S
        if info is None:
            return False
        self._answered += 1
        if info.fingerprint != self.fingerprint:
            self._raise(
                Error(
                    f"the server at {client.address} restarted with another config: its fingerprint is "
                    f"{info.fingerprint!r}, epoch {self.epoch} was read with {self.fingerprint!r} (the config, its "
                    "mappers or ppserver differ), so the rest of the epoch would not be the same"
                )
            )
        return info.instance != self._instance

    def _resume_run(self) -> None:
        """Ask the restarted server for the epoch from this iterator's position, as a resume state
        would; what arrived of the old run and was not yielded yet is dropped (it comes again)."""
        client = self._client
        log.warning(
            "the server at %s restarted: asking for epoch %d again from seq %d of this shard",
            client.address,
            self.epoch,
            self.position,
        )
        client._inbox.pop(self.run, None)
        self._buffer.clear()
        self._partial.clear()
        try:
            accepted = client._ask(
                self.epoch, self.position, self._seq_list, self._seq_order, self.fingerprint, self.batching or {}
            )
        except Error as exc:
            self._raise(exc)
        self.run, self._instance = accepted.run, accepted.instance
        client._inbox[self.run] = deque()
        self._base = self._consumed
        self._granted = self._told = 0
        self._done, self._end, self._started = False, None, False
        self._arrived, self._awaited = self._expected, -1
        self.reconnects += 1
        self._wait_started()

    def _on(self, msg: protocol.Message, decoded: protocol.Decoded) -> None:
        if isinstance(msg, protocol.Started):
            if self.fingerprint and msg.fingerprint != self.fingerprint:
                self._raise(
                    Error(f"epoch {self.epoch} started with fingerprint {msg.fingerprint!r}, not {self.fingerprint!r}")
                )
            if not self._sized:  # the first run that started (an earlier one's server may have died before)
                self.num_seqs, self._sized = msg.num_seqs, True
            elif self.num_seqs is not None and msg.num_seqs != self.num_seqs - self._base:
                self._raise(
                    Error(
                        f"epoch {self.epoch}: the restarted server has {msg.num_seqs} seqs left for this iterator, "
                        f"not {self.num_seqs - self._base}"
                    )
                )
            self._started = True
            self.fingerprint = msg.fingerprint
            self.batching = msg.batching
        elif isinstance(msg, (protocol.Seqs, protocol.DirectSeqs)):
            if decoded.bad:
                self._raise(Error(f"epoch {self.epoch}: malformed seq from the server: {decoded.bad[0].reason}"))
            self._take(self._whole(decoded.items))
        elif isinstance(msg, protocol.End):
            self._done = True
            self._end = msg.count
            arrived = self._consumed - self._base + len(self._buffer)
            if msg.count < arrived or (not self._direct and msg.count != arrived):
                self._raise(
                    Error(f"epoch {self.epoch} ended after {msg.count} seqs but {arrived} arrived (messages were lost)")
                )
            if self.num_seqs is not None and msg.count != self.num_seqs - self._base:
                self._raise(Error(f"epoch {self.epoch} ended after {msg.count} of {self.num_seqs - self._base} seqs"))
        elif isinstance(msg, protocol.RunFailed):
            self._done = True
            if msg.failure == protocol.FailureKind.MAPPER.value:
                self._raise(MapperError(msg.message, seq_tag=msg.seq_tag, remote_traceback=msg.traceback))
            if msg.failure == protocol.FailureKind.DATASET.value:
                self._raise(
                    DatasetError(
                        f"epoch {self.epoch} failed on the server: {msg.message}", remote_traceback=msg.traceback
                    )
                )
            if msg.failure == protocol.FailureKind.REQUEST.value:
                self._raise(Error(f"cannot start epoch {self.epoch}: {msg.message}"))
            self._raise(Error(f"epoch {self.epoch} failed on the server: {msg.message}"))
        elif isinstance(msg, protocol.Superseded):
            self._done = True
            self._raise(
                Superseded(f"epoch {self.epoch} was superseded by epoch {msg.epoch}, requested by another client")
            )

    def _whole(self, items: List[Item]) -> List[Union[Item, Batch]]:
        """The items, with the seqs of a batch the server cut but did not pad as one Batch once
        they are all here (they may come in several messages)."""
        if not any(item.batch is not None for item in items):
            return list(items)
        out: List[Union[Item, Batch]] = []
        for item in items:
            if item.batch is None:
                out.append(item)
                continue
            batch = self._partial.setdefault(item.batch, Batch(item.batch, []))
            batch.items.append(item)
            if len(batch.items) >= (item.size or 1):
                out.append(self._partial.pop(item.batch))
        return out

    def _take(self, items: List[Union[Item, Batch]]) -> None:
        """Into the reorder buffer; duplicates and seqs already yielded are dropped."""
        expected, lanes = self._expected, self._lanes
        for item in items:
            pos = item.pos
            if not self._direct:
                if pos != self._arrived:
                    self._raise(
                        Error(
                            f"epoch {self.epoch}: expected the seq at position {self._arrived} but got {pos} "
                            "(messages were lost, e.g. on a reset connection)"
                        )
                    )
                self._arrived += lanes
            elif pos < expected or (pos - self._first) % lanes or pos in self._buffer:
                self.duplicates += 1
                continue
            self._buffer[pos] = item

    def _missing(self) -> None:
        try:
            self._sock.send_multipart(
                [protocol.DELIMITER, *protocol.encode(protocol.Missing(run=self.run, pos=self._expected))],
                flags=zmq.NOBLOCK,
            )
        except zmq.ZMQError:
            pass

    def _timed_out(self, what: str, timeout: float, began: float) -> None:
        """Alive means keepalives kept coming while we waited; else the server is gone."""
        address = self._client.address
        silent = time.monotonic() - self._alive_at
        if self._alive_at < began or silent > KEEPALIVE_MISSES * self._interval + 0.25:
            if not self._probes:
                tried = ""
            elif self._answered:
                tried = f"; the server answers (asked {self._probes} times) but sends nothing of this epoch"
            else:
                tried = f"; tried {self._probes} times to reach a server there again, none answered"
            self._raise(ServerUnavailable(f"no data from {address} for {silent:.1f} s (epoch {self.epoch}){tried}"))
        waiting = f"; waiting for {self._waiting_for}" if self._waiting_for else ""
        if what == "started":
            self._raise(
                Error(
                    f"epoch {self.epoch} did not start within {timeout:g} s although the server at "
                    f"{address} is alive{waiting}"
                )
            )
        self._raise(
            Error(
                f"epoch {self.epoch} made no progress for {timeout:g} s although the server at {address} "
                f"is alive ({self._workers} workers{waiting})"
            )
        )
