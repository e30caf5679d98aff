"""One worker process: applies the mappers to seqs the server sends and sends the results back.

The worker never opens the dataset. It learns the worker endpoint from the server's control
address, registers with its protocol version and config fingerprint, then serves tasks:
map_seq tasks one by one in arrival order, and map_seq_stream partitions as generators
whose input iterator pulls inputs from the socket. A heartbeat thread with its own socket
keeps the server informed while a mapper runs; losing the server (no heartbeat for
heartbeat_timeout) drops all work and starts registration again.

Run as `python -m ppserver.worker CONFIG --connect tcp://HOST:PORT` (the server and
`ppserver worker` start it that way).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from typing import Any, Deque, Dict, List, Optional

import zmq

from ppclient import wire

from . import security
from .apply import MappingError, apply_map_seq, run_stream, writable
from .config import Config, load_config
from .errors import ConfigError
from .supervisor import EXIT_REFUSED, set_process_title

log = logging.getLogger("ppserver.worker")

BACKOFF_START = 0.25
BACKOFF_MAX = 4.0
POLL_MS = 50
FLUSH_BYTES = 512 * 1024  # large seqs gain nothing from batching; small ones gain a lot


class Interrupted(Exception):
    """Raised inside a stream's input iterator when its partition is cancelled or the worker stops."""


class Refused(Exception):
    pass


class _Partition:
    def __init__(self, header: Dict[str, Any]):
        self.index: int = header["p"]
        self.epoch: int = header["epoch"]
        self.out_credit: int = int(header.get("credit", 1))
        self.inputs: Deque[Dict[str, Any]] = deque()
        self.eof = False
        self.gen = None
        self.emitted = 0
        self.last_tag: Optional[str] = None
        self.cancelled = False


class Heartbeat(threading.Thread):
    """Sends heartbeats on its own socket and watches the server's."""

    def __init__(self, ctx, endpoint: str, identity: bytes, interval: float, keys: Optional[str]):
        super().__init__(name="heartbeat", daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.identity = identity + b"|hb"
        security.client_side(self.sock, keys)
        self.sock.connect(endpoint)
        self.interval = interval
        self.stop_event = threading.Event()
        self.server_seen = time.monotonic()
        self.forgotten = False

    def run(self) -> None:
        hb = wire.pack({"t": "hb"})
        next_send = 0.0
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if now >= next_send:
                    self.sock.send(hb, flags=zmq.NOBLOCK)
                    next_send = now + self.interval
                if self.sock.poll(int(min(self.interval, 0.2) * 1000)):
                    msg = self.sock.recv_multipart()
                    self.server_seen = time.monotonic()
                    try:
                        if wire.unpack(msg[0]).get("t") == "unknown":
                            self.forgotten = True
                    except wire.WireError:
                        pass
        except zmq.ZMQError:
            pass
        finally:
            self.sock.close(linger=0)


class Worker:
    def __init__(self, cfg: Config, connect: str, *, keys: Optional[str] = None, index: int = 0,
                 worker_endpoint: Optional[str] = None):
        self.cfg = cfg
        self.connect = connect
        self.worker_endpoint = worker_endpoint
        self.keys = keys
        self.index = index
        self.ctx = zmq.Context()
        self.stopping = False
        self.host = socket.gethostname()
        self.sock: Optional[zmq.Socket] = None
        self.hb: Optional[Heartbeat] = None
        self.templates: Dict[str, Any] = {}
        self.run_id = -1
        self.tasks: Deque[List[Any]] = deque()
        self.parts: Dict[int, _Partition] = {}
        self.rr = 0
        self.done = 0
        self.epoch: Optional[int] = None
        self.results: List[Any] = []
        self.results_bytes = 0
        self.messages_in = self.messages_out = 0
        self.flush_every = max(1, min(cfg.buf_size // 2, 16))
        self.check_tags = False
        self.forgotten = False
        self.identity: Optional[bytes] = None
        self.monitor: Optional[zmq.Socket] = None

    # ---- registration -----------------------------------------------------------------
    def discover(self) -> str:
        """Ask the control address for the worker endpoint, retrying with backoff until it answers."""
        if self.worker_endpoint:  # a local worker of the server: told where to connect
            return self.worker_endpoint
        delay = BACKOFF_START
        attempt = 0
        while not self.stopping:
            attempt += 1
            req = self.ctx.socket(zmq.REQ)
            req.linger = 0
            security.client_side(req, self.keys)
            req.connect(self.connect)
            try:
                req.send(wire.pack({"op": "worker_hello", "proto": wire.PROTOCOL}))
                if req.poll(int(max(self.cfg.heartbeat_interval, 1.0) * 1000)):
                    reply = wire.unpack(req.recv())
                    if not reply.get("ok"):
                        raise Refused(str(reply.get("error")))
                    endpoint = str(reply["worker_endpoint"])
                    return _fill_wildcard_host(endpoint, self.connect)
            except wire.WireError as exc:
                log.warning("bad reply from %s: %s", self.connect, exc)
            finally:
                req.close(linger=0)
            if attempt == 1 or attempt % 10 == 0:
                log.info("waiting for server at %s (attempt %d)", self.connect, attempt)
            self._sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)
        raise Interrupted()

    def register(self, endpoint: str) -> bool:
        identity = f"{self.host}:{os.getpid()}:{random.getrandbits(32):08x}".encode()
        replaces, self.identity = self.identity, identity
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = identity
        sock.rcvhwm = 0
        sock.sndhwm = 0
        security.client_side(sock, self.keys)
        sock.connect(endpoint)
        sock.send(wire.pack({
            "t": "hello", "proto": wire.PROTOCOL, "fingerprint": self.cfg.fingerprint,
            "host": self.host, "pid": os.getpid(), "index": self.index, "replaces": replaces,
        }))
        deadline = time.monotonic() + self.cfg.heartbeat_timeout
        while time.monotonic() < deadline and not self.stopping:
            if not sock.poll(POLL_MS):
                continue
            header, _ = wire.split(sock.recv_multipart())
            if header.get("t") == "refuse":
                sock.close(linger=0)
                raise Refused(str(header.get("reason")))
            if header.get("t") == "welcome":
                self.templates = header["templates"]
                self.sock = sock
                # A reset connection loses queued messages both ways; register afresh when it happens.
                self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
                self.hb = Heartbeat(self.ctx, endpoint, identity, self.cfg.heartbeat_interval, self.keys)
                self.hb.start()
                log.info("registered with %s as %s", endpoint, identity.decode())
                return True
        sock.close(linger=0)
        return False

    def unregister(self, *, say_bye: bool) -> None:
        if self.monitor is not None:
            if self.sock is not None:
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        if self.sock is not None:
            if say_bye:
                try:
                    self.sock.send(wire.pack({"t": "bye", "run": self.run_id}), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                time.sleep(0.05)  # let the bye leave before the socket closes
            self.sock.close(linger=0)
            self.sock = None
        if self.hb is not None:
            self.hb.stop_event.set()
            self.hb.join(timeout=2)
            self.hb = None
        self.tasks.clear()
        self.parts.clear()
        self.run_id = -1
        self.forgotten = False

    # ---- main loop --------------------------------------------------------------------
    def serve(self) -> int:
        try:
            while not self.stopping:
                endpoint = self.discover()
                if not self.register(endpoint):
                    log.warning("no answer to registration at %s; retrying", endpoint)
                    continue
                try:
                    self._work()
                except Interrupted:
                    pass
                lost = not self.stopping
                self.unregister(say_bye=self.stopping)
                if lost:
                    log.warning("lost the server; registering again")
        except Refused as exc:
            log.error("refused by the server: %s", exc)
            return EXIT_REFUSED
        except Interrupted:
            pass
        finally:
            self.unregister(say_bye=self.stopping)
            self.ctx.term()
        log.info("worker stopped after %d seqs (%d task and %d result messages)", self.done, self.messages_in,
                 self.messages_out)
        return 0

    def _server_lost(self) -> bool:
        hb = self.hb
        if hb is None or self.forgotten:
            return True
        if self.monitor is not None and self.monitor.poll(0):
            log.warning("the connection to the server was reset; registering again")
            self.forgotten = True
            return True
        return hb.forgotten or time.monotonic() - hb.server_seen > self.cfg.heartbeat_timeout

    def _work(self) -> None:
        while not self.stopping:
            if self._server_lost():
                return
            self._receive(timeout_ms=0 if (self.tasks or self._runnable()) else POLL_MS)
            if self.tasks:
                self._run_task(self.tasks.popleft())
            else:
                part = self._runnable()
                if part is not None:
                    self._step(part)

    def _receive(self, *, timeout_ms: int) -> None:
        """Take every waiting message; wait up to timeout_ms for the first."""
        sock = self.sock
        assert sock is not None
        if not sock.poll(timeout_ms):
            return
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            frames = sock.recv_multipart(copy=False)
            try:
                self._handle(*wire.split(frames))
            except wire.WireError as exc:
                log.warning("dropped a malformed message from the server: %s", exc)

    def _handle(self, header: Dict[str, Any], bufs: List[Any]) -> None:
        t = header.get("t")
        run = header.get("run")
        if t == "cancel":
            self.results, self.results_bytes = [], 0
            self.run_id = run
            self.epoch = header.get("epoch")
            self.check_tags = bool(header.get("check_tags"))
            self.tasks.clear()
            for part in self.parts.values():
                part.cancelled = True
            self.parts.clear()
        elif t == "unknown":
            self.forgotten = True
            raise Interrupted()
        elif run != self.run_id:
            return
        elif t == "in":
            self.tasks.extend(wire.unpack_batch(header, bufs))
            self.messages_in += 1
        elif t == "sopen":
            self.parts[header["p"]] = _Partition(header)
        elif t in ("sin", "seof", "scredit"):
            part = self.parts.get(header.get("p"))
            if part is None:
                return
            if t == "sin":
                part.inputs.extend(writable(wire.item_to_seq(*item)) for item in wire.unpack_batch(header, bufs))
            elif t == "seof":
                part.eof = True
            else:
                part.out_credit += int(header.get("n", 1))

    def _send(self, header: Dict[str, Any]) -> None:
        assert self.sock is not None
        self.sock.send(wire.pack(header))

    def _flush_results(self) -> None:
        if self.results:
            assert self.sock is not None
            self.sock.send_multipart(wire.pack_batch({"t": "result", "run": self.run_id}, self.results), copy=False)
            self.messages_out += 1
            self.results = []
            self.results_bytes = 0

    def _fail(self, header: Dict[str, Any], exc: BaseException, seq_tag: Optional[str]) -> None:
        if isinstance(exc, MappingError):
            message = str(exc)
            seq_tag = exc.seq_tag or seq_tag
        else:
            message = f"{type(exc).__name__}: {exc}"
        log.error("mapper failed on seq %r: %s", seq_tag, message)
        self._flush_results()
        self._send({**header, "t": "fail", "seq_tag": seq_tag, "message": message,
                    "traceback": traceback.format_exc()})

    # ---- map_seq ----------------------------------------------------------------------
    def _run_task(self, task) -> None:
        item, bufs = task
        seq = writable(wire.item_to_seq(item, bufs))
        try:
            out = apply_map_seq(
                self.cfg.map_seq, seq, epoch=self.epoch, seed=self.cfg.seed, templates=self.templates,
                expected_tag=seq.get("seq_tag") if self.check_tags else None,
            )
            result = wire.seq_to_item(out, i=item["i"])
        except Exception as exc:
            self._fail({"run": self.run_id, "i": item.get("i")}, exc, seq.get("seq_tag"))
            self.tasks.clear()
            return
        self.results.append(result)
        self.done += 1
        # Results travel in batches, but never more than half the credit, so the server
        # refills this worker's queue before it runs dry.
        self.results_bytes += sum(map(wire.nbytes, result[1]))
        if not self.tasks or len(self.results) >= self.flush_every or self.results_bytes >= FLUSH_BYTES:
            self._flush_results()

    # ---- map_seq_stream ---------------------------------------------------------------
    def _runnable(self) -> Optional[_Partition]:
        if not self.parts:
            return None
        keys = sorted(self.parts)
        for k in range(len(keys)):
            part = self.parts[keys[(self.rr + k) % len(keys)]]
            if part.out_credit > 0 and (part.inputs or part.eof or part.gen is None):
                self.rr = (self.rr + k + 1) % len(keys)
                return part
        return None

    def _inputs(self, part: _Partition):
        while True:
            if part.cancelled or self.stopping:
                raise Interrupted()
            if part.inputs:
                seq = part.inputs.popleft()
                part.last_tag = seq.get("seq_tag")
                self._send({"t": "sack", "run": self.run_id, "p": part.index, "n": 1})
                yield seq
            elif part.eof:
                return
            else:
                if self._server_lost():
                    raise Interrupted()
                self._receive(timeout_ms=POLL_MS)

    def _step(self, part: _Partition) -> None:
        base = {"run": self.run_id, "p": part.index}
        try:
            if part.gen is None:
                part.gen = run_stream(self.cfg.map_seq_stream, self._inputs(part), epoch=part.epoch,
                                      seed=self.cfg.seed, partition=part.index, templates=self.templates)
            seq = next(part.gen)
        except StopIteration:
            self._send({**base, "t": "sdone", "count": part.emitted})
            self.parts.pop(part.index, None)
            return
        except Interrupted:
            if self.stopping or self._server_lost():
                raise
            return
        except Exception as exc:
            self.parts.pop(part.index, None)
            self._fail(base, exc, part.last_tag)
            return
        if part.cancelled:
            return
        try:
            frames = wire.pack_batch({**base, "t": "sout"}, [wire.seq_to_item(seq, k=part.emitted)])
        except wire.WireError as exc:
            self.parts.pop(part.index, None)
            self._fail(base, MappingError(str(exc), seq.get("seq_tag")), part.last_tag)
            return
        assert self.sock is not None
        self.sock.send_multipart(frames, copy=False)
        part.emitted += 1
        part.out_credit -= 1
        self.done += 1

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < end:
            time.sleep(min(0.05, end - time.monotonic()))


def _fill_wildcard_host(endpoint: str, control: str) -> str:
    """A server bound to 0.0.0.0 advertises that; reach it at the host we already reached."""
    proto, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        chost = control.partition("://")[2].rpartition(":")[0]
        return f"{proto}://{chost}:{port}"
    return endpoint


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppserver.worker", description="one ppserver worker process")
    parser.add_argument("config")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--keys", default=None)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--worker-endpoint", default=None, help="skip discovery: the server's worker socket")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s ppworker[{os.getpid()}] %(levelname)s %(message)s")
    set_process_title(f"ppworker {args.index}")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"ppserver worker: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    worker = Worker(cfg, args.connect, keys=args.keys, index=args.index, worker_endpoint=args.worker_endpoint)

    def _stop(signum, frame):
        worker.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return worker.serve()


if __name__ == "__main__":
    sys.exit(main())
