"""Messages from workers, as scheduler events.

Most messages map one to one onto an event (EVENTS); registration (hello: protocol and config
must match the server's), what a worker says of its shared memory, and inputs it could not
read also change how its inputs travel (transport/inputs.py). A message that does not decode
may have held results: a registered worker's seqs and stream partitions are charged with it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

from ppclient import protocol
from ppclient.protocol import Channel, Decoded, Peer
from ppclient.throttle import Throttled
from ppserver.config.fingerprint import WORKER_COVERS
from ppserver.scheduler import Scheduler
from ppserver.scheduler import events as ev
from ppserver.transport.inputs import WorkerInputs

log = logging.getLogger("ppserver.server")

# (now, worker id, message, the decoded message) -> the event
Builder = Callable[[float, bytes, Any, Decoded], Optional[ev.Event]]
MAX_REASON = 500  # characters of a worker's reason that are kept

# The work each message the server sends a worker carries (any other: none).
CARRIES: Dict[str, ev.Carried] = {
    protocol.Tasks.kind: ev.Carried.TASKS,
    **{
        m.kind: ev.Carried.STREAM
        for m in (
            protocol.StreamOpen,
            protocol.StreamInputs,
            protocol.StreamEnd,
            protocol.StreamClose,
            protocol.StreamCredit,
        )
    },
}


def carried(what: Optional[str]) -> ev.Carried:
    """What a message of kind `what` a worker dropped carried (None: unreadable, so not known)."""
    return ev.Carried.UNKNOWN if what is None else CARRIES.get(what, ev.Carried.NOTHING)


EVENTS: Dict[type, Builder] = {
    protocol.Results: lambda now, wid, m, d: ev.ResultsReceived(now, wid, m.run, d.items, d.bad),
    protocol.Completed: lambda now, wid, m, d: ev.CompletedReceived(
        now, wid, m.run, m.pos, m.nbytes, m.skipped, m.skipped_tags
    ),
    protocol.RunDropped: lambda now, wid, m, d: ev.RunDropped(now, wid, m.run),
    protocol.Dropped: lambda now, wid, m, d: _dropped(now, wid, m),
    protocol.StreamOutputs: lambda now, wid, m, d: ev.StreamOutputsReceived(
        now, wid, m.run, m.partition, m.incarnation, d.items, d.bad
    ),
    protocol.StreamAck: lambda now, wid, m, d: ev.StreamAcked(now, wid, m.run, m.partition, m.incarnation, m.n),
    protocol.TaskFailed: lambda now, wid, m, d: ev.TaskFailed(
        now, wid, m.run, m.pos, m.seq_tag, m.message, m.traceback
    ),
    protocol.Mapping: lambda now, wid, m, d: ev.MappingReported(now, wid, m.run, m.pos, m.seq_tag),
    protocol.StreamDone: lambda now, wid, m, d: ev.StreamFinished(now, wid, m.run, m.partition, m.incarnation),
    protocol.StreamFailed: lambda now, wid, m, d: ev.StreamFailed(
        now, wid, m.run, m.partition, m.incarnation, m.seq_tag, m.message, m.traceback
    ),
    protocol.Bye: lambda now, wid, m, d: ev.WorkerLeft(now, wid),
    protocol.Heartbeat: lambda now, wid, m, d: ev.HeartbeatReceived(now, wid, _mapping(m)),
}


def _dropped(now: float, wid: bytes, m: protocol.Dropped) -> ev.MessageDropped:
    """A worker's report of a message it dropped; a kind it could not read ("" on the wire) is None."""
    what = m.what or None
    return ev.MessageDropped(now, wid, what, carried(what), m.run, m.partition, m.pos, m.reason[:MAX_REASON])


def _mapping(beat: protocol.Heartbeat) -> Optional[Tuple[int, int, int]]:
    """A heartbeat's (run, pos, seqs mapped), if it carries a well-formed one."""
    m = beat.mapping
    return (m[0], m[1], m[2]) if m is not None and len(m) == 3 and min(m) >= 0 else None


class FromWorkers:
    """Turns the worker socket's messages into events (`handle` takes them) and answers
    registrations (`send` sends frames on the worker socket)."""

    def __init__(
        self,
        *,
        fingerprint: str,
        templates: Dict[str, Any],
        input_templates: Dict[str, Any],
        sched: Scheduler,
        stimuli: ev.Stimuli,
        inputs: WorkerInputs,
        handle: Callable[[ev.Event], None],
        send: Callable[[List[Any]], bool],
        heartbeat: Callable[[bytes, Optional[Dict[str, Any]]], None],
        malformed: Throttled,
    ):
        self.fingerprint = fingerprint
        self.templates = templates  # of the outputs
        self.input_templates = input_templates
        self.sched = sched
        self.stimuli = stimuli  # the server's: names the events made here
        self.inputs = inputs
        self.handle = handle
        self.send = send
        self.heartbeat = heartbeat  # a heartbeat's mapper counters (stage timings)
        self.malformed = malformed
        self.events: Dict[type, Builder] = {
            **EVENTS,
            protocol.Hello: self._admit,
            protocol.ShmMapped: lambda now, wid, m, d: ev.InputsShared(now, wid, self.inputs.mapped(wid, m)),
            protocol.InputsLost: self._inputs_lost,
        }

    def on_frames(self, frames: List[Any], now: float) -> None:
        ident = frames[0].bytes
        if ident.endswith(protocol.HEARTBEAT_SUFFIX):  # the worker's heartbeat socket
            msg = protocol.decode(frames[1:], Peer.SERVER, (Channel.WORKER,)).msg
            if isinstance(msg, protocol.Heartbeat):
                wid = ident[: -len(protocol.HEARTBEAT_SUFFIX)]
                self.heartbeat(wid, msg.stats)
                self.handle(ev.HeartbeatReceived(now, wid, _mapping(msg), stimulus=self.stimuli.next(msg.kind)))
            return
        try:
            decoded = protocol.decode(frames[1:], Peer.SERVER, (Channel.WORKER,))
        except protocol.VersionMismatch as exc:
            if exc.msg_kind == protocol.Hello.kind:
                reason = protocol.mismatch_text(exc.theirs, "the worker")
                log.error("refused a worker: %s", reason)
                self.send([ident, *protocol.encode(protocol.Refuse(reason=reason))])
                return
            self._undecodable(now, ident, exc)
            return
        except protocol.ProtocolError as exc:
            self._undecodable(now, ident, exc)
            return
        # the channel admits nothing else from a worker: anything unlisted counts as a sign of life
        build = self.events.get(type(decoded.msg), EVENTS[protocol.Heartbeat])
        event = build(now, ident, decoded.msg, decoded)
        if event is not None:
            self.handle(self.stimuli.name(event, decoded.msg.kind))

    def _undecodable(self, now: float, wid: bytes, exc: protocol.ProtocolError) -> None:
        self.malformed.hit(f"from worker {wid.decode(errors='replace')[:64]}: {exc}")
        if wid in self.sched.state.workers:
            self.handle(ev.WorkerMessageMalformed(now, wid, str(exc)))

    def _admit(self, now: float, wid: bytes, hello: protocol.Hello, decoded: Decoded) -> Optional[ev.Event]:
        """Protocol and config must match the server's; then the worker is welcomed and joins."""
        if hello.fingerprint != self.fingerprint:
            reason = (
                f"config fingerprint mismatch: worker has {hello.fingerprint[:32]!r}, server has "
                f"{self.fingerprint!r} ({WORKER_COVERS} differ)"
            )
            log.error("refused worker %s pid %s: %s", hello.host[:255], hello.pid, reason)
            self.send([wid, *protocol.encode(protocol.Refuse(reason=reason))])
            return None
        shm_offer, cma_offer = self.inputs.offer(wid, hello.host_id)
        welcome = protocol.Welcome(templates=self.templates, inputs=self.input_templates, shm=shm_offer, cma=cma_offer)
        self.send([wid, *protocol.encode(welcome)])
        return ev.WorkerJoined(now, wid, hello.host[:255], hello.pid, hello.local_index, hello.replaces)

    def _inputs_lost(self, now: float, wid: bytes, msg: protocol.InputsLost, decoded: Decoded) -> ev.Event:
        if wid in self.sched.state.workers and self.inputs.fall_back(wid):
            self.handle(ev.InputsShared(now, wid, self.inputs.path(wid)))
        return ev.InputsLost(now, wid, msg.run, msg.pos, msg.reason[:MAX_REASON])
