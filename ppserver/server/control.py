"""Requests on the control socket: info, status, epoch, worker discovery and self-sizing hosts;
client credit.

Every message is checked by the protocol module before it gets here; this module checks
what only the server knows (the config's mode and fingerprint) and hands epoch requests to
the scheduler, which decides who gets what and answers. The reader then checks a new run's
request against the dataset and sets the epoch up; the client learns the outcome on its
data socket (Started or RunFailed). So no request ever waits for the dataset, and a request
the dataset refuses leaves the running epoch alone.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ppclient import protocol
from ppclient.batching import Batching
from ppclient.errors import UsageError
from ppclient.shards import CONTIGUOUS, SHARDINGS
from ppserver.config.fingerprint import SERVED_COVERS
from ppserver.config.settings import Config
from ppserver.config.table import STREAM_DURATIONS
from ppserver.errors import ConfigError
from ppserver.observe.status import ServerStatus
from ppserver.scheduler import Instruction, Scheduler
from ppserver.scheduler import events as ev
from ppserver.scheduler.story import parse_key

MAX_STORY = 2000  # moves in one story reply (each some 200 bytes of header)

# a client's message that is only news for the scheduler: (now, sender, message) -> the event
EVENTS: Dict[type, Callable[[float, bytes, Any], ev.Event]] = {
    protocol.Credit: lambda now, ident, m: ev.CreditGranted(now, ident, m.run, m.total, m.consumed),
    protocol.Missing: lambda now, ident, m: ev.MissingReported(now, ident, m.run, m.pos),
    protocol.ClientAlive: lambda now, ident, m: ev.ConsumerAlive(now, m.consumer),
    protocol.ClientClosed: lambda now, ident, m: ev.ConsumerClosed(now, m.consumer),
}


class Control:
    def __init__(
        self,
        cfg: Config,
        sched: Scheduler,
        *,
        stimuli: ev.Stimuli,
        info: Dict[str, Any],
        status: Callable[[], ServerStatus],
        worker_address: Callable[[], str],
        observe: Callable[[ev.Event], None] = lambda event: None,
        length_keys: Tuple[str, ...] = (),
        outputs: Optional[Dict[str, Any]] = None,
        no_durations: Optional[str] = None,
        hosts: Optional[Callable[[protocol.HostRequest], protocol.Message]] = None,
    ):
        self.cfg = cfg
        self.length_keys = length_keys  # keys a batching's length_key may name
        self.outputs = outputs or {}  # the outputs' templates: the keys a batching's pad may name
        self.no_durations = no_durations  # why a batching may not ask for max_duration (None: it may)
        self.sched = sched
        self.stimuli = stimuli  # the server's: names the events made here
        self.info = info
        self.status = status
        self.worker_address = worker_address
        self.observe = observe  # sees each event before the scheduler does (stage timings)
        self.hosts = hosts  # answers self-sizing worker hosts (server/pool_size.py)
        self.replies: Dict[type, Callable[[], protocol.Message]] = {
            protocol.InfoRequest: lambda: protocol.InfoReply(**self.info),
            protocol.StatusRequest: lambda: protocol.StatusReply(status=self.status().to_wire()),
            protocol.DiscoverRequest: lambda: protocol.DiscoverReply(worker_endpoint=self.worker_address()),
        }

    def handle(self, ident: bytes, msg: protocol.Message) -> Tuple[Optional[protocol.Message], List[Instruction]]:
        """The reply (None: none, or the scheduler's Reply instruction) and the scheduler's instructions."""
        now = time.monotonic()
        event = EVENTS.get(type(msg))
        if event is not None:
            e = self.stimuli.name(event(now, ident, msg), msg.kind)
            self.observe(e)
            return None, self.sched.handle(e)
        reply = self.replies.get(type(msg))
        if reply is not None:
            return reply(), []
        if isinstance(msg, protocol.EpochRequest):
            return self._epoch(now, ident, msg)
        if isinstance(msg, protocol.HostRequest) and self.hosts is not None:
            return self.hosts(msg), []
        if isinstance(msg, protocol.StoryRequest):
            return self._story(now, msg), []
        return protocol.ErrorReply(error=f"{msg.kind!r} is not a request"), []

    def _epoch(
        self, now: float, ident: bytes, msg: protocol.EpochRequest
    ) -> Tuple[Optional[protocol.Message], List[Instruction]]:
        refusal = self._check(msg)
        batching: Optional[Batching] = None
        if refusal is None:
            try:
                batching = self._batching(msg.batching)
            except UsageError as exc:
                refusal = str(exc)
        if refusal is None and msg.sharding == CONTIGUOUS and batching is not None:
            refusal = (
                "sharding 'contiguous' is for seqs, not batches (a job's batches go to lane j % lanes): "
                "ask for batching=False, or for sharding 'strided'"
            )
        if refusal is not None:
            return protocol.ErrorReply(error=refusal), []
        return None, self.sched.handle(
            ev.EpochRequested(
                now,
                ident,
                msg.consumer,
                msg.epoch,
                job=msg.job,
                rank=msg.rank,
                world_size=msg.world_size,
                start=msg.start,
                seq_list=msg.seq_list,
                seq_order=msg.seq_order,
                drop_last=msg.drop_last,
                timeout=msg.timeout,
                subshard=msg.subshard,
                subshards=msg.subshards,
                direct=msg.direct,
                direct_key=msg.direct_key,
                host=msg.host,
                batching=batching,
                sharding=msg.sharding,
                stimulus=self.stimuli.next(msg.kind),
            )
        )

    def _story(self, now: float, msg: protocol.StoryRequest) -> protocol.Message:
        """The last moves the scheduler kept about the keys asked for (at most MAX_STORY of them:
        the reply must fit a header). Scanning a full story takes the loop some tens of ms."""
        try:
            keys = [parse_key(k) for k in msg.keys]
        except ValueError as exc:
            return protocol.ErrorReply(error=f"story: {exc}")
        entries, total = self.sched.state.story_log.select(keys, last=min(msg.limit, MAX_STORY))
        return protocol.StoryReply(entries=[e.to_dict() for e in entries], total=total, now=now)

    def _batching(self, asked: Optional[Dict[str, Any]]) -> Optional[Batching]:
        """The cut a request gets: the config's default (None asked), none ({}), or the one asked
        for; its length_key must be a key the cut can measure (an input's with map_seq, an
        output's with map_seq_stream), its pad keys output keys (Batching.check_keys), and its
        max_duration needs the seqs' durations (map_seq only: a dataset's seq_durations() or the
        config's batch_duration)."""
        if asked is None:
            return self.cfg.batching
        if not asked:
            return None
        batching = Batching.from_dict(asked)
        check_keys(self.cfg, batching, self.length_keys, self.outputs)
        if batching.max_duration is not None:
            if self.cfg.is_stream:
                raise UsageError(f"batching{STREAM_DURATIONS}")
            if self.no_durations is not None:
                raise UsageError(f"batching{self.no_durations}")
        return batching

    def _check(self, msg: protocol.EpochRequest) -> Optional[str]:
        if not 0 < len(msg.consumer) <= 255:
            return "consumer must be 1 to 255 bytes"
        if self.cfg.is_stream and (msg.seq_list is not None or msg.seq_order is not None):
            return "map_seq_stream is set: seq_list and seq_order are not supported"
        if msg.seq_list is not None and msg.seq_order is not None:
            return "give at most one of seq_list and seq_order"
        if msg.sharding not in SHARDINGS:
            return f"sharding must be one of {', '.join(map(repr, SHARDINGS))}, got {msg.sharding[:64]!r}"
        if msg.sharding == CONTIGUOUS and CONTIGUOUS not in self.info["shardings"]:
            return (
                "sharding 'contiguous' is not served here: it needs map_seq and a dataset that reads any "
                "position and knows its count up front; use sharding 'strided'"
            )
        if msg.fingerprint == "":
            return "the resume state has no config fingerprint (EpochIterator.state_dict() always gives one)"
        served = self.sched.state.settings.fingerprint
        if msg.fingerprint is not None and msg.fingerprint != served:
            return (
                f"the resume state was made with config fingerprint {msg.fingerprint!r}; this server runs "
                f"{served!r} ({SERVED_COVERS} differ)"
            )
        if not msg.timeout > 0:
            return "timeout must be > 0"
        if msg.direct and not (msg.direct.startswith(("tcp://", "ipc://")) and len(msg.direct) < 1024):
            return f"direct endpoint {msg.direct[:64]!r} is not tcp://HOST:PORT or ipc://PATH"
        return None


def check_keys(cfg: Config, batching: Batching, length_keys: Tuple[str, ...], outputs: Dict[str, Any]) -> None:
    """The keys a batching names must be keys of this server's data (Batching.check_keys)."""
    batching.check_keys(length_keys, "output" if cfg.is_stream else "input", outputs)


def check_default(cfg: Config, length_keys: Tuple[str, ...], outputs: Dict[str, Any]) -> None:
    """The config's batching, checked as a request's is, once the data's keys are known (the
    dataset's, the declared map_outputs): ConfigError before the server serves."""
    if cfg.batching is None:
        return
    try:
        check_keys(cfg, cfg.batching, length_keys, outputs)
    except UsageError as exc:
        raise ConfigError("batching", str(exc).removeprefix("batching").lstrip(": ")) from None
