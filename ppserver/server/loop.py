"""The server process: its sockets, its loop, its local workers.

Sockets:
- control ROUTER at --bind: clients' REQ requests (see control.py) and their DEALER data
  streams (credit in, seqs out); frames are capped at max_request_bytes, and a message of
  more frames than a control message has is dropped as it is read;
- worker ROUTER at --worker-bind (default: the --bind host, any port), plus a private Unix
  socket for local workers: registration, tasks, results, heartbeats;
- a pipe from the reader thread, which alone calls the dataset.

The loop decodes every message with the protocol module, turns it into a scheduler event,
and performs the instructions the scheduler returns. Results go from worker to client as
the frames they arrived in; only their headers are checked.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Set, TextIO, Tuple

import numpy
import zmq

import ppclient
from ppclient import curve, endpoints, keyfiles, protocol, shm
from ppclient.protocol import Channel, Item, Peer
from ppclient.throttle import Throttled
from ppserver.config.settings import FINGERPRINT_COVERS, Config
from ppserver.datasets import make_dataset
from ppserver.errors import ConfigError
from ppserver.observe.monitor import Monitor
from ppserver.scheduler import (
    InputPath,
    Instruction,
    Prepare,
    Read,
    Replay,
    Reply,
    Scheduler,
    Settings,
    StopReading,
    ToClient,
    ToWorker,
)
from ppserver.scheduler import events as ev
from ppserver.server import reader as rd
from ppserver.server.control import Control
from ppserver.server.owners import OwnerWatch
from ppserver.transport import cma
from ppserver.worker import memory
from ppserver.worker.pool import ProcessPool, worker_argv
from ppserver.worker.threads import thread_env

log = logging.getLogger("ppserver.server")

LOOP_MS = 100
TICK_S = 0.01
DRAIN_LIMIT = 256  # messages taken from one socket before the others get a turn
READER_STOP_S = 1.0
# A control message, as the control ROUTER receives it: the sender's identity, the empty
# delimiter and the header. A message of more frames is junk.
CONTROL_FRAMES = 3
# The memory of a message of more frames (ZeroMQ assembles it whole before the loop can look
# at it) is given back to the OS as it is dropped, at most once in this many seconds.
GIVE_BACK_S = 1.0


class Server:
    def __init__(
        self,
        cfg: Config,
        *,
        bind: str = "tcp://127.0.0.1:5555",
        worker_bind: Optional[str] = None,
        keys: Optional[str] = None,
        insecure: bool = False,
        metrics: Optional[Tuple[str, int]] = None,
    ):
        self.cfg = cfg
        for option, endpoint in (("--bind", bind), ("--worker-bind", worker_bind)):
            if endpoint and not endpoints.is_loopback(endpoint) and not keys and not insecure:
                raise ConfigError(option, f"{endpoint} is not a loopback address: pass --keys DIR or --insecure")
        if insecure and not keys:
            log.warning("serving without encryption or authentication (--insecure)")
        self.keys_dir = keys  # passed on to local workers
        self.keys = keyfiles.server_keys(keys) if keys else None
        self.dataset = make_dataset(cfg.dataset, order_seed=cfg.seed)
        # Everything the I/O thread needs from the dataset is read now, before serving.
        try:
            self.in_templates = self.dataset.data_keys()
            # seqs per epoch: the corpus, unless each epoch is a part of it
            whole = getattr(self.dataset, "partition_epoch", 1) == 1
            self.total_num_seqs = getattr(self.dataset, "total_num_seqs", None) if whole else None
        except ConfigError:
            raise
        except Exception as exc:
            text = " ".join(str(exc).split())
            raise ConfigError(
                "dataset", f"{type(self.dataset).__name__} failed to describe its data: {type(exc).__name__}: {text}"
            ) from None
        self.out_templates = cfg.map_outputs or self.in_templates
        self.sched = Scheduler(
            Settings(
                buf_size=cfg.buf_size,
                max_seq_retries=cfg.max_seq_retries,
                heartbeat_interval=cfg.heartbeat_interval,
                heartbeat_timeout=cfg.heartbeat_timeout,
                stream=cfg.is_stream,
                partitions=cfg.partitions,
                preserves_num_seqs=not cfg.is_stream or cfg.preserves_num_seqs is True,
                direct=cfg.direct_results and not cfg.is_stream,
                fingerprint=cfg.fingerprint,
                instance=os.urandom(8).hex(),
            )
        )
        self.ctx = zmq.Context()
        self.auth = self._authenticator()
        self.control = self._router(bind, cfg.max_request_bytes)
        if worker_bind is None:
            worker_bind = bind + ".workers" if bind.startswith("ipc://") else f"tcp://{endpoints.host_port(bind)[0]}:0"
        self.workers_sock = self._router(worker_bind, cfg.max_message_bytes)
        self.address = _endpoint_of(self.control)
        self.worker_address = _endpoint_of(self.workers_sock)
        self.monitors = self._monitors() if keys else []
        self.reader = rd.Reader(self.dataset, cfg.batch_length, _length_key(self.in_templates))
        self.monitor = Monitor(
            self.sched,
            self.reader,
            stream=cfg.is_stream,
            progress_interval=cfg.progress_interval,
            metrics=metrics,
        )
        self.stages = self.monitor.stages  # the hooks below time each seq's stages
        self.ctl = Control(
            cfg,
            self.sched,
            info=self._info(),
            status=self.status,
            worker_address=lambda: self.worker_address,
            observe=self.stages.on_event,
            length_keys=tuple(self.out_templates if cfg.is_stream else self.in_templates),
        )
        self.stopping = False
        self.started = time.monotonic()
        self.pool: Optional[ProcessPool] = None
        self.ipc_dir: Optional[str] = None
        self.last_tick = 0.0
        self._performers: Dict[type, Callable[[Any], None]] = {
            ToWorker: self._to_worker,
            ToClient: self._to_client,
            Reply: lambda i: self._reply(i.requester, i.msg),
            Prepare: lambda i: self.reader.send(rd.Prepare(i.run, i.epoch, i.seq_list, i.seq_order, i.batching)),
            Read: lambda i: self.reader.send(rd.Read(i.run, i.positions)),
            Replay: lambda i: self.reader.send(rd.Replay(i.run, i.partition, i.ticket, i.positions)),
            StopReading: lambda i: self.reader.send(rd.Stop(i.run)),
        }
        # Shared memory for the inputs of workers on this host: one segment each, used once the
        # worker has mapped it.
        self.host_id = shm.usable_host_id(log, "inputs of local workers go") if cfg.shm_mb > 0 else ""
        self.segments: Dict[bytes, shm.Segment] = {}
        self.shm_ready: Set[bytes] = set()
        # Workers on this host that read their inputs in this process's memory (cma.py): they are
        # told only where each array lies. The token lets a worker check that reading works.
        self.cma_token = numpy.frombuffer(os.urandom(32), numpy.uint8).copy()
        self.cma_ready: Set[bytes] = set()
        self.malformed = Throttled(log, "dropped a malformed message")
        self.segments_full = Throttled(log, "inputs went over the socket", interval=10.0)
        self.refused = Throttled(log, "refused a connection")
        self.given_back_at = float("-inf")

    # ---- sockets ------------------------------------------------------------------------------
    def _authenticator(self) -> Any:
        """Accept only clients and workers whose public key is authorised. A refusal is logged through
        the `refused` throttle but counted by the handshake monitor, which sees the handshake fail."""
        if self.keys is None:
            return None
        return curve.authenticator(
            self.ctx, self.keys.authorized, lambda why: self.refused.hit(why, 0), logging.getLogger("ppserver.auth")
        )

    def _router(self, endpoint: str, max_bytes: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.router_mandatory = 1
        sock.sndhwm = 0
        sock.rcvhwm = 0
        sock.maxmsgsize = max_bytes
        if self.keys is not None:
            self.keys.apply(sock)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot bind {endpoint}: {exc}") from None
        return sock

    def _monitors(self) -> List[zmq.Socket]:
        """Watch CURVE handshakes so that peers with wrong or missing keys show up in the log."""
        events = (
            zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        return [self.control.get_monitor_socket(events), self.workers_sock.get_monitor_socket(events)]

    def _on_monitor(self, sock: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(sock, flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.refused.hit(
                f"on {event.get('endpoint', b'?').decode(errors='replace')}: CURVE handshake failed "
                f"({zmq.Event(event['event']).name}; wrong or missing keys)"
            )

    # ---- lifecycle ----------------------------------------------------------------------------
    def start_local_workers(self, n: int) -> None:
        """Local workers reach the worker socket over a Unix socket in a private directory:
        cheaper than loopback TCP for large seqs."""
        if n <= 0:
            return
        connect = endpoints.reachable(self.address, self.address)
        self.ipc_dir = tempfile.mkdtemp(prefix="ppserver-")
        local = f"ipc://{self.ipc_dir}/workers"
        self.workers_sock.bind(local)
        self.pool = ProcessPool(
            lambda i: worker_argv(
                self.cfg.path,
                connect,
                index=i,
                keys=self.keys_dir,
                worker_endpoint=local,
                local=True,
                returnn_dataset=self.cfg.returnn_dataset,
            ),
            n,
            name="local worker",
            env=thread_env(self.cfg.worker_threads),
        )
        self.pool.start()

    def serve_forever(self) -> None:
        # The reader thread holds the GIL while it reads and encodes seqs; with the default
        # 5 ms switch interval the I/O loop would wait that long after every wake-up.
        sys.setswitchinterval(0.001)
        self.reader.start()
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.workers_sock, zmq.POLLIN)
        poller.register(self.reader.wake_r, zmq.POLLIN)
        for mon in self.monitors:
            poller.register(mon, zmq.POLLIN)
        reader = self.reader
        while not self.stopping:
            timeout = 0 if reader.out else rd.READING_POLL_MS if reader.reading else LOOP_MS
            events = dict(poller.poll(timeout))
            if self.workers_sock in events:
                self._drain(self.workers_sock, self._on_worker)
            if self.control in events:
                self._drain(self.control, self._on_control, max_frames=CONTROL_FRAMES)
            if self.reader.wake_r in events or self.reader.out:
                self.reader.drain_wakeups()
                self._guarded(self._take_reader_events)
            for mon in self.monitors:
                if mon in events:
                    self._on_monitor(mon)
            self._guarded(self._housekeeping)

    def shutdown(self) -> None:
        log.info("shutting down")
        if self.pool is not None:
            self.pool.stop(timeout=3.0)
        stuck = self.reader.is_alive() and not self.reader.stop(READER_STOP_S)
        for sock in self.monitors:
            sock.close(linger=0)
        for sock in (self.control, self.workers_sock):
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        for wid in list(self.segments):
            self._drop_segment(wid)
        self.monitor.close()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if stuck:
            log.warning(
                "the reader thread is still inside the dataset (%s); exiting without it",
                self.reader.describe_busy(time.monotonic()) or "busy",
            )
        self.ctx.term()  # the reader holds no socket, so nothing can keep this waiting

    # ---- performing instructions ----------------------------------------------------------------
    def perform(self, instructions: List[Instruction]) -> None:
        for instr in instructions:
            self._performers[type(instr)](instr)

    def _to_worker(self, instr: ToWorker) -> None:
        ident = instr.wid + protocol.HEARTBEAT_SUFFIX if instr.heartbeat else instr.wid
        items = instr.items
        self.stages.to_worker(instr, self.sched.now)
        if not items:
            self._send(self.workers_sock, [ident, *protocol.encode(instr.msg)])
            return
        # Inputs by address (a worker reading this process's memory: the scheduler keeps each input
        # until its result is settled), in a block of the worker's segment, or in the message; one
        # message unless headers are huge (encoded once: each costs about a microsecond per seq)
        if instr.wid in self.cma_ready and type(instr.msg) is protocol.Tasks:
            spans = protocol.to_spans(items)
            if spans is not None:
                items = spans
        elif instr.wid in self.shm_ready:  # a block per message (a receiver's lease covers one message)
            for msg, part in protocol.split_fitting(instr.msg, items, placed=True):
                self._send_in_block(ident, instr.wid, msg, part)
            return
        for frames in protocol.encode_fitting(instr.msg, items):
            self._send(self.workers_sock, [ident, *frames])

    def _send_in_block(self, ident: bytes, wid: bytes, msg: protocol.Message, items: List[Item]) -> None:
        """Inputs in a block of the worker's segment (or, if it is full, in the message); a block of
        a message that was not sent is given back."""
        block = None
        if wid in self.shm_ready:
            segment = self.segments[wid]
            items, block = protocol.to_block(items, segment)  # the worker frees it when done
            if block is None:
                self.segments_full.hit(
                    lambda: (
                        f"worker {wid.decode(errors='replace')}'s shared-memory segment is full "
                        f"({segment.used() / 2**20:.1f} of {segment.capacity / 2**20:.1f} MiB in use)"
                    ),
                    len(items),
                )
        if not self._send(self.workers_sock, [ident, *protocol.encode(msg, items)]) and block is not None:
            block.release()

    def _to_client(self, instr: ToClient) -> None:
        self.stages.to_client(instr, self.sched.now)
        for frames in protocol.encode_fitting(instr.msg, instr.items):
            self._send(self.control, [instr.consumer, protocol.DELIMITER, *frames])

    def handle(self, event: ev.Event) -> None:
        self.stages.on_event(event)
        self.perform(self.sched.handle(event))

    def _send(self, sock: zmq.Socket, frames: List[Any]) -> bool:
        try:
            sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:  # peer gone (ROUTER_MANDATORY) or would block
            log.debug("send failed: %s", exc)
            return False

    def _drain(self, sock: zmq.Socket, handler: Callable[[List[Any]], None], max_frames: Optional[int] = None) -> None:
        for _ in range(DRAIN_LIMIT):
            if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(copy=False) if max_frames is None else self._recv_at_most(sock, max_frames)
            if frames is None:
                continue  # dropped
            try:
                handler(frames)
            except protocol.ProtocolError as exc:
                self.malformed.hit(str(exc))
            except Exception:  # nothing a peer sends may stop the loop
                log.exception("internal error handling a message")
                self._fail_live_runs("internal server error while handling a message")

    def _recv_at_most(self, sock: zmq.Socket, max_frames: int) -> Optional[List[zmq.Frame]]:
        """The next message, or None if it has more than `max_frames` frames: such junk is dropped
        frame by frame as it is read (ZeroMQ holds the whole message already), and its memory is
        given back to the OS (at most once a second)."""
        frames = [sock.recv(copy=False)]
        while frames[-1].more and len(frames) <= max_frames:
            frames.append(sock.recv(copy=False))
        if len(frames) <= max_frames:
            return frames
        count, nbytes, more = len(frames), sum(len(f) for f in frames), frames[-1].more
        now = time.monotonic()
        give_back = now - self.given_back_at >= GIVE_BACK_S
        if give_back:
            self.given_back_at = now
        with memory.given_back() if give_back else contextlib.nullcontext():
            frames.clear()
            while more:
                frame = sock.recv(copy=False)
                count, nbytes, more = count + 1, nbytes + len(frame), frame.more
                del frame  # freed at once
        self.malformed.hit(f"a control message of {count} frames ({nbytes} bytes); control messages have {max_frames}")
        return None

    def _guarded(self, step: Callable[[], None]) -> None:
        """An unexpected error fails the live runs (their clients hear of it); the server stays up."""
        try:
            step()
        except Exception as exc:
            log.exception("internal error in %s", step.__name__)
            self._fail_live_runs(f"internal server error: {type(exc).__name__}: {exc}")

    def _fail_live_runs(self, message: str) -> None:
        now = time.monotonic()
        for run in list(self.sched.runs):
            try:
                self.handle(ev.RunFailedElsewhere(now, run, message))
            except Exception:
                log.exception("failing run %d failed", run)

    # ---- control socket -------------------------------------------------------------------------
    def _on_control(self, frames: List[Any]) -> None:
        ident = frames[0].bytes
        if len(frames) != CONTROL_FRAMES or len(frames[1]) != 0:
            self.malformed.hit("control message without an empty delimiter frame and one header")
            return
        try:
            msg = protocol.decode(frames[2:], Peer.SERVER, (Channel.CONTROL, Channel.DATA)).msg
        except protocol.VersionMismatch as exc:
            log.warning("refused a request: %s", protocol.mismatch_text(exc.theirs, "the client"))
            self._reply(
                ident, protocol.ErrorReply(error=protocol.mismatch_text(exc.theirs, "the client"), reason="protocol")
            )
            return
        except protocol.ProtocolError as exc:
            self.malformed.hit(str(exc))
            self._reply(ident, protocol.ErrorReply(error=f"malformed request: {exc}"))
            return
        reply, instructions = self.ctl.handle(ident, msg)
        if reply is not None:
            self._reply(ident, reply)
        self.perform(instructions)

    def _reply(self, ident: bytes, msg: protocol.Message) -> None:
        self._send(self.control, [ident, protocol.DELIMITER, *protocol.encode(msg)])

    def _info(self) -> Dict[str, Any]:
        preserves = not self.cfg.is_stream or self.cfg.preserves_num_seqs is True
        return {
            "data_keys": self.out_templates,
            "input_keys": self.in_templates,
            "num_seqs": self.total_num_seqs if preserves else None,
            "mode": "map_seq_stream" if self.cfg.is_stream else "map_seq",
            "stream_partitions": self.cfg.partitions if self.cfg.is_stream else None,
            "buf_size": self.cfg.buf_size,
            "version": ppclient.__version__,
            "fingerprint": self.cfg.fingerprint,
            "instance": self.sched.settings.instance,
            "batching": None if self.cfg.batching is None else self.cfg.batching.to_dict(),
        }

    def status(self) -> Dict[str, Any]:
        now = time.monotonic()
        st = self.sched.status(now)
        st.update(
            {
                "address": self.address,
                "worker_address": self.worker_address,
                "version": ppclient.__version__,
                "uptime_s": round(now - self.started, 1),
                "local_workers": self.pool.alive() if self.pool else 0,
                "local_worker_respawns": self.pool.respawns if self.pool else 0,
                "malformed_messages": self.malformed.count,
                "refused_handshakes": self.refused.count,
                "dataset": self.reader.describe_busy(now) or "idle",
            }
        )
        st.update(self.monitor.status(st))
        return st

    # ---- reader -------------------------------------------------------------------------------
    def _take_reader_events(self) -> None:
        while True:
            event = self.reader.take(time.monotonic())
            if event is None:
                return
            self.handle(event)

    # ---- worker socket ------------------------------------------------------------------------
    def _on_worker(self, frames: List[Any]) -> None:
        ident = frames[0].bytes
        now = time.monotonic()
        if ident.endswith(protocol.HEARTBEAT_SUFFIX):
            msg = protocol.decode(frames[1:], Peer.SERVER, (Channel.WORKER,)).msg
            if isinstance(msg, protocol.Heartbeat):
                wid = ident[: -len(protocol.HEARTBEAT_SUFFIX)]
                self.stages.heartbeat(wid, msg.stats)
                self.handle(ev.HeartbeatReceived(now, wid))
            return
        try:
            decoded = protocol.decode(frames[1:], Peer.SERVER, (Channel.WORKER,))
        except protocol.VersionMismatch as exc:
            if exc.msg_kind == protocol.Hello.kind:
                reason = protocol.mismatch_text(exc.theirs, "the worker")
                log.error("refused a worker: %s", reason)
                self._send(self.workers_sock, [ident, *protocol.encode(protocol.Refuse(reason=reason))])
                return
            self._undecodable(now, ident, exc)
            return
        except protocol.ProtocolError as exc:
            self._undecodable(now, ident, exc)
            return
        msg = decoded.msg
        event = self._worker_event(now, ident, msg, decoded)
        if event is not None:
            self.handle(event)

    def _undecodable(self, now: float, wid: bytes, exc: protocol.ProtocolError) -> None:
        """A worker's message that does not decode may have held results: a registered worker's
        seqs and stream partitions are charged with it and redone elsewhere."""
        self.malformed.hit(f"from worker {wid.decode(errors='replace')[:64]}: {exc}")
        if wid in self.sched.workers:
            self.handle(ev.WorkerMessageMalformed(now, wid, str(exc)))

    def _worker_event(self, now: float, wid: bytes, msg: Any, decoded: protocol.Decoded) -> Optional[ev.Event]:
        """The scheduler event for a checked message from a worker (None: nothing for the scheduler)."""
        kind = type(msg)
        if kind is protocol.Results:
            return ev.ResultsReceived(now, wid, msg.run, decoded.items, decoded.bad)
        if kind is protocol.ShmMapped:
            return ev.InputsShared(now, wid, self._on_shm_mapped(wid, msg))
        if kind is protocol.Completed:
            return ev.CompletedReceived(now, wid, msg.run, msg.pos, msg.nbytes)
        if kind is protocol.InputsLost:
            if wid in self.sched.workers and (wid in self.cma_ready or wid in self.shm_ready):
                # the server keeps every input a worker may still read, so this way of getting them
                # failed: from now on (the redone ones included) they travel in the messages
                log.warning("worker %s gets its inputs over the socket from now on", wid.decode(errors="replace"))
                self.cma_ready.discard(wid)
                self._drop_segment(wid)
                self.handle(ev.InputsShared(now, wid, InputPath.message()))
            return ev.InputsLost(now, wid, msg.run, msg.pos, msg.reason[:500])
        if kind is protocol.RunDropped:
            return ev.RunDropped(now, wid, msg.run)
        if kind is protocol.Dropped:
            return ev.MessageDropped(now, wid, msg.what, msg.run, msg.partition, msg.pos, msg.reason[:500])
        if kind is protocol.StreamOutputs:
            return ev.StreamOutputsReceived(
                now, wid, msg.run, msg.partition, msg.incarnation, decoded.items, decoded.bad
            )
        if kind is protocol.StreamAck:
            return ev.StreamAcked(now, wid, msg.run, msg.partition, msg.incarnation, msg.n)
        if kind is protocol.Hello:
            return self._admit(now, wid, msg)
        if kind is protocol.TaskFailed:
            return ev.TaskFailed(now, wid, msg.run, msg.pos, msg.seq_tag, msg.message, msg.traceback)
        if kind is protocol.Mapping:
            return ev.MappingReported(now, wid, msg.run, msg.pos, msg.seq_tag)
        if kind is protocol.StreamDone:
            return ev.StreamFinished(now, wid, msg.run, msg.partition, msg.incarnation)
        if kind is protocol.StreamFailed:
            return ev.StreamFailed(
                now, wid, msg.run, msg.partition, msg.incarnation, msg.seq_tag, msg.message, msg.traceback
            )
        if kind is protocol.Bye:
            return ev.WorkerLeft(now, wid)
        return ev.HeartbeatReceived(now, wid)  # the channel admits nothing else from a worker

    def _admit(self, now: float, wid: bytes, hello: protocol.Hello) -> Optional[ev.Event]:
        """Protocol and config must match the server's; then the worker is welcomed and joins."""
        if hello.fingerprint != self.cfg.fingerprint:
            reason = (
                f"config fingerprint mismatch: worker has {hello.fingerprint[:32]!r}, server has "
                f"{self.cfg.fingerprint!r} ({FINGERPRINT_COVERS} differ)"
            )
            log.error("refused worker %s pid %s: %s", hello.host[:255], hello.pid, reason)
            self._send(self.workers_sock, [wid, *protocol.encode(protocol.Refuse(reason=reason))])
            return None
        self._drop_segment(wid)  # of an earlier registration of this identity
        self.cma_ready.discard(wid)
        offer = cma_offer = None
        if self.host_id and hello.host_id == self.host_id:
            cma_offer = cma.offer(self.cma_token) if cma.available() is None else None
            try:
                segment = self.segments[wid] = shm.Segment(self.cfg.shm_mb << 20)
                offer = segment.descriptor.to_dict()
            except (OSError, shm.ShmUnavailable) as exc:
                log.warning("no shared memory for worker %s: %s", wid.decode(errors="replace"), exc)
        self._send(
            self.workers_sock,
            [
                wid,
                *protocol.encode(
                    protocol.Welcome(templates=self.out_templates, inputs=self.in_templates, shm=offer, cma=cma_offer)
                ),
            ],
        )
        return ev.WorkerJoined(now, wid, hello.host[:255], hello.pid, hello.local_index, hello.replaces)

    def _on_shm_mapped(self, wid: bytes, msg: protocol.ShmMapped) -> InputPath:
        """How the worker gets its inputs from now on (see ev.InputsShared); the segment is kept
        only where it is of use."""
        name = wid.decode(errors="replace")
        segment = self.segments.get(wid)
        if msg.cma:
            self.cma_ready.add(wid)
            log.info("worker %s reads its inputs in the server's memory", name)
            if not self.cfg.is_stream:
                self._drop_segment(wid)  # tasks name their inputs by address: the segment would sit unused
                return InputPath.by_address()
        if msg.ok and segment is not None:
            self.shm_ready.add(wid)
            # blocks of a quarter of the segment fit well
            return InputPath.by_address() if msg.cma else InputPath.shared_memory(segment.capacity // 4)
        if segment is not None:
            log.warning("worker %s gets its inputs over the socket: %s", name, msg.reason)
            self._drop_segment(wid)
        return InputPath.by_address() if msg.cma else InputPath.message()

    def _drop_segment(self, wid: bytes) -> None:
        self.shm_ready.discard(wid)
        segment = self.segments.pop(wid, None)
        if segment is not None:
            segment.close()

    # ---- periodic -----------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self.last_tick < TICK_S:
            return
        self.last_tick = now
        for wid in [w for w in self.segments if w not in self.sched.workers]:
            self._drop_segment(wid)  # the worker left: its segment goes once it unmaps it
        if self.cma_ready:
            self.cma_ready.intersection_update(self.sched.workers)
        if self.pool is not None:
            for index, pid, rc in self.pool.poll():
                self.handle(ev.LocalWorkerExited(now, index, pid, rc))
        self.handle(ev.Tick(now, reader_busy=self.reader.describe_busy(now)))
        self.monitor.tick(now, self.status)


def _length_key(templates: Dict[str, Any]) -> Optional[str]:
    """The key whose first axis is a seq's length when a batching names none: `data`, else the first."""
    return "data" if "data" in templates else next(iter(templates), None)


def _endpoint_of(sock: zmq.Socket) -> str:
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)


def serve(
    cfg: Config,
    *,
    bind: str,
    worker_bind: Optional[str],
    workers: int,
    keys: Optional[str],
    insecure: bool,
    metrics: Optional[Tuple[str, int]] = None,
    ready: Optional[TextIO] = None,
    owners: Optional[str] = None,
) -> int:
    """Serve until SIGTERM or SIGINT; `ready` (default: stdout) gets the one line `ready ADDRESS`.
    `owners`: also until no process registered in that folder lives (see owners.py)."""
    memory.keep_freed_memory()
    watch = OwnerWatch(owners, bind) if owners else None
    if watch is not None:
        watch.start()  # before the dataset opens: a trainer that dies meanwhile ends this process too
    try:
        server = Server(cfg, bind=bind, worker_bind=worker_bind, keys=keys, insecure=insecure, metrics=metrics)

        def _stop(signum: int, frame: Any) -> None:
            server.stopping = True

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        try:
            server.monitor.start()
            server.start_local_workers(workers)
            log.info(
                "serving %s on %s (workers connect to %s); %d local workers",
                cfg.path if cfg.returnn_dataset is None else f"{cfg.returnn_dataset!r} of {cfg.path}",
                server.address,
                server.worker_address,
                workers,
            )
            print(f"ready {server.address}", file=ready or sys.stdout, flush=True)
            if watch is not None:
                watch.ready(server.address)
            server.serve_forever()
        finally:
            server.shutdown()
    finally:
        if watch is not None:
            watch.close()
    return 0


def setup_logging(name: str = "ppserver") -> None:
    logging.basicConfig(
        level=os.environ.get("PPSERVER_LOG_LEVEL", "INFO"),
        stream=sys.stderr,
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(message)s",
    )
