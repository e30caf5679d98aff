"""The server process: its sockets, its loop, its local workers.

Sockets:
- control ROUTER at --bind: clients' REQ requests (see control.py) and their DEALER data
  streams (credit in, seqs out); frames are capped at max_request_bytes, and a message of
  more frames than a control message has is dropped as it is read;
- worker ROUTER at --worker-bind (default: the --bind host, any port), plus a private Unix
  socket for local workers: registration, tasks, results, heartbeats;
- a pipe from the reader thread, which alone calls the dataset.

The loop decodes every message with the protocol module, turns it into a scheduler event
(control.py, from_workers.py), and performs the instructions the scheduler returns: messages
to clients and workers (a worker's inputs travel its way: transport/inputs.py) and the
reader's instructions, handed to it as they are. Results go from worker to client as the
frames they arrived in; only their headers are checked.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple

import zmq

import ppclient
from ppclient import endpoints, keyfiles, protocol
from ppclient.batching import default_length_key
from ppclient.protocol import Channel, Peer
from ppclient.shards import CONTIGUOUS, STRIDED
from ppclient.throttle import Throttled
from ppserver.config.fingerprint import served_fingerprint
from ppserver.config.mappers import output_templates
from ppserver.config.settings import Config
from ppserver.datasets import make_dataset
from ppserver.errors import ConfigError, Stopped, one_line
from ppserver.observe.monitor import Monitor
from ppserver.observe.status import ServerStatus
from ppserver.scheduler import (
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
from ppserver.scheduler.elastic import Limits
from ppserver.server import reader as rd
from ppserver.server import sockets
from ppserver.server.control import Control, check_default
from ppserver.server.from_workers import FromWorkers
from ppserver.server.owners import OwnerWatch
from ppserver.server.pool_size import PoolSize
from ppserver.transport.inputs import WorkerInputs
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


def scheduler_settings(cfg: Config, fingerprint: Optional[str] = None) -> Settings:
    """The scheduler's settings: the config's, this server's `fingerprint` (the served one:
    the config's with its dataset's identity) and this server process's id."""
    return Settings(
        buf_size=cfg.buf_size,
        max_seq_retries=cfg.max_seq_retries,
        max_skipped=cfg.max_skipped,
        heartbeat_interval=cfg.heartbeat_interval,
        heartbeat_timeout=cfg.heartbeat_timeout,
        stream=cfg.is_stream,
        partitions=cfg.partitions,
        preserves_num_seqs=cfg.counts_seqs,
        direct=cfg.direct_results and not cfg.is_stream,
        fingerprint=cfg.fingerprint if fingerprint is None else fingerprint,
        instance=os.urandom(8).hex(),
        story_length=cfg.story_length,
    )


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
        elastic: Optional[Limits] = None,
        local_max: int = 0,
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
        self.in_templates, self.total_num_seqs = _describe(self.dataset)
        # a cut by max_duration needs the seqs' seconds: the config's batch_duration or the dataset's
        known = cfg.batch_duration is not None or _knows_durations(self.dataset)
        no_durations = None if known else _no_durations(self.dataset)
        if no_durations is not None and cfg.batching is not None and cfg.batching.max_duration is not None:
            raise ConfigError("batching", no_durations)
        self.out_templates = output_templates(cfg, self.in_templates)
        length_keys = tuple(self.out_templates if cfg.is_stream else self.in_templates)
        check_default(cfg, length_keys, self.out_templates)
        self.fingerprint = served_fingerprint(cfg.fingerprint, _identity(self.dataset))
        # Run ids start at a random point, so a restarted server never reuses an id a client
        # may still hold data for.
        self.sched = Scheduler(scheduler_settings(cfg, self.fingerprint), first_run=1 + random.getrandbits(40))
        self.ctx = zmq.Context()
        self.malformed = Throttled(log, "dropped a malformed message")
        self.refused = Throttled(log, "refused a connection")
        self.auth = sockets.authenticator(self.ctx, self.keys, self.refused)
        self.control = sockets.router(self.ctx, bind, cfg.max_request_bytes, self.keys)
        if worker_bind is None:
            worker_bind = _worker_bind(bind)
        self.workers_sock = sockets.router(self.ctx, worker_bind, cfg.max_message_bytes, self.keys)
        self.address = sockets.endpoint_of(self.control)
        self.worker_address = sockets.endpoint_of(self.workers_sock)
        self.monitors = sockets.handshake_monitors([self.control, self.workers_sock]) if keys else []
        self.reader = rd.Reader(
            self.dataset,
            cfg.batch_length,
            default_length_key({k: (t["dtype"], t["shape"]) for k, t in self.in_templates.items()}),
            cfg.batch_duration,
        )
        self.monitor = Monitor(
            self.sched, self.reader, stream=cfg.is_stream, progress_interval=cfg.progress_interval, metrics=metrics
        )
        self.stages = self.monitor.stages  # the hooks below time each seq's stages
        self.pool: Optional[ProcessPool] = None
        self.sizer = PoolSize(
            self.sched, self.stages, limits=elastic, local_max=local_max, pool=lambda: self.pool, handle=self.handle
        )
        self.sizing_failed_at = float("-inf")
        self.stimuli = ev.Stimuli()  # names every event the server makes; the scheduler names only unnamed ones
        self.ctl = Control(
            cfg,
            self.sched,
            stimuli=self.stimuli,
            info=self._info(),
            status=self.status,
            worker_address=lambda: self.worker_address,
            observe=self.stages.on_event,
            length_keys=length_keys,
            outputs=self.out_templates,
            no_durations=no_durations,
            hosts=self.sizer.host_request,
        )
        self.stopping = False
        self.started = time.monotonic()
        self.ipc_dir: Optional[str] = None
        self.last_tick = 0.0
        self.junk = sockets.Junk(self.malformed)
        self.inputs = WorkerInputs(cfg.shm_mb, cfg.is_stream, lambda frames: sockets.send(self.workers_sock, frames))
        self.from_workers = FromWorkers(
            fingerprint=cfg.worker_fingerprint,
            templates=self.out_templates,
            input_templates=self.in_templates,
            sched=self.sched,
            stimuli=self.stimuli,
            inputs=self.inputs,
            handle=self.handle,
            send=lambda frames: sockets.send(self.workers_sock, frames),
            heartbeat=self.stages.heartbeat,
            malformed=self.malformed,
        )
        self._performers: Dict[type, Callable[[Any], None]] = {
            ToWorker: self._to_worker,
            ToClient: self._to_client,
            Reply: lambda i: self._reply(i.requester, i.msg),
            Prepare: self.reader.send,
            Read: self.reader.send,
            Replay: self.reader.send,
            StopReading: self.reader.send,
        }

    # ---- lifecycle ----------------------------------------------------------------------------
    def start_local_workers(self, n: int) -> None:
        """Local workers reach the worker socket over a Unix socket where one fits: cheaper than
        loopback TCP for large seqs. They run the config as this server loaded it (a snapshot in a
        private directory), so a worker respawned after the file was edited on disk (the next
        experiment prepared) runs this server's config, not the edited one."""
        if n <= 0:
            return
        connect = endpoints.reachable(self.address, self.address)
        self.ipc_dir = tempfile.mkdtemp(prefix="ppserver-")
        snapshot = os.path.join(self.ipc_dir, "config-source")
        with open(snapshot, "wb") as f:
            f.write(self.cfg.source)
        local = self._local_worker_endpoint(self.ipc_dir)
        self.pool = ProcessPool(
            lambda i: worker_argv(
                self.cfg.path,
                connect,
                index=i,
                keys=self.keys_dir,
                worker_endpoint=local,
                local=True,
                returnn_dataset=self.cfg.returnn_dataset,
                config_source=snapshot,
            ),
            n,
            name="local worker",
            env=thread_env(self.cfg.worker_threads),
        )
        self.pool.start()

    def _local_worker_endpoint(self, private: str) -> str:
        """Where local workers connect: the worker socket's own Unix socket, else one bound in the
        private directory, else (a temp path too long for a Unix socket) loopback TCP."""
        if self.worker_address.startswith("ipc://"):
            return self.worker_address
        if endpoints.ipc_fits(f"{private}/workers"):
            self.workers_sock.bind(f"ipc://{private}/workers")
            return f"ipc://{private}/workers"
        if endpoints.is_loopback(self.worker_address):
            return self.worker_address
        self.workers_sock.bind("tcp://127.0.0.1:0")
        return sockets.endpoint_of(self.workers_sock)

    def serve_forever(self) -> None:
        # The reader thread holds the GIL while it reads and encodes seqs; with the default
        # 5 ms switch interval the I/O loop would wait that long after every wake-up.
        sys.setswitchinterval(0.001)
        self.reader.start()
        outbox = self.reader.outbox
        poller = zmq.Poller()
        for sock in (self.control, self.workers_sock, outbox.wake_r, *self.monitors):
            poller.register(sock, zmq.POLLIN)
        while not self.stopping:
            timeout = 0 if outbox.out else rd.READING_POLL_MS if self.reader.reading else LOOP_MS
            events = dict(poller.poll(timeout))
            if self.workers_sock in events:
                self._drain(self.workers_sock, lambda frames: self.from_workers.on_frames(frames, time.monotonic()))
            if self.control in events:
                self._drain(self.control, self._on_control, max_frames=CONTROL_FRAMES)
            if outbox.wake_r in events or outbox.out:
                outbox.drain_wakeups()
                self._guarded(self._take_reader_events)
            for mon in self.monitors:
                if mon in events:
                    sockets.read_monitor(mon, self.refused)
            self._guarded(self._housekeeping)

    def shutdown(self) -> None:
        log.info("shutting down")
        if self.pool is not None:
            self.pool.stop(timeout=3.0)
        stuck = self.reader.is_alive() and not self.reader.stop(READER_STOP_S)
        for sock in (*self.monitors, self.control, self.workers_sock):
            sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.inputs.close()
        self.monitor.close()
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if stuck:
            log.warning(
                "the reader thread is still inside the dataset (%s); exiting without it",
                self.reader.describe_busy(time.monotonic()) or "busy",
            )
        self.ctx.term()  # the reader holds no socket, so nothing can keep this waiting

    # ---- events and instructions --------------------------------------------------------------
    def handle(self, event: ev.Event) -> None:
        """Hand `event` to the scheduler, named (a stimulus id) if it came without a name."""
        if not event.stimulus:
            self.stimuli.name(event)
        self.stages.on_event(event)
        self.perform(self.sched.handle(event))

    def perform(self, instructions: List[Instruction]) -> None:
        for instr in instructions:
            self._performers[type(instr)](instr)

    def _to_worker(self, instr: ToWorker) -> None:
        ident = instr.wid + protocol.HEARTBEAT_SUFFIX if instr.heartbeat else instr.wid
        self.stages.to_worker(instr, self.sched.state.now)
        if instr.items:
            self.inputs.send(ident, instr.wid, instr.msg, instr.items)
        else:
            sockets.send(self.workers_sock, [ident, *protocol.encode(instr.msg)])

    def _to_client(self, instr: ToClient) -> None:
        self.stages.to_client(instr, self.sched.state.now)
        for frames in protocol.encode_fitting(instr.msg, instr.items):
            sockets.send(self.control, [instr.consumer, protocol.DELIMITER, *frames])

    def _reply(self, ident: bytes, msg: protocol.Message) -> None:
        sockets.send(self.control, [ident, protocol.DELIMITER, *protocol.encode(msg)])

    def _take_reader_events(self) -> None:
        while True:
            event = self.reader.outbox.take(time.monotonic())
            if event is None:
                return
            self.handle(event)

    def _drain(self, sock: zmq.Socket, handler: Callable[[List[Any]], None], max_frames: Optional[int] = None) -> None:
        for _ in range(DRAIN_LIMIT):
            if not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
                return
            frames = sock.recv_multipart(copy=False) if max_frames is None else self.junk.recv_at_most(sock, max_frames)
            if frames is None:
                continue  # dropped
            try:
                handler(frames)
            except protocol.ProtocolError as exc:
                self.malformed.hit(str(exc))
            except Exception:  # nothing a peer sends may stop the loop
                log.exception("internal error handling a message")
                self._fail_live_runs("internal server error while handling a message")

    def _guarded(self, step: Callable[[], None]) -> None:
        """An unexpected error fails the live runs (their clients hear of it); the server stays up."""
        try:
            step()
        except Exception as exc:
            log.exception("internal error in %s", step.__name__)
            self._fail_live_runs(f"internal server error: {type(exc).__name__}: {exc}")

    def _fail_live_runs(self, message: str) -> None:
        now = time.monotonic()
        for run in list(self.sched.state.runs):
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
            error = protocol.mismatch_text(exc.theirs, "the client")
            log.warning("refused a request: %s", error)
            self._reply(ident, protocol.ErrorReply(error=error, reason=protocol.RefusalReason.PROTOCOL.value))
            return
        except protocol.ProtocolError as exc:
            self.malformed.hit(str(exc))
            self._reply(ident, protocol.ErrorReply(error=f"malformed request: {exc}"))
            return
        reply, instructions = self.ctl.handle(ident, msg)
        if reply is not None:
            self._reply(ident, reply)
        self.perform(instructions)

    def _info(self) -> Dict[str, Any]:
        return {
            "data_keys": self.out_templates,
            "input_keys": self.in_templates,
            "num_seqs": self.total_num_seqs if self.cfg.counts_seqs else None,
            "mode": "map_seq_stream" if self.cfg.is_stream else "map_seq",
            "stream_partitions": self.cfg.partitions if self.cfg.is_stream else None,
            "buf_size": self.cfg.buf_size,
            "version": ppclient.__version__,
            "fingerprint": self.fingerprint,
            "config_fingerprint": self.cfg.fingerprint,
            "instance": self.sched.state.settings.instance,
            "batching": None if self.cfg.batching is None else self.cfg.batching.to_dict(),
            "shardings": self._shardings(),
        }

    def _shardings(self) -> List[str]:
        """How ranks may shard an epoch here: contiguous needs map_seq and a dataset that reads any
        position and knows its count (server/shards.py)."""
        random_access = getattr(self.dataset, "random_access", True)
        return [STRIDED, CONTIGUOUS] if random_access and not self.cfg.is_stream else [STRIDED]

    def status(self) -> ServerStatus:
        now = time.monotonic()
        st = self.sched.status(now)
        return ServerStatus(
            scheduler=st,
            address=self.address,
            worker_address=self.worker_address,
            version=ppclient.__version__,
            uptime_s=round(now - self.started, 1),
            local_workers=self.pool.alive() if self.pool else 0,
            local_worker_respawns=self.pool.respawns if self.pool else 0,
            malformed_messages=self.malformed.count,
            refused_handshakes=self.refused.count,
            dataset=self.reader.describe_busy(now),
            pool=self.sizer.status(now),
            progress=self.monitor.status(st),
        )

    # ---- periodic -----------------------------------------------------------------------------
    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now - self.last_tick < TICK_S:
            return
        self.last_tick = now
        self.inputs.keep_only(self.sched.state.workers)
        if self.pool is not None:
            for index, pid, rc in self.pool.poll():
                self.handle(ev.LocalWorkerExited(now, index, pid, rc))
        self._size_pool(now)
        self.handle(ev.Tick(now, reader_busy=self.reader.describe_busy(now)))
        self.monitor.tick(now, self.status)

    def _size_pool(self, now: float) -> None:
        """A failure of the pool's sizing is logged (at most once a minute); the epochs go on."""
        try:
            self.sizer.tick(now)
        except Exception:
            if now - self.sizing_failed_at >= 60.0:
                self.sizing_failed_at = now
                log.exception("sizing the worker pool failed")


def _describe(dataset: Any) -> Tuple[Dict[str, Any], Optional[int]]:
    """The dataset's input templates, and its seqs per epoch where that is the corpus (None where
    each epoch is a part of it, or the count is not known)."""
    try:
        templates = dataset.data_keys()
        whole = getattr(dataset, "partition_epoch", 1) == 1
        return templates, getattr(dataset, "total_num_seqs", None) if whole else None
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError("dataset", f"{type(dataset).__name__} failed to describe its data: {one_line(exc)}") from None


def _worker_bind(bind: str) -> str:
    """The worker socket beside the control socket `bind`: an ipc path beside it where that fits,
    else loopback TCP for an ipc server, else the same host's TCP, any free port."""
    if bind.startswith("ipc://"):
        path = bind[len("ipc://") :] + ".workers"
        return f"ipc://{path}" if endpoints.ipc_fits(path) else "tcp://127.0.0.1:0"
    return f"tcp://{endpoints.host_port(bind)[0]}:0"


def stop_on_signals() -> None:
    """Until the server installs its own handlers, SIGTERM and SIGINT raise Stopped: also the
    SIGTERM that the owner watch sends itself when the trainer died during the start."""

    def _stopped(signum: int, frame: Any) -> None:
        raise Stopped(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _stopped)
    signal.signal(signal.SIGINT, _stopped)


def _identity(dataset: Any) -> Any:
    """What the served fingerprint covers of the dataset's data (Dataset.identity())."""
    identity = getattr(dataset, "identity", None)
    try:
        return identity() if identity is not None else None
    except Exception as exc:
        raise ConfigError("dataset", f"{type(dataset).__name__}.identity() failed: {one_line(exc)}") from None


def _knows_durations(dataset: Any) -> bool:
    """Whether the dataset knows its seqs' seconds up front (its seq_durations() is not None)."""
    hook = getattr(dataset, "seq_durations", None)
    try:
        return hook is not None and hook() is not None
    except Exception as exc:
        raise ConfigError("dataset", f"{type(dataset).__name__}.seq_durations() failed: {one_line(exc)}") from None


def _no_durations(dataset: Any) -> str:
    """Why this server cannot cut by max_duration, in words."""
    return (
        f"['max_duration'] needs the seqs' durations: {type(dataset).__name__} gives none (its seq_durations() "
        "is None) and the config has no batch_duration(seq)"
    )


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
    watch: Optional[OwnerWatch] = None,
    elastic: Optional[Limits] = None,
    local_max: int = 0,
) -> int:
    """Serve until SIGTERM or SIGINT; `ready` (default: stdout) gets the one line `ready ADDRESS`.
    `watch`: the owners of a local server (see owners.py), told once it serves; its caller started
    it, and closes it after this returns."""
    memory.keep_freed_memory()
    server = Server(
        cfg,
        bind=bind,
        worker_bind=worker_bind,
        keys=keys,
        insecure=insecure,
        metrics=metrics,
        elastic=elastic,
        local_max=local_max,
    )

    def _stop(signum: int, frame: Any) -> None:
        server.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        server.monitor.start()
        server.start_local_workers(workers)
        log.info(
            "serving %s on %s (workers connect to %s); %d local workers%s",
            cfg.path if cfg.returnn_dataset is None else f"{cfg.returnn_dataset!r} of {cfg.path}",
            server.address,
            server.worker_address,
            workers,
            "" if elastic is None else f" to start with (auto: {elastic.min_workers} to {local_max} here)",
        )
        print(f"ready {server.address}", file=ready or sys.stdout, flush=True)
        if watch is not None:
            watch.ready(server.address)
        server.serve_forever()
    finally:
        server.shutdown()
    return 0
