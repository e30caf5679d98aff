"""The server process: owns the dataset, runs the I/O loop, starts local workers.

Sockets:
- control ROUTER at --bind: clients' REQ requests (info, status, epoch, worker_hello) and
  their DEALER data streams (credit in, seqs out);
- worker ROUTER at --worker-bind (default: the --bind host, any port): registration,
  tasks, results and heartbeats;
- an inproc PULL from the feeder thread, polled only while the scheduler wants input.

All sockets live in this one thread; the scheduler holds the state; the feeder thread
reads the dataset. Results go from worker to client as the frames they arrived in.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional

import zmq

from ppclient import wire

from . import security
from .config import Config
from .datasets import make_dataset
from .errors import ConfigError
from .feeder import Feeder
from .scheduler import Scheduler
from .supervisor import ProcessPool, worker_argv

log = logging.getLogger("ppserver.server")

FEEDER_ENDPOINT = "inproc://ppserver-feeder"
HB_SUFFIX = b"|hb"
LOOP_MS = 100
HOUSEKEEPING_S = 0.01


class Server:
    def __init__(
        self,
        cfg: Config,
        *,
        bind: str = "tcp://127.0.0.1:5555",
        worker_bind: Optional[str] = None,
        keys: Optional[str] = None,
        insecure: bool = False,
    ):
        self.cfg = cfg
        self.keys = keys
        for endpoint in (bind, worker_bind):
            if endpoint and not security.is_loopback(endpoint) and not keys and not insecure:
                raise ConfigError("--bind", f"{endpoint} is not a loopback address: pass --keys DIR or --insecure")
        if insecure and not keys:
            log.warning("serving without encryption or authentication (--insecure)")
        self.dataset = make_dataset(cfg.dataset, order_seed=cfg.seed)
        self.in_templates = self.dataset.data_keys()
        self.out_templates = cfg.map_outputs or self.in_templates
        self.dataset_lock = threading.Lock()
        self.ctx = zmq.Context()
        self.auth = security.start_authenticator(self.ctx, keys)
        self.control = self._router(bind)
        if worker_bind is None:
            if bind.startswith("ipc://"):
                worker_bind = bind + ".workers"
            else:
                host = bind.partition("://")[2].rpartition(":")[0]
                worker_bind = f"tcp://{host}:0"
        self.workers_sock = self._router(worker_bind)
        self.address = self.control.last_endpoint.decode()
        self.worker_address = self.workers_sock.last_endpoint.decode()
        self.monitors = self._monitors() if keys else []
        self.feed = self.ctx.socket(zmq.PULL)
        self.feed.rcvhwm = 1  # wake-ups only; the seqs wait in the feeder's queue
        self.feed.bind(FEEDER_ENDPOINT)
        self.sched = Scheduler(buf_size=cfg.buf_size, max_seq_retries=cfg.max_seq_retries,
                               reread=self._reread)
        self.feeder: Optional[Feeder] = None
        # Run ids start at a random point, so a restarted server never reuses an id a client
        # may still hold data for.
        self.run_counter = random.getrandbits(40)
        self.stopping = False
        self.started = time.monotonic()
        self.pool: Optional[ProcessPool] = None
        self.ipc_dir: Optional[str] = None
        self.last_hb = 0.0
        self.last_housekeeping = 0.0
        self.hostname = socket.gethostname()
        self.malformed = _Throttled("dropped a malformed message")
        self.refused = _Throttled("refused a connection")

    def _router(self, endpoint: str) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = 1
        sock.sndhwm = 0
        sock.rcvhwm = 0
        sock.maxmsgsize = self.cfg.max_message_bytes
        security.server_side(sock, self.keys)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot bind {endpoint}: {exc}") from None
        return sock

    def _monitors(self) -> List[zmq.Socket]:
        """Watch CURVE handshakes so that peers with wrong or missing keys show up in the log."""
        events = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        return [self.control.get_monitor_socket(events), self.workers_sock.get_monitor_socket(events)]

    def _on_monitor(self, sock: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.refused.hit(f"on {event.get('endpoint', b'?').decode(errors='replace')}: CURVE handshake failed "
                             f"({zmq.Event(event['event']).name}; wrong or missing keys)")

    # ---- lifecycle --------------------------------------------------------------------
    def start_local_workers(self, n: int) -> None:
        """Local workers reach the worker socket over a Unix socket in a private directory:
        cheaper than loopback TCP for large seqs."""
        if n <= 0:
            return
        connect = self.address
        proto, _, rest = connect.partition("://")
        host, _, port = rest.rpartition(":")
        if host in ("0.0.0.0", "*", "[::]"):
            connect = f"{proto}://127.0.0.1:{port}"
        self.ipc_dir = tempfile.mkdtemp(prefix="ppserver-")
        local = f"ipc://{self.ipc_dir}/workers"
        self.workers_sock.bind(local)
        self.pool = ProcessPool(
            lambda i: worker_argv(self.cfg.path, connect, index=i, keys=self.keys, worker_endpoint=local), n,
            name="local worker",
        )
        self.pool.start()

    def serve_forever(self) -> None:
        # The feeder thread holds the GIL while it reads and encodes seqs; with the default
        # 5 ms switch interval the I/O loop would wait that long after every wake-up.
        sys.setswitchinterval(0.001)
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.workers_sock, zmq.POLLIN)
        poller.register(self.feed, zmq.POLLIN)
        for mon in self.monitors:
            poller.register(mon, zmq.POLLIN)
        feeding = True
        while not self.stopping:
            want = self.sched.wants_input()
            if want != feeding:
                poller.modify(self.feed, zmq.POLLIN if want else 0)
                feeding = want
            ready = want and self.feeder is not None and bool(self.feeder.out)
            events = dict(poller.poll(0 if ready else LOOP_MS))
            if self.workers_sock in events:
                self._drain(self.workers_sock, self._on_worker)
            if self.control in events:
                self._drain(self.control, self._on_control)
            if self.feed in events or ready:
                self._guarded(self._pull_inputs)
            for mon in self.monitors:
                if mon in events:
                    self._on_monitor(mon)
            self._guarded(self._housekeeping)
            self._flush()

    def shutdown(self) -> None:
        log.info("shutting down")
        if self.feeder is not None:
            self.feeder.stop()
        if self.pool is not None:
            self.pool.stop(timeout=3.0)
        feeder_stuck = False
        if self.feeder is not None:
            self.feeder.join(timeout=1.0)
            feeder_stuck = self.feeder.is_alive()
        for sock in self.monitors:
            sock.close(linger=0)
        for sock in (self.control, self.workers_sock, self.feed):
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if feeder_stuck:  # its socket is still open; term() would wait for it forever
            log.warning("the feeder thread is still inside the dataset; exiting without waiting for it")
        else:
            self.ctx.term()

    # ---- I/O helpers ------------------------------------------------------------------
    def _drain(self, sock: zmq.Socket, handler, limit: int = 256) -> None:
        for _ in range(limit):
            if not sock.get(zmq.EVENTS) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(copy=False)
            try:
                handler(frames)
            except Exception as exc:  # nothing a peer sends may stop the loop
                self._bad_message(exc)

    def _guarded(self, step) -> None:
        """An unexpected error fails the current epoch (the client hears of it); the server stays up."""
        try:
            step()
        except Exception as exc:
            log.exception("internal error in %s", step.__name__)
            self.sched.fail_run(f"internal server error: {type(exc).__name__}: {exc}", kind="server")

    def _bad_message(self, exc: Exception) -> None:
        self.malformed.hit(f"{type(exc).__name__}: {exc}")

    def _send(self, sock: zmq.Socket, frames: List[Any]) -> bool:
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or would block
            log.debug("send failed: %s", exc)
            return False

    def _flush(self) -> None:
        outbox = self.sched.outbox
        if not outbox:
            return
        self.sched.outbox = []
        for dest, ident, frames in outbox:
            sock = self.workers_sock if dest == "worker" else self.control
            self._send(sock, [ident, *frames])

    def _reply(self, ident: bytes, header: Dict[str, Any]) -> None:
        header.setdefault("proto", wire.PROTOCOL)
        self._send(self.control, [ident, b"", wire.pack(header)])

    # ---- control socket ---------------------------------------------------------------
    def _on_control(self, frames: List[Any]) -> None:
        ident = frames[0].bytes
        if len(frames) < 3 or len(frames[1]) != 0:
            self._bad_message(wire.WireError("control message without an empty delimiter frame"))
            return
        try:
            header, _ = wire.split(frames[2:])
        except wire.WireError as exc:
            self._bad_message(exc)
            self._reply(ident, {"ok": False, "error": f"malformed request: {exc}", "proto": wire.PROTOCOL})
            return
        op = header.get("op")
        if op == "credit":  # data stream: no reply
            self.sched.on_client_credit(ident, header.get("run"), header.get("total"))
            return
        mismatch = wire.protocol_mismatch(header.get("proto"), "the client")
        if mismatch:
            log.warning("refused a request: %s", mismatch)
            self._reply(ident, {"ok": False, "error": mismatch, "kind": "protocol", "proto": wire.PROTOCOL})
            return
        if op == "info":
            self._reply(ident, {"ok": True, "proto": wire.PROTOCOL, **self.info()})
        elif op == "status":
            self._reply(ident, {"ok": True, "proto": wire.PROTOCOL, "status": self.status()})
        elif op == "epoch":
            self._reply(ident, self._start_epoch(header))
        elif op == "worker_hello":
            self._reply(ident, {"ok": True, "proto": wire.PROTOCOL, "worker_endpoint": self.worker_address})
        else:
            self._reply(ident, {"ok": False, "error": f"unknown op {op!r}", "proto": wire.PROTOCOL})

    def info(self) -> Dict[str, Any]:
        preserves = not self.cfg.is_stream or self.cfg.preserves_num_seqs is True
        return {
            "data_keys": self.out_templates,
            "input_keys": self.in_templates,
            "num_seqs": self.dataset.total_num_seqs if preserves else None,
            "mode": "map_seq_stream" if self.cfg.is_stream else "map_seq",
            "stream_partitions": self.cfg.partitions if self.cfg.is_stream else None,
            "buf_size": self.cfg.buf_size,
        }

    def status(self) -> Dict[str, Any]:
        st = self.sched.status(time.monotonic())
        st.update({
            "address": self.address,
            "worker_address": self.worker_address,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "local_workers": self.pool.alive() if self.pool else 0,
            "local_worker_respawns": self.pool.respawns if self.pool else 0,
            "malformed_messages": self.malformed.count,
            "refused_handshakes": self.refused.count,
        })
        return st

    def _start_epoch(self, header: Dict[str, Any]) -> Dict[str, Any]:
        epoch = header.get("epoch")
        seq_list = header.get("seq_list")
        seq_order = header.get("seq_order")
        stream_id = header.get("stream_id")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            return {"ok": False, "error": f"epoch must be an int >= 0, got {epoch!r}"}
        if not isinstance(stream_id, bytes) or not 0 < len(stream_id) <= 255:
            return {"ok": False, "error": "stream_id must be 1 to 255 bytes"}
        if seq_list is not None and not (isinstance(seq_list, list) and all(isinstance(t, str) for t in seq_list)):
            return {"ok": False, "error": "seq_list must be a list of str"}
        if seq_order is not None and not (isinstance(seq_order, list) and all(
                isinstance(i, int) and not isinstance(i, bool) for i in seq_order)):
            return {"ok": False, "error": "seq_order must be a list of int"}
        if self.cfg.is_stream and (seq_list is not None or seq_order is not None):
            return {"ok": False, "error": "map_seq_stream is set: seq_list and seq_order are not supported"}
        if self.feeder is not None:
            self.feeder.stop()
        with self.dataset_lock:
            try:
                self.dataset.init_seq_order(epoch, seq_list=seq_list, seq_order=seq_order)
            except (ValueError, KeyError, IndexError) as exc:
                msg = exc.args[0] if exc.args else str(exc)
                return {"ok": False, "error": f"cannot start epoch {epoch}: {msg}"}
            except Exception as exc:  # a dataset bug must not leave the client waiting
                log.exception("the dataset failed to start epoch %d", epoch)
                return {"ok": False, "error": f"cannot start epoch {epoch}: {type(exc).__name__}: {exc}"}
            num_seqs = self.dataset.num_seqs
        self.run_counter += 1
        run = self.run_counter
        log.info("epoch %d requested (run %d, %d input seqs)", epoch, run, num_seqs)
        self.sched.start_run(run=run, epoch=epoch, num_seqs=num_seqs, stream_id=stream_id,
                             stream=self.cfg.is_stream, partitions=self.cfg.partitions,
                             check_tags=seq_list is not None)
        self.feeder = Feeder(ctx=self.ctx, wake_endpoint=FEEDER_ENDPOINT, dataset=self.dataset,
                             lock=self.dataset_lock, run=run, num_seqs=num_seqs)
        self.feeder.start()
        known = not self.cfg.is_stream or self.cfg.preserves_num_seqs is True
        return {"ok": True, "proto": wire.PROTOCOL, "run": run, "num_seqs": num_seqs if known else None}

    def _reread(self, pos: int):
        """Read one input again (a stream partition restarting on another worker)."""
        with self.dataset_lock:
            seq = self.dataset.get_seq(pos)
        return wire.seq_to_item(seq, i=pos)

    # ---- feeder -----------------------------------------------------------------------
    def _pull_inputs(self) -> None:
        while self.feed.poll(0):
            self.feed.recv()  # wake-ups carry nothing; the events wait in the current feeder's queue
        feeder = self.feeder
        while feeder is not None and self.sched.wants_input():
            event = feeder.take()
            if event is None:
                return
            if event[0] == "in":
                self.sched.on_inputs(feeder.run_id, event[1])
            elif event[0] == "fed":
                self.sched.on_fed(feeder.run_id, event[1])
            else:
                self.sched.fail_run(event[1], kind="dataset", traceback=event[2])

    # ---- worker socket ----------------------------------------------------------------
    def _on_worker(self, frames: List[Any]) -> None:
        ident = frames[0].bytes
        now = time.monotonic()
        if ident.endswith(HB_SUFFIX):
            if not self.sched.touch(ident[: -len(HB_SUFFIX)], now):
                self._send(self.workers_sock, [ident, wire.pack({"t": "unknown"})])
            return
        header, bufs = wire.split(frames[1:])
        t = header.get("t")
        if t == "hello":
            self._on_hello(ident, header, now)
            return
        if not self.sched.touch(ident, now):
            if t != "bye":
                self._send(self.workers_sock, [ident, wire.pack({"t": "unknown"})])
            return
        if t == "result":
            self.sched.on_results(ident, header.get("run"), wire.unpack_batch(header, bufs))
        elif t == "sout":
            self.sched.on_stream_outputs(ident, header, wire.unpack_batch(header, bufs))
        elif t == "sack":
            self.sched.on_stream_ack(ident, header)
        elif t == "sdone":
            self.sched.on_stream_done(ident, header)
        elif t == "fail":
            self.sched.on_failure(ident, header)
        elif t == "bye":
            self.sched.remove_worker(ident, "departed")
        elif t != "hb":
            log.warning("dropped a %r message from worker %r", t, ident[:64])

    def _on_hello(self, ident: bytes, header: Dict[str, Any], now: float) -> None:
        host = str(header.get("host", "?"))[:255]
        pid = header.get("pid") if isinstance(header.get("pid"), int) else -1
        reason = wire.protocol_mismatch(header.get("proto"), "the worker")
        if reason is None and header.get("fingerprint") != self.cfg.fingerprint:
            reason = (f"config fingerprint mismatch: worker has {str(header.get('fingerprint'))[:32]!r} "
                      "(the config file, its mapper source or the ppserver version differs from the server's)")
        if reason:
            log.error("refused worker %s pid %s: %s", host, pid, reason)
            self._send(self.workers_sock, [ident, wire.pack({"t": "refuse", "reason": reason})])
            return
        if ident in self.sched.workers:
            self.sched.remove_worker(ident, "registered again")
        old = header.get("replaces")
        if isinstance(old, bytes) and old in self.sched.workers and self.sched.workers[old].pid == pid:
            self.sched.remove_worker(old, "reconnected")  # its connection was reset: redo its work now
        self.sched.add_worker(ident, host, pid, now)
        log.info("worker %s joined (host %s pid %s); %d workers", ident.decode("utf8", "replace"), host, pid,
                 len(self.sched.workers))
        self._send(self.workers_sock, [ident, wire.pack({
            "t": "welcome", "templates": self.out_templates, "proto": wire.PROTOCOL})])

    # ---- periodic ---------------------------------------------------------------------
    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self.last_housekeeping < HOUSEKEEPING_S:
            return
        self.last_housekeeping = now
        if self.pool is not None:
            for _, pid, rc in self.pool.poll():
                for wid, w in list(self.sched.workers.items()):
                    if w.pid == pid and w.host == self.hostname:
                        self.sched.remove_worker(wid, f"died (exit {rc})")
        timeout = self.cfg.heartbeat_timeout
        for wid, w in list(self.sched.workers.items()):
            if now - w.last_seen > timeout:
                self.sched.remove_worker(wid, f"lost (no heartbeat for {now - w.last_seen:.1f} s)")
        if now - self.last_hb >= self.cfg.heartbeat_interval:
            self.last_hb = now
            hb = wire.pack({"t": "hb"})
            for wid in self.sched.workers:
                self._send(self.workers_sock, [wid + HB_SUFFIX, hb])
            run = self.sched.run
            if run is not None and not run.finished:
                self._send(self.control, [run.stream_id, b"", wire.pack(
                    {"t": "hb", "run": run.run, "delivered": run.delivered, "workers": len(self.sched.workers)})])
        run = self.sched.run
        if run is not None and run.finished and self.feeder is not None and self.feeder.is_alive():
            self.feeder.stop()


class _Throttled:
    """Counts events a peer can cause at will and logs at most one line per second about them."""

    def __init__(self, what: str):
        self.what = what
        self.count = 0
        self.logged_at = 0.0

    def hit(self, detail: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= 1.0:
            self.logged_at = now
            total = f" ({self.count} so far)" if self.count > 1 else ""
            log.warning("%s: %s%s", self.what, detail, total)


def serve(cfg: Config, *, bind: str, worker_bind: Optional[str], workers: int, keys: Optional[str],
          insecure: bool) -> int:
    server = Server(cfg, bind=bind, worker_bind=worker_bind, keys=keys, insecure=insecure)

    def _stop(signum, frame):
        server.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server.start_local_workers(workers)
        log.info("serving %s on %s (workers connect to %s); %d local workers",
                 cfg.path, server.address, server.worker_address, workers)
        print(f"ready {server.address}", flush=True)
        server.serve_forever()
    finally:
        server.shutdown()
    return 0


def setup_logging(name: str = "ppserver") -> None:
    logging.basicConfig(level=os.environ.get("PPSERVER_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s")
