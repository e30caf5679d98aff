"""The training-side client: ask for an epoch, iterate its seqs in order.

Requests go over a REQ socket; a request that gets no answer within `timeout` closes the
socket (a REQ whose reply is lost can never send again) and raises ServerUnavailable.
Seqs arrive on a DEALER socket: the client grants the server credit for `window` seqs and
tops it up as it consumes them, so the server never sends more than the trainer takes.
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any, Deque, Dict, Iterator, List, Optional, Tuple

import zmq

from . import wire
from .errors import Error, MapperError, ServerUnavailable


class Client:
    """Connection to one ppserver. Use as a context manager or call close()."""

    def __init__(self, address: str, *, timeout: float = 30.0, window: int = 32, keys: Optional[str] = None):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.address = address
        self.timeout = float(timeout)
        self.window = window
        self.keys = keys
        self._ctx = zmq.Context()
        self._req: Optional[zmq.Socket] = None
        self._data: Optional[zmq.Socket] = None
        self._stream_id = b"ppc-" + os.urandom(12)
        self._current: Optional["EpochIterator"] = None

    # ---- sockets ------------------------------------------------------------------------
    def _secure(self, sock: zmq.Socket) -> None:
        if self.keys:
            import zmq.auth

            public, secret = zmq.auth.load_certificate(os.path.join(self.keys, "client.key_secret"))
            server_public, _ = zmq.auth.load_certificate(os.path.join(self.keys, "server.key"))
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public

    def _request(self, header: Dict[str, Any]) -> Dict[str, Any]:
        if self._ctx.closed:
            raise Error("client is closed")
        if self._req is None:
            sock = self._ctx.socket(zmq.REQ)
            sock.linger = 0
            self._secure(sock)
            sock.connect(self.address)
            self._req = sock
        header = {**header, "proto": wire.PROTOCOL}
        self._req.send(wire.pack(header))
        if not self._req.poll(int(self.timeout * 1000)):
            self._req.close(linger=0)
            self._req = None
            raise ServerUnavailable(f"no answer from {self.address} within {self.timeout:g} s")
        reply = wire.unpack(self._req.recv())
        mismatch = wire.protocol_mismatch(reply.get("proto"), "the server")
        if mismatch:
            raise Error(mismatch)
        if not reply.get("ok"):
            raise Error(str(reply.get("error", "request failed")))
        return reply

    def _data_socket(self) -> zmq.Socket:
        if self._data is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.identity = self._stream_id
            sock.rcvhwm = 0
            self._secure(sock)
            sock.connect(self.address)
            self._data = sock
        return self._data

    # ---- API ----------------------------------------------------------------------------
    def info(self) -> Dict[str, Any]:
        """Data keys of the mapped outputs, num_seqs (or None) and the protocol version."""
        reply = self._request({"op": "info"})
        reply.pop("ok", None)
        reply["protocol"] = reply.pop("proto")
        return reply

    def status(self) -> Dict[str, Any]:
        """The server's status: the same dict `ppserver status --json` prints."""
        return self._request({"op": "status"})["status"]

    def epoch(self, epoch: int, *, seq_list: Optional[List[str]] = None,
              seq_order: Optional[List[int]] = None) -> "EpochIterator":
        """Start an epoch (cancelling any other) and return an iterator of its seqs, in order."""
        data = self._data_socket()  # connect before asking, so no seq waits for a missing peer
        if self._current is not None:
            self._current._superseded = True
        reply = self._request({
            "op": "epoch", "epoch": int(epoch), "stream_id": self._stream_id,
            "seq_list": list(seq_list) if seq_list is not None else None,
            "seq_order": [int(i) for i in seq_order] if seq_order is not None else None,
        })
        it = EpochIterator(self, data, reply["run"], epoch, reply.get("num_seqs"))
        self._current = it
        return it

    def close(self) -> None:
        for sock in (self._req, self._data):
            if sock is not None:
                sock.close(linger=0)
        self._req = self._data = None
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EpochIterator(Iterator[Dict[str, Any]]):
    """The seqs of one epoch in order. Raises MapperError or ServerUnavailable, never hangs."""

    def __init__(self, client: Client, sock: zmq.Socket, run: int, epoch: int, num_seqs: Optional[int]):
        self._client = client
        self._sock = sock
        self.run = run
        self.epoch = epoch
        self.num_seqs = num_seqs
        self._consumed = 0
        self._ungranted = 0
        self._done = False
        self._superseded = False
        self._ready: Deque[Tuple[Dict[str, Any], List[Any]]] = deque()
        self._granted = 0
        self._grant(client.window)

    def __len__(self) -> int:
        if self.num_seqs is None:
            raise TypeError("the number of seqs of this epoch is not known in advance")
        return self.num_seqs

    def _grant(self, n: int) -> None:
        """Grants are cumulative (total so far), so one lost on a reset connection is repaired by the next."""
        self._granted += n
        self._sock.send_multipart([b"", wire.pack({"op": "credit", "run": self.run, "total": self._granted})])

    def __iter__(self) -> "EpochIterator":
        return self

    def __next__(self) -> Dict[str, Any]:
        if self._superseded:
            raise Error(f"epoch {self.epoch} was superseded by a newer epoch request")
        if self._ready:
            return self._take()
        if self._done:
            raise StopIteration
        timeout = self._client.timeout
        deadline = time.monotonic() + timeout
        alive = None  # the last keepalive: the server answers, but the epoch makes no progress
        while True:
            if not self._sock.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
                if alive is not None:
                    raise Error(f"epoch {self.epoch} made no progress for {timeout:g} s although the server at "
                                f"{self._client.address} is alive ({alive.get('workers')} workers; a mapper may be "
                                "stuck, or no worker is connected)")
                raise ServerUnavailable(f"no data from {self._client.address} for {timeout:g} s (epoch {self.epoch})")
            frames = self._sock.recv_multipart(copy=False)
            header, bufs = wire.split(frames[1:])
            if header.get("run") != self.run:
                continue  # left over from an earlier epoch
            t = header.get("t")
            if t == "hb":
                alive = header
                continue
            if t == "seq":
                self._ready.extend(wire.unpack_batch(header, bufs))
                return self._take()
            if t == "end":
                self._done = True
                if header.get("count") != self._consumed:
                    raise Error(f"epoch {self.epoch} ended after {header.get('count')} seqs but "
                                f"{self._consumed} arrived (messages were lost)")
                if self.num_seqs is not None and header.get("count") != self.num_seqs:
                    raise Error(f"epoch {self.epoch} ended after {header.get('count')} of {self.num_seqs} seqs")
                raise StopIteration
            if t == "error":
                self._done = True
                if header.get("kind") == "mapper":
                    raise MapperError(str(header.get("message")), seq_tag=header.get("seq_tag"),
                                      remote_traceback=str(header.get("traceback") or ""))
                raise Error(f"epoch {self.epoch} failed on the server: {header.get('message')}")

    def _take(self) -> Dict[str, Any]:
        item, bufs = self._ready.popleft()
        if item.get("i") != self._consumed:
            self._done = True
            raise Error(f"epoch {self.epoch}: expected seq #{self._consumed} but got #{item.get('i')} "
                        "(messages were lost, e.g. on a reset connection)")
        seq = wire.item_to_seq(item, bufs)
        self._consumed += 1
        self._ungranted += 1
        if self._ungranted * 2 >= self._client.window:
            self._grant(self._ungranted)
            self._ungranted = 0
        return seq
