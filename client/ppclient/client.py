"""The training-side client: ask for an epoch (this rank's shard of it), iterate its seqs in order.

Requests go over a REQ socket; a request that gets no answer within `timeout` closes the
socket (a REQ whose reply is lost can never send again) and raises ServerUnavailable.
An epoch's seqs arrive on a DEALER socket from the server, and on the client's result socket
straight from the workers (`results.py`); `epoch.py` yields them in order and keeps the server's
credit. A small thread with its own socket tells the server, about once a second, that this
client lives (`alive.py`), so a trainer busy with something else for a while keeps its shard and
its job.
"""

from __future__ import annotations

import atexit
import os
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import zmq

from . import endpoints, keyfiles, protocol, resume
from .alive import AliveThread
from .arguments import int_arg, shard_args, sharding_arg, timeout_arg
from .batching import argument as batching_arg
from .epoch import EpochIterator, Session
from .errors import Error, Superseded, UsageError
from .inbox import Inbox
from .requester import Refused, Requester
from .results import DirectResults

__all__ = ["Client", "EpochIterator"]

JOB_REFUSAL_GRACE_S = 1.0  # a request refused for the job's other clients is asked again this long
JOB_REFUSAL_RETRY_S = 0.05
ALIVE_INTERVAL_S = 1.0  # how often the client tells the server it lives (at most a quarter of its timeout)

# Clients not closed yet: closed at interpreter exit while their threads still run (a client left to
# __del__ during finalization would find its alive thread frozen, its socket open for good).
_open: weakref.WeakSet[Client] = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    for client in list(_open):
        client.close()


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

    `sharding`: "strided" (above) or "contiguous": the rank's reader gets RETURNN's shard instead,
    one contiguous chunk of the epoch's order (seq by seq; a server whose `info()["shardings"]`
    has it). The same for every rank of a job.

    Bad arguments (an address that is not tcp://HOST:PORT or ipc://PATH, a missing keys
    directory or key file, a rank not below world_size) raise UsageError here, before any
    socket exists.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float = 30.0,
        window: Optional[int] = None,
        keys: Optional[str] = None,
        rank: int = 0,
        world_size: int = 1,
        job: str = "default",
        drop_last: bool = True,
        subshard: Tuple[int, int] = (0, 1),
        direct: Union[bool, str] = True,
        batching: Union[bool, Dict[str, Any], None] = None,
        sharding: str = "strided",
    ):
        self.address = endpoints.check(address, "address")
        self.batching = batching_arg(batching)
        # how far the server may send ahead of the trainer (None: WINDOW seqs, or BATCH_WINDOW batches)
        self.window = None if window is None else int_arg("window", window, 1)
        self.timeout = timeout_arg(timeout)
        if not isinstance(job, str) or not job:
            raise UsageError(f"job must be a non-empty str, got {job!r}")
        self.job = job
        self.rank, self.world_size, self.subshard, self.subshards = shard_args(rank, world_size, subshard)
        self.drop_last = bool(drop_last)
        self.sharding = sharding_arg(sharding)
        self.keys = keys
        self._keys = keyfiles.client_keys(keys) if keys else None
        self._pid = os.getpid()  # sockets do not survive fork(): a child must make its own client
        self._ctx = zmq.Context()
        self._requests = Requester(self.address, self.timeout, lambda: self._socket(zmq.REQ), self._check_open)
        self._consumer = b"ppc-" + os.urandom(12)
        self._current: Optional[EpochIterator] = None
        self._inbox = Inbox(self.address)
        self._alive: Optional[AliveThread] = None
        # Results straight from workers (map_seq): a ROUTER they connect to, bound at the first epoch.
        at = endpoints.check(direct, "direct") if isinstance(direct, str) else ""
        self.direct = bool(direct)
        self._results = DirectResults(self._ctx, keys, self._keys, at) if self.direct else None
        _open.add(self)

    # ---- sockets ------------------------------------------------------------------------
    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = 0
        if self._keys is not None:
            self._keys.apply(sock)
        return sock

    def _check_process(self) -> None:
        """ZeroMQ sockets do not survive fork(): a child that used them would block for ever."""
        if os.getpid() != self._pid:
            raise UsageError(
                f"this Client was made in process {self._pid} and cannot be used in its forked child "
                f"{os.getpid()}: make a new Client in the child"
            )

    def _check_open(self) -> None:
        """Before a request: this process's client, not closed."""
        self._check_process()
        if self._ctx.closed:
            raise Error("client is closed")

    def _data_socket(self) -> zmq.Socket:
        if self._inbox.data is None:
            sock = self._socket(zmq.DEALER)
            sock.identity = self._consumer
            sock.rcvhwm = 0
            sock.connect(self.address)
            self._inbox.data = sock
        return self._inbox.data

    def _direct_socket(self) -> Optional[zmq.Socket]:
        """The ROUTER workers send this client's results to, bound on first use (None: everything
        through the server)."""
        if not self.direct or self._results is None:
            return None
        if self._results.sock is None:
            if not self._results.bind(self.address):
                self.direct = False
                self._results.close()
                return None
            self._inbox.results = self._results
        return self._results.sock

    @property
    def _direct(self) -> Optional[zmq.Socket]:
        """The result socket while it takes results (None: they come through the server)."""
        return self._results.sock if self._results is not None else None

    @property
    def malformed_results(self) -> int:
        """Direct results (or whole messages) dropped as malformed; each seq was made again."""
        return self._results.malformed.count if self._results is not None else 0

    @property
    def refused_workers(self) -> int:
        """Connections to the result socket refused for a worker key that is not authorised."""
        return self._results.refused.count if self._results is not None else 0

    # ---- API ----------------------------------------------------------------------------
    def info(self) -> Dict[str, Any]:
        """Data keys of the mapped outputs (and of the inputs), num_seqs (or None), mode, protocol, the
        served fingerprint (what a resume state is checked against: the config's with the data files
        its dataset reads), the config's own fingerprint, the config's batching and the shardings an
        epoch may ask for."""
        reply = self._requests.ask(protocol.InfoRequest(), protocol.InfoReply)
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
            "config_fingerprint": reply.config_fingerprint,
            "shardings": list(reply.shardings),
            "batching": reply.batching,
        }

    def status(self) -> Dict[str, Any]:
        """The server's status: the same dict `ppserver status --json` prints."""
        reply = self._requests.ask(protocol.StatusRequest(), protocol.StatusReply)
        return reply.status

    def story(self, *keys: str, limit: int = 1000) -> Dict[str, Any]:
        """What the server's scheduler did with `keys` (positions, "batch:K", "partition:P",
        "run:R", "lane:R/I", "worker:NAME"): {"entries": the last `limit` moves, oldest first, each with the
        stimulus id of the event that caused it; "total": how many matched; "now": the server's
        clock}. What `ppserver status --story` prints."""
        request = protocol.StoryRequest(keys=list(keys), limit=limit)
        try:
            reply = self._requests.ask(request, protocol.StoryReply)
        except Error as exc:
            if "unknown message kind" in str(exc):
                raise Error(f"the server at {self.address} keeps no story (it is older than this client)") from None
            raise
        return {"entries": reply.entries, "total": reply.total, "now": reply.now}

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
        order = [int_arg("seq_order entry", i, 0) for i in seq_order] if seq_order is not None else None
        fingerprint = None  # not resuming a state: nothing to check
        batching = self.batching
        if state is not None:
            selection = resume.seq_selection(tags, order)
            epoch, start, fingerprint, batching = resume.check(state, self._reader(), self.batching, epoch, selection)
        int_arg("epoch", epoch, 0)
        int_arg("start", start, 0)
        assert isinstance(epoch, int)
        accepted = self._ask(epoch, start, tags, order, fingerprint, batching)
        it = EpochIterator(self._session(), self._data_socket(), accepted, epoch, start, tags, order, batching)
        self._inbox.open(it.run)
        try:
            it._wait_started()
        except Error:
            self._inbox.drop(it.run)
            raise  # a refused request leaves the current epoch as it was
        old, self._current = self._current, it
        if old is not None:
            old._stop(Superseded(f"epoch {old.epoch} was superseded by epoch {epoch} of this client"))
            self._inbox.drop(old.run)
        return it

    def _reader(self) -> resume.Reader:
        return resume.Reader(
            self.job, self.rank, self.world_size, self.drop_last, self.subshard, self.subshards, self.sharding
        )

    def _session(self) -> Session:
        """What an epoch gets of this client (after `_ask`, which binds the direct result socket)."""
        return Session(
            reader=self._reader(),
            address=self.address,
            timeout=self.timeout,
            window=self.window,
            direct=self._direct is not None,
            inbox=self._inbox,
            probe=self._requests.probe,
            ask=self._ask,
            check_process=self._check_process,
        )

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
        results = self._results if self._direct_socket() is not None else None
        if self._results is not None:
            self._results.unmap_gone()
        self._keep_alive()
        request = protocol.EpochRequest(
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
            direct=results.endpoint if results is not None else "",
            direct_key=self._keys.public if self._keys is not None and results is not None else b"",
            host=results.host if results is not None else "",
            batching=batching,
            sharding=self.sharding,
        )
        # A refusal for the job's other clients may be for clients that have just closed: their
        # `client_closed` comes over their own connections, which the server may read after this
        # request's. Asked again for a moment, such a request goes through; a real conflict is
        # refused all the same, JOB_REFUSAL_GRACE_S later.
        deadline = time.monotonic() + JOB_REFUSAL_GRACE_S
        while True:
            try:
                return self._requests.ask(request, protocol.EpochAccepted)
            except Refused as exc:
                if exc.reason != protocol.RefusalReason.JOB.value or time.monotonic() >= deadline:
                    raise
            time.sleep(JOB_REFUSAL_RETRY_S)

    def _keep_alive(self) -> None:
        if self._alive is None:
            interval = min(ALIVE_INTERVAL_S, self.timeout / 4)
            self._alive = AliveThread(self._ctx, self.address, self._consumer, interval, self._keys)
            self._alive.start()

    def close(self) -> None:
        """Tell the server (its shards may be taken over at once) and close every socket. Never
        blocks for long: every socket has LINGER 0 (the data socket 0.1 s), threads are waited for
        with a timeout, and a context with a socket still open in a thread that did not end (as
        while the interpreter finalizes) is left as it is, not terminated."""
        _open.discard(self)
        if os.getpid() != self._pid:  # a forked child: the sockets are its parent's, which goes on using them
            self._requests.sock = self._results = self._alive = self._current = None
            self._inbox = Inbox(self.address)
            return
        stopped = True  # every thread with a socket of the context has ended
        if self._alive is not None:
            stopped = self._alive.stop()
            self._alive = None
        self._drop_unread()
        data, self._inbox.data = self._inbox.data, None
        if data is not None:  # (after the last block was taken: the workers free the others)
            try:
                data.send_multipart(
                    [protocol.DELIMITER, *protocol.encode(protocol.ClientClosed(consumer=self._consumer))],
                    flags=zmq.NOBLOCK,
                )
            except zmq.ZMQError:
                pass
            data.close(linger=100)
        self._requests.close()
        self._current = None
        if self._results is not None:
            stopped = self._results.close() and stopped
        if stopped and not self._ctx.closed:
            self._ctx.destroy(linger=0)  # closes any socket left (no thread uses one), then terminates

    def _drop_unread(self) -> None:
        """Take no more results, and let go of those not yielded: their shared-memory blocks are
        freed (by the workers, for those still in the socket or on the way: see ClientClosed).
        The arrays already yielded stay valid while they are held."""
        if self._results is not None:
            self._results.stop()
        self._inbox.runs.clear()  # seqs of runs no iterator holds
        if self._current is not None:
            self._current._stop(Error(f"epoch {self._current.epoch}: the client is closed"))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
