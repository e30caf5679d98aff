"""One worker process: applies the mappers to seqs the server sends and sends the results back.

The worker never opens the dataset. Its session (session.py) registers with the server and
keeps heartbeats going; its runners (map_seq.py, stream.py) run map_seq tasks and map_seq_stream
partitions. Losing the server drops all work and starts registration again; SIGTERM says
goodbye, so the server hands the work on at once.

Run as `python -m ppserver.worker CONFIG --connect tcp://HOST:PORT` (the server and
`ppserver worker` start it that way).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import zmq

from ppclient import UsageError, endpoints, keyfiles, protocol
from ppserver.config.mappers import Mappers, mappers_for
from ppserver.config.settings import Config, load, read_source
from ppserver.errors import ConfigError
from ppserver.logs import setup_logging
from ppserver.worker.clock import heartbeat_stats
from ppserver.worker.map_seq import MapSeqRunner
from ppserver.worker.memory import keep_freed_memory
from ppserver.worker.outputs import Means, OpenRun
from ppserver.worker.pool import EXIT_REFUSED, EXIT_RETIRED, set_process_title
from ppserver.worker.routes import Routes
from ppserver.worker.session import POLL_MS, Refused, Session, Stopped
from ppserver.worker.stream import StreamRunner
from ppserver.worker.threads import limit_threads

log = logging.getLogger("ppserver.worker")

LOOK_S = 0.001  # how often a busy worker looks for messages (cancellations, more tasks)
# messages of a run whose loss would leave work undone (a stream_close asks for none)
RETIRE_LINGER_S = 10.0  # a retired worker waits at most this long for consumers to take its results
CARRY_WORK = (protocol.Tasks, protocol.StreamOpen, protocol.StreamInputs, protocol.StreamEnd, protocol.StreamCredit)


class Worker:
    def __init__(
        self,
        cfg: Config,
        connect: str,
        *,
        keys: Optional[keyfiles.ClientKeys] = None,
        worker_endpoint: Optional[str] = None,
        local_index: Optional[int] = None,
    ):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.session = Session(
            self.ctx,
            connect=connect,
            fingerprint=cfg.worker_fingerprint,
            heartbeat_interval=cfg.heartbeat_interval,
            heartbeat_timeout=cfg.heartbeat_timeout,
            keys=keys,
            worker_endpoint=worker_endpoint,
            local_index=local_index,
            shm_mb=cfg.shm_mb,
            stats=lambda: {**heartbeat_stats(self.seqs.clock, self.streams.clock), **self.routes.stats()},
            mapping=lambda: self.seqs.under_way,
        )
        self.runs: Dict[int, OpenRun] = {}
        self.retired = False  # the server retired it: it exits with EXIT_RETIRED, not to be started again
        self.retire_by = 0.0
        templates = lambda: self.session.templates
        self._mappers: Optional[Tuple[Dict[str, Any], Mappers]] = None
        self.routes = Routes(self.ctx, keys)
        self.routes.host, self.routes.shm_mb = self.session.host_id, cfg.shm_mb  # results to consumers on this host
        means = Means(cfg, self.session.send, templates, self.mappers)
        self.seqs = MapSeqRunner(means, self.routes)
        self.streams = StreamRunner(means, self._wait_for_input)

    def mappers(self) -> Mappers:
        """The config's mappers for the input templates the server sent (rebuilt if they change)."""
        inputs = self.session.inputs
        if self._mappers is None or self._mappers[0] is not inputs:
            self._mappers = (inputs, mappers_for(self.cfg, inputs))
        return self._mappers[1]

    @property
    def stopping(self) -> bool:
        return self.session.stopping

    def stop(self) -> None:
        self.session.stopping = True

    def serve(self) -> int:
        s = self.session
        try:
            while not s.stopping:
                endpoint = s.discover()
                if not s.register(endpoint):
                    log.warning("no answer to registration at %s; retrying", endpoint)
                    continue
                try:
                    self._work()
                except Stopped:
                    pass
                lost = not s.stopping
                self._drop_all()
                s.unregister(say_bye=s.stopping)
                if lost:
                    log.warning("lost the server; registering again")
        except Refused as exc:
            log.error("refused by the server: %s", exc)
            return EXIT_REFUSED
        except Stopped:
            pass
        finally:
            s.unregister(say_bye=s.stopping)
            self.ctx.term()
        log.info(
            "worker stopped after %d seqs (%d task and %d result messages; direct results over the socket with "
            "the shared memory full: %d, through the server when their client could not take them: %d)",
            self.seqs.done + self.streams.done,
            self.seqs.messages_in,
            self.seqs.messages_out,
            self.routes.over_socket.count,
            self.routes.via_server.count,
        )
        return EXIT_RETIRED if self.retired else 0

    def _drop_all(self) -> None:
        self.routes.clear()
        self.runs.clear()
        self.seqs.clear()
        self.streams.clear()

    def _work(self) -> None:
        s = self.session
        look_at = 0.0
        while not s.stopping:
            if self.retired and (self.routes.untaken() == 0 or time.monotonic() > self.retire_by):
                self.stop()
                return
            busy = bool(self.seqs.tasks) or self.streams.runnable() is not None
            # While tasks wait, messages are looked at every LOOK_S, not between every two seqs
            # (each look costs system calls; a closed run's tasks are dropped at the next look).
            now = time.monotonic()
            if not busy or now >= look_at:
                if s.lost():
                    return
                self._receive(0 if busy else POLL_MS)
                look_at = now + LOOK_S
            if self.seqs.tasks:
                self.seqs.step(self.runs)
            else:
                part = self.streams.runnable()
                if part is not None:
                    self.streams.step(part)

    def _wait_for_input(self) -> None:
        """A stream waits for its next input: take messages meanwhile, stop if the session ends."""
        if self.stopping or self.session.lost():
            raise Stopped()
        since = time.perf_counter()
        self._receive(POLL_MS)
        self.streams.clock.paused += time.perf_counter() - since

    def _receive(self, timeout_ms: int) -> None:
        if self.routes.routes or self.routes.departed or self.routes.holders:
            self.routes.poll()
        for decoded in self.session.receive(timeout_ms):
            self._handle(decoded)

    def _handle(self, decoded: protocol.Decoded) -> None:
        msg, items = decoded.msg, decoded.items
        if decoded.bad:
            reason = f"{len(decoded.bad)} malformed items (first: {decoded.bad[0].reason})"
            self.session.report(protocol.dropped_items(msg, decoded.bad, reason))
        if decoded.unreadable:
            self._unreadable(msg, decoded.unreadable)
        if isinstance(msg, protocol.RunOpen):
            self.runs[msg.run] = OpenRun(msg.epoch, msg.check_tags, msg.pad)
        elif isinstance(msg, protocol.Retire):
            # It holds no task; its last direct results may still wait in their consumers'
            # sockets, in its shared memory: it exits once they took them (or after a while).
            log.info("retired by the server (the pool shrinks); exiting")
            self.retired = True
            self.retire_by = time.monotonic() + RETIRE_LINGER_S
        elif isinstance(msg, protocol.ConsumerRoute):
            self.routes.identity = self.session.identity or b""
            self.routes.set(msg)
        elif isinstance(msg, protocol.ConsumerGone):
            self.routes.drop(msg.consumer, gone=True, closed=msg.closed)
        elif isinstance(msg, protocol.RunClose):
            self.runs.pop(msg.run, None)
            self.seqs.drop_run(msg.run)
            self.streams.close(msg.run)
            self.session.send(protocol.RunDropped(run=msg.run))  # every input of the run is read by now
        elif getattr(msg, "run", None) not in self.runs:
            self._not_open(msg, items)
        elif isinstance(msg, protocol.Tasks):
            self.seqs.add(msg.run, items, msg.to, probe=msg.probe, lost=decoded.bad + decoded.unreadable)
        elif isinstance(msg, protocol.StreamOpen):
            self.streams.open(msg, self.runs)
        elif isinstance(msg, protocol.StreamClose):
            self.streams.close(msg.run, msg.partition)
        else:
            self.streams.on_message(msg, items)

    def _not_open(self, msg: protocol.Message, items: List[protocol.Item]) -> None:
        """A message of a run not open here is dropped. One that carries work is reported: the server
        sends none after it closes a run, so its run_open was lost (and the work would be)."""
        if not isinstance(msg, CARRY_WORK) or (isinstance(msg, protocol.Tasks) and not items):
            return  # nothing to redo (a task message whose items were all bad is reported already)
        reason = f"run {msg.run} is not open here"
        self.session.report(protocol.dropped_items(msg, [protocol.BadItem(it.task, reason) for it in items], reason))

    def _unreadable(self, msg: protocol.Message, lost: List[protocol.BadItem]) -> None:
        """Inputs whose arrays could not be read (a block or the server's memory gone): a task goes
        back to the server to be redone; a stream's input cannot be, so this worker registers
        again and the server restarts its partitions elsewhere."""
        reason = lost[0].reason[:500]
        log.warning("could not read %d inputs from the server (first: %s)", len(lost), reason)
        if isinstance(msg, protocol.Tasks):
            positions = [b.pos for b in lost if b.pos is not None]
            if positions:
                self.session.send(protocol.InputsLost(run=msg.run, pos=positions, reason=reason))
        elif getattr(msg, "run", None) in self.runs:
            self.session.forgotten = True
            raise Stopped()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ppserver.worker", description="one ppserver worker process")
    parser.add_argument("config")
    parser.add_argument("--connect", required=True)
    parser.add_argument("--keys", default=None)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--local", action="store_true", help="a local worker of the server (reported by --index)")
    parser.add_argument("--worker-endpoint", default=None, help="skip discovery: the server's worker socket")
    parser.add_argument("--returnn-dataset", default=None, help="CONFIG is a RETURNN config: serve this dataset of it")
    parser.add_argument("--config-source", default=None, help="run this file as CONFIG: a snapshot")
    args = parser.parse_args(argv)
    setup_logging("ppworker")
    set_process_title(f"ppworker {args.index}")
    try:
        endpoints.check(args.connect, "--connect")
        if args.worker_endpoint:
            endpoints.check(args.worker_endpoint, "--worker-endpoint")
        keys = keyfiles.client_keys(args.keys) if args.keys else None
        source = read_source(args.config_source, "--config-source") if args.config_source else None
        cfg: Config = load(args.config, args.returnn_dataset, source)
    except (ConfigError, UsageError) as exc:
        print(f"ppserver worker: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    limit_threads(cfg.worker_threads)
    keep_freed_memory()
    worker = Worker(
        cfg,
        args.connect,
        keys=keys,
        worker_endpoint=args.worker_endpoint,
        local_index=args.index if args.local else None,
    )

    def _stop(signum: int, frame: Any) -> None:
        worker.stop()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    return worker.serve()


if __name__ == "__main__":
    sys.exit(main())
