"""Every message of the ppserver protocol, defined once: its fields with their types, who sends
it, who receives it and on which channel.

Three kinds of peers talk: clients (a REQ socket for requests, a DEALER for an epoch's data),
the server (a control ROUTER and a worker ROUTER) and workers (a DEALER for tasks and results,
a second DEALER for heartbeats). `docs/protocol.md` describes the conversations. Bump PROTOCOL
whenever a message, a field or a rule changes in a way an older peer would misread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Type

from .. import wire
from ..errors import Error

PROTOCOL = 11


KIND = "t"  # the discriminator: every header has it, naming the message class


PROTO_FIELD = "proto"  # requests, replies and worker registration carry the protocol version


HEARTBEAT_SUFFIX = b"|hb"  # a worker's heartbeat socket has its task socket's identity plus this


DELIMITER = b""  # client sockets put an empty frame before the header (REQ's envelope)


META_KEYS = wire.META_KEYS  # meta entries travel in the item header, never as frames


class ProtocolError(Error):
    """A message that is not one of this protocol's, or whose fields do not check."""


class Peer(enum.Enum):
    CLIENT = "client"
    SERVER = "server"
    WORKER = "worker"


class Channel(enum.Enum):
    """The socket pair a message travels on; a message on another one is refused."""

    CONTROL = "control"  # a REQ (client, or a worker host discovering) -> the control ROUTER, and the reply
    DATA = "data"  # a client's DEALER <-> the control ROUTER: one epoch's credit and seqs
    WORKER = "worker"  # a worker's DEALERs (tasks, heartbeats) <-> the worker ROUTER
    DIRECT = "direct"  # a worker's DEALER -> a client's direct ROUTER: results that bypass the server


def _nonneg(default: int = 0) -> Any:
    return field(default=default, metadata={"min": 0})


def _positive(default: int = 1) -> Any:
    return field(default=default, metadata={"min": 1})


@dataclass(frozen=True)
class Message:
    """Base of every message. Subclasses set `kind`, `sender`, `receiver`."""

    kind: ClassVar[str]
    channel: ClassVar[Channel]
    sender: ClassVar[Tuple[Peer, ...]]
    receiver: ClassVar[Tuple[Peer, ...]]
    batch: ClassVar[bool] = False  # carries items (seqs) with one frame per array
    per_item: ClassVar[Tuple[str, ...]] = ()  # list fields with one entry per item (split with the items)
    versioned: ClassVar[bool] = False  # carries PROTO_FIELD


# ---- client requests and the server's replies (client REQ <-> control ROUTER) -------------
@dataclass(frozen=True)
class InfoRequest(Message):
    kind = "info"
    channel = Channel.CONTROL
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    versioned = True


@dataclass(frozen=True)
class StatusRequest(Message):
    kind = "status"
    channel = Channel.CONTROL
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    versioned = True


@dataclass(frozen=True)
class StoryRequest(Message):
    """The moves the server's scheduler kept about `keys` (positions, "batch:K", "partition:P",
    "run:R", "lane:R/I", "worker:NAME"), the last `limit` of them (`ppserver status --story`). A kind of its
    own, so older peers of this protocol are unaffected; an older server answers that it does not
    know it (ErrorReply)."""

    kind = "story"
    channel = Channel.CONTROL
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    versioned = True
    keys: List[str] = field(default_factory=list)
    limit: int = _positive(1000)


@dataclass(frozen=True)
class EpochRequest(Message):
    """Start rank `rank`'s shard of an epoch of job `job` for the data socket `consumer`.

    The shard holds the positions i with i % world_size == rank; `start` is the index in the
    shard of the first seq wanted (a resume); `drop_last` gives every rank the same count.
    A rank may split its shard among `subshards` readers (a DataLoader's workers): reader
    `subshard` takes every subshards-th seq of it, from its subshard-th on; `start` then counts
    in that part.
    `timeout`: the client's, after which the server may count it gone if it stops sending
    keepalives. `fingerprint`: the config fingerprint of the state this request resumes (None: it
    resumes no state; an explicit `start` needs none).
    `direct`: the endpoint of the client's direct ROUTER, where workers may send its results
    ("" : everything through the server); `direct_key`: its CURVE public key (with keys);
    `host`: the client's shared-memory host id ("" : none).
    `batching`: how the job's epochs are cut into batches (ppclient.batching's dict; None: as the
    server's config says; {}: one seq at a time). With batches, positions, `start` and counts
    count batches: batch j of the epoch goes to lane j % (world_size * subshards).
    `sharding`: "strided" (the lanes above) or "contiguous": the reader takes lane
    rank * subshards + subshard and gets RETURNN's shard of that index, a contiguous chunk of the
    epoch's order (seq by seq, map_seq, a dataset that reads any position; InfoReply.shardings
    says); drop_last then gives every reader num_seqs // (world_size * subshards) if world_size > 1.
    """

    kind = "epoch"
    channel = Channel.CONTROL
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    versioned = True
    epoch: int = _nonneg()
    consumer: bytes = b""
    seq_list: Optional[List[str]] = None
    seq_order: Optional[List[int]] = None
    job: str = "default"
    rank: int = _nonneg()
    world_size: int = _positive()
    start: int = _nonneg()
    drop_last: bool = True
    timeout: float = 30.0
    fingerprint: Optional[str] = None
    subshard: int = _nonneg()
    subshards: int = _positive()
    direct: str = ""
    direct_key: bytes = b""
    host: str = ""
    batching: Optional[Dict[str, Any]] = None
    sharding: str = "strided"


@dataclass(frozen=True)
class DiscoverRequest(Message):
    """A worker host asks the control address where the worker socket is."""

    kind = "discover"
    channel = Channel.CONTROL
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    versioned = True


@dataclass(frozen=True)
class HostRequest(Message):
    """A worker host that sizes itself (`ppserver worker --procs auto`) asks how many worker
    processes the server wants of it, about once a second: `supervisor` names the host's
    supervisor (one per `ppserver worker`), `pids` its live worker processes, `max_procs`
    how many it can run."""

    kind = "host"
    channel = Channel.CONTROL
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    versioned = True
    supervisor: str = ""
    host: str = ""
    pids: List[int] = field(default_factory=list)
    max_procs: int = _positive()


@dataclass(frozen=True)
class HostReply(Message):
    """How many worker processes the host should run (it starts the missing ones; the server
    retires the ones too many itself, with `retire`)."""

    kind = "host_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    versioned = True
    procs: int = _nonneg()


@dataclass(frozen=True)
class InfoReply(Message):
    kind = "info_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    versioned = True
    data_keys: Dict[str, Any] = field(default_factory=dict)
    input_keys: Dict[str, Any] = field(default_factory=dict)
    num_seqs: Optional[int] = None
    mode: str = "map_seq"
    stream_partitions: Optional[int] = None
    buf_size: int = 1
    version: str = ""
    fingerprint: str = ""  # the served one: resume states are checked against it
    config_fingerprint: str = ""  # the config's alone, as whoever holds the config computes it
    instance: str = ""
    batching: Optional[Dict[str, Any]] = None  # the config's default batching (None: one seq at a time)
    shardings: List[str] = field(default_factory=lambda: ["strided"])  # what EpochRequest.sharding may be


@dataclass(frozen=True)
class StatusReply(Message):
    kind = "status_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    versioned = True
    status: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StoryReply(Message):
    """`entries`: the moves, oldest first, each {subject, key, run, from, to, worker, stimulus,
    time, note}; `total`: how many matched (more than sent when over the limit); `now`: the
    server's clock, which `time` counts on."""

    kind = "story_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    versioned = True
    entries: List[Dict[str, Any]] = field(default_factory=list)
    total: int = _nonneg()
    now: float = 0.0


@dataclass(frozen=True)
class EpochAccepted(Message):
    """The request checks; the epoch's `Started` (or its error) follows on the data socket.
    `instance`: the server process's own id (a client that stops hearing from it asks `info` whose
    instance answers, to tell a restarted server from a slow one); `fingerprint`: the config's."""

    kind = "epoch_accepted"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    versioned = True
    run: int = _nonneg()
    instance: str = ""
    fingerprint: str = ""


@dataclass(frozen=True)
class DiscoverReply(Message):
    kind = "discover_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    versioned = True
    worker_endpoint: str = ""


class RefusalReason(str, enum.Enum):
    """Why a request was refused: an ErrorReply's `reason` (its value on the wire)."""

    PROTOCOL = "protocol"  # another protocol version (or fingerprint)
    JOB = "job"  # another job, or this one with other settings, while its clients live (may pass soon)
    EPOCH = "epoch"  # an epoch the job's ranks do not read together
    REQUEST = "request"  # a request that can never be served (malformed, say)


@dataclass(frozen=True)
class ErrorReply(Message):
    """A refused request; `reason` says why: a RefusalReason's value ("protocol", "job", "epoch" or
    "request")."""

    kind = "error_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT, Peer.WORKER)
    versioned = True
    error: str = ""
    reason: str = RefusalReason.REQUEST.value


# ---- an epoch's data (client DEALER <-> control ROUTER) --------------------------------------
@dataclass(frozen=True)
class Credit(Message):
    """The client has granted `total` seqs of this run so far and taken `consumed` of them
    (both cumulative, so a lost message heals)."""

    kind = "credit"
    channel = Channel.DATA
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    total: int = _nonneg()
    consumed: int = _nonneg()


@dataclass(frozen=True)
class Missing(Message):
    """The client has waited long for the seq at `pos` (its next): if it was sent directly and
    lost on the way, the server has it made again and sends it itself."""

    kind = "missing"
    channel = Channel.DATA
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    pos: int = _nonneg()


@dataclass(frozen=True)
class Started(Message):
    """The epoch is set up; `num_seqs`: seqs (batches, when the job batches) this shard delivers
    from its start (None when not known in advance); `fingerprint`: the config's, for resume
    states; `batching`: the job's batching settings (None: one seq at a time)."""

    kind = "started"
    channel = Channel.DATA
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    run: int = _nonneg()
    num_seqs: Optional[int] = None
    fingerprint: str = ""
    batching: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class Seqs(Message):
    """Delivered seqs or batches; an item's `i` is its position in the epoch (rank, rank +
    world_size, ...). A padded batch is one item; the seqs of a batch the server cut but did not
    pad (map_seq_stream) are items that name it (`g`), its client pads them."""

    kind = "seqs"
    channel = Channel.DATA
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    batch = True
    run: int = _nonneg()


@dataclass(frozen=True)
class Keepalive(Message):
    """Sent every heartbeat interval while a run is live, so the client tells slow from dead."""

    kind = "keepalive"
    channel = Channel.DATA
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    run: int = _nonneg()
    interval: float = 1.0
    workers: int = _nonneg()
    waiting_for: str = ""  # what holds the epoch back, in words
    # what the client waits for is other readers of the job whose clients live (room in their
    # windows for the seqs before its own): not a failure, it keeps waiting
    waits_on_readers: bool = False
    # seqs of the run's batches under way that workers have mapped so far, as their heartbeats
    # say: it grows while a slow batch is mapped, which is progress though no batch came yet
    mapped: int = _nonneg()


@dataclass(frozen=True)
class End(Message):
    kind = "end"
    channel = Channel.DATA
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    run: int = _nonneg()
    count: int = _nonneg()


class FailureKind(str, enum.Enum):
    MAPPER = "mapper"  # a mapper raised, its output failed validation, or a seq killed workers
    DATASET = "dataset"  # the dataset raised
    REQUEST = "request"  # the request was refused once the dataset checked it (e.g. an unknown tag)
    SERVER = "server"  # an internal error of the server


@dataclass(frozen=True)
class RunFailed(Message):
    kind = "run_failed"
    channel = Channel.DATA
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    run: int = _nonneg()
    failure: str = FailureKind.SERVER.value
    message: str = ""
    seq_tag: Optional[str] = None
    traceback: str = ""


@dataclass(frozen=True)
class Superseded(Message):
    """Another request started a newer run; nothing more of this run will come."""

    kind = "superseded"
    channel = Channel.DATA
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    run: int = _nonneg()
    epoch: int = _nonneg()  # the epoch that replaced it


@dataclass(frozen=True)
class ClientAlive(Message):
    """From a client's keepalive socket every second or so: the data socket `consumer` lives."""

    kind = "client_alive"
    channel = Channel.DATA
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    consumer: bytes = b""


@dataclass(frozen=True)
class ClientClosed(Message):
    """The client closed: its shards may be taken over at once."""

    kind = "client_closed"
    channel = Channel.DATA
    sender = (Peer.CLIENT,)
    receiver = (Peer.SERVER,)
    consumer: bytes = b""


# ---- workers (worker DEALER <-> worker ROUTER) -------------------------------------------------
@dataclass(frozen=True)
class Hello(Message):
    """Registration. `replaces`: this process's previous identity, whose connection was reset."""

    kind = "hello"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    versioned = True
    fingerprint: str = ""
    host: str = ""
    pid: int = 0
    local_index: Optional[int] = None  # set by the server's own local workers
    replaces: Optional[bytes] = None
    host_id: str = ""  # shared-memory host id ("": none): a worker on the server's host gets its inputs so


@dataclass(frozen=True)
class Welcome(Message):
    kind = "welcome"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    versioned = True
    templates: Dict[str, Any] = field(default_factory=dict)  # of the outputs: what the worker checks
    inputs: Dict[str, Any] = field(default_factory=dict)  # of the inputs: what RETURNN-API mappers get
    shm: Optional[Dict[str, Any]] = None  # the segment the worker's inputs will come in (same host)
    # where a worker on the server's host may read its inputs in the server's memory: the
    # server's pid and a token (its address and bytes) to check that reading works
    cma: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class ShmMapped(Message):
    """The worker mapped the segment offered in `welcome` (`ok`), or why not; `cma`: it can read
    the server's memory (the `welcome.cma` token read back), so inputs may name addresses."""

    kind = "shm_mapped"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    ok: bool = False
    reason: str = ""
    cma: bool = False


@dataclass(frozen=True)
class Refuse(Message):
    kind = "refuse"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    versioned = True
    reason: str = ""


@dataclass(frozen=True)
class Unknown(Message):
    """The server does not know this identity (it restarted or declared the worker dead)."""

    kind = "unknown"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)


@dataclass(frozen=True)
class Heartbeat(Message):
    """On the heartbeat socket, both ways; any traffic on the task socket also counts.

    `stats`: a worker's cumulative counters since it started (`map_s`: seconds inside the
    mappers, `mapped`: seqs they returned), so the server can tell mapping from transfer time.
    `mapping`: `[run, pos, seqs mapped]` of the batch the worker maps now (None: none), so a
    slow batch shows progress before its result comes and only a stuck mapper stalls its run."""

    kind = "hb"
    channel = Channel.WORKER
    sender = (Peer.SERVER, Peer.WORKER)
    receiver = (Peer.SERVER, Peer.WORKER)
    stats: Optional[Dict[str, Any]] = None
    mapping: Optional[List[int]] = None


@dataclass(frozen=True)
class Bye(Message):
    kind = "bye"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)


@dataclass(frozen=True)
class Retire(Message):
    """The pool shrinks by this worker. The server sends it once the worker holds no task and no
    stream partition; the worker says bye and exits (EXIT_RETIRED), and is not started again."""

    kind = "retire"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)


@dataclass(frozen=True)
class RunOpen(Message):
    """Tasks of `run` may follow; `check_tags`: outputs must keep the input's seq_tag; `pad`: the
    value each key of a batch is padded with (others: 0)."""

    kind = "run_open"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    run: int = _nonneg()
    epoch: int = _nonneg()
    check_tags: bool = False
    pad: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunClose(Message):
    """Drop everything of `run`: its queued tasks, open streams and unsent results."""

    kind = "run_close"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    run: int = _nonneg()


@dataclass(frozen=True)
class RunDropped(Message):
    """The worker's answer to `run_close`: everything of `run` is dropped, and every message of it
    sent before the close has been received (so inputs it named in the server's memory are read)."""

    kind = "run_dropped"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()


@dataclass(frozen=True)
class Tasks(Message):
    """map_seq inputs. `to[k]`: the consumer item k's result goes to directly (b"": to the server);
    empty: every result to the server. Items that name a batch (`g`) are the seqs of that batch,
    in order: the worker maps each and pads them into one result. `probe`: the batch is suspect
    (it was on a worker that died): say which seq is being mapped (`mapping`) before each."""

    kind = "tasks"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    batch = True
    per_item = ("to",)
    run: int = _nonneg()
    to: List[bytes] = field(default_factory=list)
    probe: bool = False


@dataclass(frozen=True)
class Mapping(Message):
    """The worker is about to map the seq `seq_tag` of the suspect batch at `pos`: if it dies now,
    that seq is the one charged with it."""

    kind = "mapping"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    pos: int = _nonneg()
    seq_tag: Optional[str] = None


@dataclass(frozen=True)
class Completed(Message):
    """Results sent directly to their consumers: positions and byte counts, no data. `skipped[k]`:
    the seqs of task k the mapper skipped, `skipped_tags[k]` the first few of their tags (both
    empty when no seq of the message was skipped)."""

    kind = "completed"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    pos: List[int] = field(default_factory=list)
    nbytes: List[int] = field(default_factory=list)
    skipped: List[int] = field(default_factory=list)
    skipped_tags: List[List[str]] = field(default_factory=list)


@dataclass(frozen=True)
class ConsumerRoute(Message):
    """How a worker reaches a consumer's direct ROUTER (`key`: its CURVE public key; `host`: its
    shared-memory host id)."""

    kind = "route"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    consumer: bytes = b""
    endpoint: str = ""
    key: bytes = b""
    host: str = ""


@dataclass(frozen=True)
class ConsumerGone(Message):
    """The consumer left: close the connection to it and free what it holds. `closed`: it said so
    (`client_closed`), so it takes no block any more: the blocks it has not taken are free at once."""

    kind = "consumer_gone"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    consumer: bytes = b""
    closed: bool = False


# ---- direct results (worker DEALER -> client direct ROUTER) -----------------------------------
@dataclass(frozen=True)
class DirectHello(Message):
    """A worker's first message on a direct connection. `shm`: the descriptor of its result segment
    when the consumer is on its host (None: no shared memory)."""

    kind = "direct_hello"
    channel = Channel.DIRECT
    sender = (Peer.WORKER,)
    receiver = (Peer.CLIENT,)
    versioned = True
    worker: bytes = b""
    shm: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class DirectWelcome(Message):
    """The consumer heard the worker: results may come directly now (`shm`: and through the
    segment, which the consumer mapped)."""

    kind = "direct_welcome"
    channel = Channel.DIRECT
    sender = (Peer.CLIENT,)
    receiver = (Peer.WORKER,)
    versioned = True
    shm: bool = False
    pid: int = _nonneg(0)


@dataclass(frozen=True)
class DirectSeqs(Message):
    """Results of `run` for this consumer, straight from the worker that made them."""

    kind = "direct_seqs"
    channel = Channel.DIRECT
    sender = (Peer.WORKER,)
    receiver = (Peer.CLIENT,)
    batch = True
    run: int = _nonneg()


@dataclass(frozen=True)
class Results(Message):
    kind = "results"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    batch = True
    run: int = _nonneg()


@dataclass(frozen=True)
class InputsLost(Message):
    """Inputs the worker received but could not read (their shared-memory block or the server's
    memory was gone): the server takes the tasks back and redoes those it still wants."""

    kind = "inputs_lost"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    pos: List[int] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True)
class Dropped(Message):
    """A message from the server the worker dropped: it did not decode, items of it did not check,
    or it belongs to a run not open here. What the worker could read of it: `what` (its kind, ""
    if unreadable), `run`, `partition` (of a stream message) and `pos` (the positions of the
    tasks it carried; empty: every one of the run this worker holds). The server redoes or fails
    what it carried, instead of waiting for it."""

    kind = "dropped"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    what: str = ""
    run: Optional[int] = field(default=None, metadata={"min": 0})
    partition: Optional[int] = field(default=None, metadata={"min": 0})
    pos: List[int] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True)
class TaskFailed(Message):
    """A map_seq call raised or its output failed validation (or did not fit a message)."""

    kind = "task_failed"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    pos: int = _nonneg()
    seq_tag: Optional[str] = None
    message: str = ""
    traceback: str = ""


@dataclass(frozen=True)
class StreamOpen(Message):
    """Run partition `partition` here; skip its first `skip` outputs (already delivered).

    `incarnation` numbers the partition's starts: the worker echoes it, so what an earlier
    start on the same worker sent is told apart from what this one sends."""

    kind = "stream_open"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    run: int = _nonneg()
    partition: int = _nonneg()
    skip: int = _nonneg()
    credit: int = _positive()
    incarnation: int = _nonneg()


@dataclass(frozen=True)
class StreamInputs(Message):
    kind = "stream_inputs"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    batch = True
    run: int = _nonneg()
    partition: int = _nonneg()


@dataclass(frozen=True)
class StreamEnd(Message):
    """No more inputs for this partition."""

    kind = "stream_end"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    run: int = _nonneg()
    partition: int = _nonneg()


@dataclass(frozen=True)
class StreamClose(Message):
    """Stop this partition here and drop it (it restarts on another worker)."""

    kind = "stream_close"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    run: int = _nonneg()
    partition: int = _nonneg()


@dataclass(frozen=True)
class StreamCredit(Message):
    """The worker may send `n` more outputs of this partition."""

    kind = "stream_credit"
    channel = Channel.WORKER
    sender = (Peer.SERVER,)
    receiver = (Peer.WORKER,)
    run: int = _nonneg()
    partition: int = _nonneg()
    n: int = _positive()


@dataclass(frozen=True)
class StreamAck(Message):
    """The stream took `n` inputs: the server may send that many more."""

    kind = "stream_ack"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    partition: int = _nonneg()
    incarnation: int = _nonneg()
    n: int = _positive()


@dataclass(frozen=True)
class StreamOutputs(Message):
    """Outputs of a partition; item `i` counts the stream's outputs from its start."""

    kind = "stream_outputs"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    batch = True
    run: int = _nonneg()
    partition: int = _nonneg()
    incarnation: int = _nonneg()


@dataclass(frozen=True)
class StreamDone(Message):
    kind = "stream_done"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    partition: int = _nonneg()
    incarnation: int = _nonneg()


@dataclass(frozen=True)
class StreamFailed(Message):
    kind = "stream_failed"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    partition: int = _nonneg()
    incarnation: int = _nonneg()
    seq_tag: Optional[str] = None
    message: str = ""
    traceback: str = ""


MESSAGES: Dict[str, Type[Message]] = {
    cls.kind: cls
    for cls in (
        InfoRequest,
        StatusRequest,
        StoryRequest,
        EpochRequest,
        DiscoverRequest,
        HostRequest,
        HostReply,
        InfoReply,
        StatusReply,
        StoryReply,
        EpochAccepted,
        DiscoverReply,
        ErrorReply,
        Credit,
        Started,
        Seqs,
        Keepalive,
        End,
        RunFailed,
        Superseded,
        ClientAlive,
        ClientClosed,
        Hello,
        Welcome,
        ShmMapped,
        Refuse,
        Unknown,
        Heartbeat,
        Bye,
        Retire,
        RunOpen,
        RunClose,
        RunDropped,
        Tasks,
        Mapping,
        Results,
        Completed,
        InputsLost,
        Dropped,
        ConsumerRoute,
        ConsumerGone,
        DirectHello,
        DirectWelcome,
        DirectSeqs,
        Missing,
        TaskFailed,
        StreamOpen,
        StreamInputs,
        StreamEnd,
        StreamClose,
        StreamCredit,
        StreamAck,
        StreamOutputs,
        StreamDone,
        StreamFailed,
    )
}
