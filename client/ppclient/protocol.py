"""Every message of the ppserver protocol, defined once.

Three kinds of peers talk: clients (a REQ socket for requests, a DEALER for an epoch's
data), the server (a control ROUTER and a worker ROUTER) and workers (a DEALER for tasks
and results, a second DEALER for heartbeats). Each message is one class below: its fields
with their types, who sends it and who receives it. `encode` turns a message (and the
items of a batch message) into frames; `decode` checks a received header against the
class's fields and refuses anything else, so handlers only ever see checked messages.

`docs/protocol.md` describes the conversations; `wire.py` holds the framing (msgpack
headers, raw array frames). Bump PROTOCOL whenever a message, a field or a rule changes
in a way an older peer would misread.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Type

from . import wire
from .errors import Error

PROTOCOL = 9

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


@dataclass(frozen=True)
class DiscoverRequest(Message):
    """A worker host asks the control address where the worker socket is."""

    kind = "discover"
    channel = Channel.CONTROL
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    versioned = True


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
    fingerprint: str = ""
    instance: str = ""
    batching: Optional[Dict[str, Any]] = None  # the config's default batching (None: one seq at a time)


@dataclass(frozen=True)
class StatusReply(Message):
    kind = "status_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT,)
    versioned = True
    status: Dict[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class ErrorReply(Message):
    """A refused request; `reason` says why (e.g. "protocol", "request")."""

    kind = "error_reply"
    channel = Channel.CONTROL
    sender = (Peer.SERVER,)
    receiver = (Peer.CLIENT, Peer.WORKER)
    versioned = True
    error: str = ""
    reason: str = "request"


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
    mappers, `mapped`: seqs they returned), so the server can tell mapping from transfer time."""

    kind = "hb"
    channel = Channel.WORKER
    sender = (Peer.SERVER, Peer.WORKER)
    receiver = (Peer.SERVER, Peer.WORKER)
    stats: Optional[Dict[str, Any]] = None


@dataclass(frozen=True)
class Bye(Message):
    kind = "bye"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)


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
    """Results sent directly to their consumers: positions and byte counts, no data."""

    kind = "completed"
    channel = Channel.WORKER
    sender = (Peer.WORKER,)
    receiver = (Peer.SERVER,)
    run: int = _nonneg()
    pos: List[int] = field(default_factory=list)
    nbytes: List[int] = field(default_factory=list)


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
        EpochRequest,
        DiscoverRequest,
        InfoReply,
        StatusReply,
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


# ---- items: seqs inside batch messages ----------------------------------------------------
# The most an item's header (position, meta entries, array specs) may have. The items of a batch
# share one header (wire.MAX_HEADER_BYTES), which also needs room for their shared-memory block
# descriptors: a worker refuses an output with a larger item header, and batches its outputs
# so that their item headers together stay within this too.
MAX_ITEM_HEADER_BYTES = wire.MAX_HEADER_BYTES // 4


@dataclass
class Item:
    """One seq inside a batch message: its position, meta entries, array specs and frames.

    `arrays` lists `[key, dtype, shape]` per array; `frames` holds one buffer per array
    (numpy arrays, bytes or zmq.Frames), which a forwarder passes on without decoding.
    Instead of frames, the arrays may lie in a shared-memory block of the sender's segment:
    `block` is `[offset, nbytes, seq, [offset of each array in the block]]` (header key "b");
    the receiver maps it (shm.py) and fills `frames` with views. Or they lie in the sender's
    own memory, for a receiver on its host that reads it there (cross-memory attach): `spans`
    is `[[address, nbytes], ...]`, one per array (header key "m"). `direct` marks a result the
    worker sent to its consumer itself (the server holds only its position and size).

    Batches: `batch` (header key "g") marks a seq of batch `batch` of the epoch, a batch of
    `size` seqs (header key "n"): a batch's inputs, or the seqs of a batch its client pads; they
    may come in several messages. `size` without `batch` marks a padded batch of that many seqs:
    its arrays are the padded ones and their `:lengths`, and each meta entry is a list with one
    value per seq.
    """

    pos: int
    meta: Dict[str, Any]
    arrays: List[List[Any]]
    frames: List[Any]
    nbytes: int = 0
    block: Optional[List[Any]] = None
    direct: bool = False
    spans: Optional[List[List[int]]] = None
    batch: Optional[int] = None
    size: Optional[int] = None

    def header(self) -> Dict[str, Any]:
        h = {"i": self.pos, "meta": self.meta, "arrays": self.arrays}
        if self.block is not None:
            h["b"] = self.block
        elif self.spans is not None:
            h["m"] = self.spans
        if self.batch is not None:
            h["g"] = self.batch
        if self.size is not None:
            h["n"] = self.size
        return h

    @property
    def wire_frames(self) -> List[Any]:
        """The frames that travel with the header (none when the arrays are elsewhere)."""
        return [] if self.block is not None or self.spans is not None else self.frames

    @property
    def task(self) -> int:
        """The position of the task the item belongs to: its batch's, for a seq of a batch."""
        return self.pos if self.batch is None else self.batch

    @property
    def seq_tag(self) -> Optional[str]:
        """The seq's tag (a padded batch's first one)."""
        tag = self.meta.get("seq_tag")
        return tag[0] if type(tag) is list and tag else tag if type(tag) is str else None

    @property
    def padded(self) -> bool:
        """A padded batch (one item for several seqs)."""
        return self.size is not None and self.batch is None

    @property
    def seqs(self) -> int:
        """How many seqs the item holds (a padded batch holds several)."""
        return self.size if self.padded else 1  # type: ignore[return-value]


@dataclass
class Batch:
    """The inputs of batch `pos` of an epoch (the server's cut): its seqs, in the order they are
    padded, each an item naming the batch. The scheduler moves it as one task."""

    pos: int
    items: List[Item]
    nbytes: int = -1  # of its arrays (counted when made)

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = sum(item.nbytes for item in self.items)

    @property
    def seq_tag(self) -> Optional[str]:
        return self.items[0].seq_tag if self.items else None

    @property
    def seqs(self) -> int:
        return len(self.items)

    def tags(self, limit: int = 4) -> str:
        """Its seqs' tags in words (for errors)."""
        tags = [repr(item.seq_tag) for item in self.items[:limit]]
        more = len(self.items) - limit
        return ", ".join(tags) + (f" and {more} more" if more > 0 else "")


def item_header_bytes(item: Item) -> int:
    """The size of an item's header as it travels (without a shared-memory block descriptor)."""
    return len(wire.pack(item.header()))


def oversized_header(item: Item) -> Optional[int]:
    """The size of an item's header if it is over MAX_ITEM_HEADER_BYTES, else None. A bound on the
    size (4 bytes a character, 9 a number, room for msgpack's own bytes) tells the usual small
    header at a fraction of the cost of packing it, on the reader's hot path; only a header the
    bound puts near the limit is packed."""
    bound = 64
    for value in item.meta.values():
        bound += 24 + (4 * len(value) if type(value) is str else 0)
    for key, dtype, shape in item.arrays:
        bound += 24 + 4 * len(key) + len(dtype) + 9 * len(shape)
    if bound <= MAX_ITEM_HEADER_BYTES:
        return None
    size = item_header_bytes(item)
    return size if size > MAX_ITEM_HEADER_BYTES else None


SHORT_TAG = 200  # characters of a seq tag that a message about it names


def short_tag(tag: Optional[str]) -> Optional[str]:
    """A seq tag as messages about it name it: a huge one shortened, so that it fits a header."""
    if tag is None or len(tag) <= SHORT_TAG:
        return tag
    return f"{tag[:SHORT_TAG]}... ({len(tag)} characters)"


PEEK_BYTES = 16 * wire.MAX_HEADER_BYTES  # how large a header a dropped message's report reads


def dropped(frames: Sequence[Any], reason: str) -> Dropped:
    """The report of a message that did not decode: what it names, read leniently (its header may be
    over the cap, say; it is in memory already). Any position that cannot be read leaves `pos`
    empty: every task of the run."""
    report = Dropped(reason=reason[:500])
    try:
        header, _ = wire.split(frames, max_bytes=PEEK_BYTES)
    except wire.WireError:
        return report
    kind, run, part, specs = header.get(KIND), header.get("run"), header.get("partition"), header.get("items")
    positions = [_task_position(spec) if type(spec) is dict else None for spec in specs] if type(specs) is list else []
    return dataclasses.replace(
        report,
        what=kind if type(kind) is str and len(kind) <= 40 else "",
        run=_index(run),
        partition=_index(part),
        pos=_all_known(positions),
    )


def _index(value: Any) -> Optional[int]:
    return value if _is_int(value) and value >= 0 else None


def dropped_items(msg: Message, bad: Sequence[BadItem], reason: str) -> Dropped:
    """The report of items of a decoded message that did not check."""
    return Dropped(
        what=msg.kind,
        run=getattr(msg, "run", None),
        partition=getattr(msg, "partition", None),
        pos=_all_known([b.pos for b in bad]),
        reason=reason[:500],
    )


def _all_known(positions: Sequence[Optional[int]]) -> List[int]:
    """Positions as a report names them: all (each task once: a batch's seqs name it), or none when one
    is unknown (every task of the run)."""
    known = [p for p in positions if p is not None]
    return list(dict.fromkeys(known)) if len(known) == len(positions) else []


def seq_to_item(seq: Dict[str, Any], pos: int) -> Item:
    """A seq dict (data keys -> numpy arrays, plus meta entries) as an Item; see wire.split_seq."""
    meta, arrays, frames, nbytes = wire.split_seq(seq)
    return Item(pos, meta, arrays, frames, nbytes)


def item_to_seq(item: Item) -> Dict[str, Any]:
    """The seq dict of an Item (arrays are views of its frames), or a padded batch's dict (see
    collate.batch_dict)."""
    if not item.padded:
        return wire.build_seq(item.arrays, item.meta, item.frames)
    from .collate import batch_dict

    return batch_dict(wire.build_seq(item.arrays, {}, item.frames), item.meta)


def to_block(items: Sequence[Item], ring: Any, owner: bytes = b"") -> Tuple[List[Item], Any]:
    """The items with their arrays copied into one block of `ring` (shm.Ring), and the block; the
    items themselves and None if the ring has no room (or nothing needs one: items laid out in a
    block of their own already stay as they are). One block per message: one allocation, and one
    release once the receiver has dropped every array of every seq in it."""
    from . import shm

    loose = [item for item in items if item.block is None]
    if not loose:
        return list(items), None
    packed = shm.pack(ring, [_as_array(f) for item in loose for f in item.frames], owner)
    if packed is None:
        return list(items), None
    block, offsets = packed
    ref = block.ref()
    out: List[Item] = []
    at = 0
    for item in items:
        if item.block is not None:
            out.append(item)
            continue
        n = len(item.frames)
        out.append(dataclasses.replace(item, frames=[], block=[ref.offset, ref.nbytes, ref.seq, offsets[at : at + n]]))
        at += n
    return out, block


def to_spans(items: Sequence[Item]) -> Optional[List[Item]]:
    """The items with their arrays named by address in this process (its memory must stay as it
    is until the receiver has read it); None if a frame is not a C-contiguous numpy array."""
    out: List[Item] = []
    ndarray = wire.numpy.ndarray
    for item in items:
        spans = []
        for f in item.frames:  # (split_seq made them C-contiguous)
            if type(f) is not ndarray:
                return None
            spans.append([f.__array_interface__["data"][0], f.nbytes])
        out.append(Item(item.pos, item.meta, item.arrays, [], item.nbytes, None, False, spans, item.batch, item.size))
    return out


def _as_array(frame: Any) -> Any:
    import numpy

    if isinstance(frame, numpy.ndarray):
        return frame
    return numpy.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, numpy.uint8)


def resolve_blocks(items: List[Item], mapping: Any) -> List[BadItem]:
    """Give items in shared memory their arrays (views of `mapping`, a shm.Mapping); the items
    whose block cannot be used are taken out and returned as bad. Items naming the same block
    (one message's seqs) share one lease on it."""
    from . import shm

    bad: List[BadItem] = []
    groups: Dict[Tuple[int, int, int], List[Item]] = {}
    for item in items:
        if item.block is not None:
            b = item.block
            groups.setdefault((b[0], b[1], b[2]), []).append(item)
    if not groups:
        return bad
    failed = set()
    for ref, group in groups.items():
        if mapping is None:
            reason = "an item in shared memory, but no segment is mapped"
        else:
            specs = [(k, d, shape, o) for item in group for (k, d, shape), o in zip(item.arrays, item.block[3])]  # type: ignore[index]
            try:
                views = mapping.views(ref, specs)
            except (shm.ShmUnavailable, ValueError) as exc:
                reason = str(exc)
            else:
                give_arrays(group, views)
                continue
        for item in group:
            bad.append(BadItem(item.task, reason))
            failed.add(id(item))
    if failed:
        items[:] = [item for item in items if id(item) not in failed]
    return bad


def block_refs(frames: Sequence[Any]) -> List[Tuple[Optional[int], List[int]]]:
    """(position, [offset, nbytes, seq]) of each shared-memory block a batch message names, read
    leniently: for giving back the blocks of a message, or items, that did not check."""
    try:
        header, _ = wire.split(frames)
    except wire.WireError:
        return []
    specs = header.get("items")
    out: List[Tuple[Optional[int], List[int]]] = []
    for spec in specs if isinstance(specs, list) else []:
        block = spec.get("b") if isinstance(spec, dict) else None
        if isinstance(block, list) and len(block) >= 3 and all(_is_int(x) for x in block[:3]):
            out.append((_position(spec), block[:3]))
    return out


def unused_blocks(frames: Sequence[Any], kept: Sequence[Item]) -> List[List[int]]:
    """The blocks a batch message names that none of its `kept` items uses: the seqs of a message
    share a block, so one is given back only when no seq of it is kept."""
    refs = block_refs(frames)
    positions = {item.pos for item in kept}
    live = {tuple(ref) for pos, ref in refs if pos in positions}
    out: List[List[int]] = []
    for pos, ref in refs:
        key = tuple(ref)
        if pos not in positions and key not in live:
            live.add(key)  # each block once
            out.append(ref)
    return out


def give_arrays(items: Sequence[Item], arrays: Sequence[Any]) -> None:
    """Items that named where their arrays lie (a block, the sender's memory) get them, in order."""
    at = 0
    for item in items:
        n = len(item.arrays)
        item.frames = list(arrays[at : at + n])
        item.block = item.spans = None
        at += n


class BadItem(typing.NamedTuple):
    pos: Optional[int]  # the task's position the item claimed (its batch, for a seq of one), if it was an int
    reason: str


def check_item(spec: Any, frames: Sequence[Any]) -> Item:
    """An item header checked against its frames: meta, keys, dtypes and byte counts.

    Raises ProtocolError. Nothing here builds an array, so a forwarder pays only for the checks.
    (Every seq of every message passes here: the checks are written out for speed.)
    """
    if type(spec) is not dict:
        raise ProtocolError("item is not a map")
    pos = spec.get("i")
    meta = spec.get("meta")
    arrays = spec.get("arrays")
    if type(pos) is not int or pos < 0:
        raise ProtocolError(f"item position {pos!r:.40} is not an int >= 0")
    if type(meta) is not dict:
        raise ProtocolError(f"item {pos}: meta is not a map")
    block = spec.get("b")
    spans = spec.get("m")
    if type(arrays) is not list:
        raise ProtocolError(f"item {pos}: the arrays entry is not a list")
    if block is not None:
        if spans is not None:
            raise ProtocolError(f"item {pos}: arrays both in a block and in the sender's memory")
        _check_block(pos, block, arrays, frames)
    elif spans is not None:
        _check_spans(pos, spans, arrays, frames)
    elif len(arrays) != len(frames):
        raise ProtocolError(f"item {pos}: the arrays list does not match its {len(frames)} frames")
    batch = spec.get("g")
    seqs = spec.get("n")
    if batch is not None and (type(batch) is not int or batch < 0 or seqs is None):
        raise ProtocolError(f"item {pos}: batch {batch!r:.40} is not an int >= 0 with a size")
    if seqs is not None and (type(seqs) is not int or seqs < 1):
        raise ProtocolError(f"item {pos}: bad batch size {seqs!r:.40}")
    if seqs is None or batch is not None:
        for key, value in meta.items():
            if not _meta_ok(key, value):
                raise ProtocolError(f"item {pos}: bad meta entry {key!r:.40}: {value!r:.40}")
    else:
        for key, values in meta.items():
            if type(values) is not list or len(values) != seqs or not _meta_list_ok(key, values):
                raise ProtocolError(f"item {pos}: bad meta entry {key!r:.40} of a batch of {seqs}: {values!r:.40}")
    sizes = []
    keys = set()
    for spec_ in arrays:
        if type(spec_) is not list or len(spec_) != 3:
            raise ProtocolError(f"item {pos}: bad array spec {spec_!r:.60}")
        key, dtype_str, shape = spec_
        if type(key) is not str or key in META_KEYS or key in keys:
            raise ProtocolError(f"item {pos}: bad or repeated array key {key!r:.40}")
        keys.add(key)
        itemsize = _itemsize(dtype_str) if type(dtype_str) is str else None
        if itemsize is None:
            raise ProtocolError(f"item {pos}: refused dtype {dtype_str!r:.40}")
        if type(shape) is not list or len(shape) > MAX_NDIM:
            raise ProtocolError(f"item {pos}: bad shape {shape!r:.60} for {key!r}")
        count = 1
        nonzero = 1  # numpy must be able to hold the shape even when a zero makes it empty
        for d in shape:
            if type(d) is not int or d < 0:
                raise ProtocolError(f"item {pos}: bad shape {shape!r:.60} for {key!r}")
            count *= d
            nonzero *= d or 1
        if nonzero > MAX_ELEMENTS:
            raise ProtocolError(f"item {pos}: shape {shape!r:.60} of {key!r} is too large")
        sizes.append(count * itemsize)
    nbytes = 0
    if spans is not None:
        for spec_, (_, size), want in zip(arrays, spans, sizes):
            if size != want:
                raise ProtocolError(
                    f"item {pos}: array {spec_[0]!r} spans {size} bytes, not those of {spec_[2]} {spec_[1]}"
                )
            nbytes += size
        return Item(pos, meta, arrays, [], nbytes, spans=spans, batch=batch, size=seqs)
    if block is None:
        for spec_, frame, want in zip(arrays, frames, sizes):
            size = frame.nbytes if type(frame) is not bytes and hasattr(frame, "nbytes") else len(frame)
            if size != want:
                raise ProtocolError(
                    f"item {pos}: array {spec_[0]!r} has {size} bytes, not those of {spec_[2]} {spec_[1]}"
                )
            nbytes += size
        return Item(pos, meta, arrays, list(frames), nbytes, batch=batch, size=seqs)
    limit = block[1]
    for offset, size in zip(block[3], sizes):
        if offset + size > limit:
            raise ProtocolError(f"item {pos}: an array lies outside its shared-memory block")
        nbytes += size
    return Item(pos, meta, arrays, [], nbytes, block=block, batch=batch, size=seqs)


def _meta_list_ok(key: str, values: List[Any]) -> bool:
    """A padded batch's meta entry: one value per seq, each of the entry's type."""
    types = set(map(type, values))  # (in C: a batch's meta lists are checked once per message)
    if key == "seq_tag":
        return types <= _STR
    if key == "seq_idx":
        return types <= _INT
    return key == "complete_frac" and types <= _NUMBER


_STR, _INT, _NUMBER = {str}, {int}, {int, float}


def _meta_ok(key: str, value: Any) -> bool:
    t = type(value)
    return (
        (key == "seq_tag" and t is str)
        or (key == "seq_idx" and t is int)
        or (key == "complete_frac" and (t is float or t is int))
    )


def _check_spans(pos: int, spans: Any, arrays: Any, frames: Sequence[Any]) -> None:
    if frames:
        raise ProtocolError(f"item {pos}: an item in the sender's memory carries frames")
    ok = type(spans) is list and len(spans) == len(arrays)
    if ok:
        for sp in spans:
            if type(sp) is not list or len(sp) != 2:
                ok = False
                break
            for v in sp:
                if type(v) is not int or v < 0:
                    ok = False
    if not ok:
        raise ProtocolError(f"item {pos}: bad memory spans {spans!r:.60}")


def _check_block(pos: int, block: Any, arrays: Any, frames: Sequence[Any]) -> None:
    if frames:
        raise ProtocolError(f"item {pos}: an item in shared memory carries frames")
    ok = type(block) is list and len(block) == 4 and type(block[3]) is list and len(block[3]) == len(arrays)
    if ok:
        for v in block[:3]:
            if type(v) is not int or v < 0:
                ok = False
        for v in block[3]:
            if type(v) is not int or v < 0:
                ok = False
    if not ok:
        raise ProtocolError(f"item {pos}: bad shared-memory block {block!r:.60}")


MAX_NDIM = 64  # numpy's limit
MAX_ELEMENTS = 1 << 56


@functools.lru_cache(maxsize=1024)
def _itemsize(dtype_str: str) -> Optional[int]:
    """The item size of a plain dtype from the network, or None if it is refused (call with a str)."""
    try:
        size = wire.check_dtype(dtype_str).itemsize
    except wire.WireError:
        return None
    return size or None  # 'S0', 'U0': nothing to rebuild an array from


# ---- encode / decode ------------------------------------------------------------------------
def encode(msg: Message, items: Sequence[Item] = ()) -> List[Any]:
    """The frames of a message: its header, then every item's frames in order."""
    header: Dict[str, Any] = {KIND: msg.kind}
    if msg.versioned:
        header[PROTO_FIELD] = PROTOCOL
    for f in _FIELDS[type(msg)]:
        header[f.name] = getattr(msg, f.name)
    if not msg.batch:
        return [wire.pack(header)]
    header["items"] = [item.header() for item in items]
    frames: List[Any] = [wire.pack(header)]
    for item in items:
        frames.extend(item.wire_frames)
    return frames


def encode_fitting(msg: Message, items: Sequence[Item]) -> List[List[Any]]:
    """The frames of a batch message, as one message or, if its header would exceed
    wire.MAX_HEADER_BYTES, as several (see split_fitting)."""
    frames = encode(msg, items)
    if len(frames[0]) <= wire.MAX_HEADER_BYTES or len(items) < 2:
        return [frames]
    return [encode(m, part) for m, part in split_fitting(msg, items)]


# what naming an item's arrays elsewhere (a block, the sender's memory) may add to its header
PLACE_ITEM_BYTES = 40  # "b": offset, nbytes, seq (or "m" and its list)
PLACE_ARRAY_BYTES = 16  # an array's offset, or its address and size


def split_fitting(msg: Message, items: Sequence[Item], placed: bool = False) -> List[Tuple[Message, List[Item]]]:
    """A batch message as one or, if its header would exceed wire.MAX_HEADER_BYTES, as several,
    each with a run of the items in order (and of the `per_item` fields). An item whose header
    alone does not fit still goes, alone. `placed`: the items' arrays will be named by place (a
    block or addresses) instead of frames, so their room is counted too."""
    size = len(encode(msg, items)[0])
    if placed:
        size += sum(PLACE_ITEM_BYTES + PLACE_ARRAY_BYTES * len(item.arrays) for item in items)
    if size <= wire.MAX_HEADER_BYTES or len(items) < 2:
        return [(msg, list(items))]
    half = len(items) // 2
    out: List[Tuple[Message, List[Item]]] = []
    for part in (slice(0, half), slice(half, len(items))):
        fields = {name: getattr(msg, name)[part] for name in msg.per_item if len(getattr(msg, name)) == len(items)}
        out += split_fitting(dataclasses.replace(msg, **fields), items[part], placed)
    return out


def encode_batch(msg: Message, headers: List[Dict[str, Any]], frames: Sequence[Any]) -> List[Any]:
    """A batch message from ready item headers and their frames (the server's relay path)."""
    header: Dict[str, Any] = {KIND: msg.kind}
    for f in _FIELDS[type(msg)]:
        header[f.name] = getattr(msg, f.name)
    header["items"] = headers
    return [wire.pack(header), *frames]


@dataclass
class Decoded:
    msg: Message
    items: List[Item] = field(default_factory=list)
    bad: List[BadItem] = field(default_factory=list)  # items of a batch that did not check
    unreadable: List[BadItem] = field(default_factory=list)  # checked, but their arrays could not be read


def decode(
    frames: Sequence[Any],
    receiver: Peer,
    channels: Tuple[Channel, ...],
    *,
    max_header_bytes: int = wire.MAX_HEADER_BYTES,
) -> Decoded:
    """Check and decode a message (header frame first) that `receiver` got on one of `channels`.

    Raises ProtocolError for an unknown kind, one that does not go to `receiver` on those
    channels, a missing field or one of the wrong type, and VersionMismatch for a versioned
    message of another protocol version. Items of a batch that do not check are returned in
    `bad` instead of `items`.
    """
    try:
        header, bufs = wire.split(frames, max_bytes=max_header_bytes)
    except wire.WireError as exc:
        raise ProtocolError(str(exc)) from None
    kind = header.get(KIND)
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r:.40}")
    if receiver not in cls.receiver or cls.channel not in channels:
        raise ProtocolError(f"a {receiver.value} does not accept {kind!r} messages on this socket")
    if cls.versioned and header.get(PROTO_FIELD) != PROTOCOL:
        raise VersionMismatch(header.get(PROTO_FIELD), cls.kind)
    values = {}
    for name, check, low in _SPECS[cls]:
        try:
            value = header[name]
        except KeyError:  # encode writes every field: a missing one is not our peer's doing
            raise ProtocolError(f"{kind!r} without its {name!r} field") from None
        try:
            value = check(value)
        except ValueError as exc:
            raise ProtocolError(f"{kind}.{name} must be {exc}") from None
        if low is not None and value is not None and value < low:
            raise ProtocolError(f"{kind}.{name} must be >= {low}, got {value}")
        values[name] = value
    msg = cls(**values)
    if not cls.batch:
        if bufs:
            raise ProtocolError(f"{kind!r} carries no frames, got {len(bufs)}")
        return Decoded(msg)
    return _decode_items(msg, header.get("items"), bufs)


def _decode_items(msg: Message, specs: Any, bufs: List[Any]) -> Decoded:
    if type(specs) is not list:
        raise ProtocolError(f"{msg.kind!r} without an items list")
    out = Decoded(msg)
    at = 0
    for spec in specs:
        arrays = spec.get("arrays") if type(spec) is dict else None
        if type(arrays) is not list:
            break
        n = 0 if "b" in spec or "m" in spec else len(arrays)  # arrays in (shared) memory have no frames
        if at + n > len(bufs):
            break
        try:
            out.items.append(check_item(spec, bufs[at : at + n]))
        except ProtocolError as exc:
            out.bad.append(BadItem(_task_position(spec), str(exc)))
        at += n
    else:
        if at == len(bufs):
            return out
    # frames cannot be matched to items: every item is bad
    out.items.clear()
    out.bad = [
        BadItem(_task_position(spec) if type(spec) is dict else None, "items and frames do not match") for spec in specs
    ]
    return out


def _position(spec: Dict[str, Any]) -> Optional[int]:
    pos = spec.get("i")
    return pos if type(pos) is int and pos >= 0 else None


def _task_position(spec: Dict[str, Any]) -> Optional[int]:
    """The position of the task an item header belongs to: its batch's, for a seq of a batch."""
    batch = spec.get("g")
    return batch if type(batch) is int and batch >= 0 else _position(spec)


class VersionMismatch(ProtocolError):
    def __init__(self, theirs: Any, kind: str):
        super().__init__(mismatch_text(theirs, "the peer"))
        self.theirs = theirs
        self.msg_kind = kind


def mismatch_text(theirs: Any, who: str) -> str:
    return f"protocol version mismatch: {who} speaks {theirs!r}, this side speaks {PROTOCOL}"


# ---- field checks ---------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_like(value: Any, depth: int = 0) -> bool:
    if depth > 8:
        return False
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_json_like(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    return False


def _checker(tp: Any):
    """A function value -> checked value for a field type; raises ValueError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        inner = _checker(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if origin in (list, List):
        elem = _checker(args[0])
        return lambda v: [elem(x) for x in _require(v, list)]
    if origin in (dict, Dict):
        return lambda v: _require_json(_require(v, dict))
    if tp is int:
        return lambda v: v if _is_int(v) else _bad(v, "an int")
    if tp is float:
        return lambda v: (
            float(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            else _bad(v, "a finite number")
        )
    if tp is bool:
        return lambda v: v if isinstance(v, bool) else _bad(v, "a bool")
    if tp is str:
        return lambda v: v if isinstance(v, str) else _bad(v, "a str")
    if tp is bytes:
        return lambda v: v if isinstance(v, bytes) else _bad(v, "bytes")
    raise TypeError(f"no check for field type {tp!r}")


def _require(value: Any, tp: type) -> Any:
    if not isinstance(value, tp):
        _bad(value, f"a {tp.__name__}")
    return value


def _require_json(value: Dict[str, Any]) -> Dict[str, Any]:
    if not _json_like(value):
        raise ValueError("a map of plain values")
    return value


def _bad(value: Any, what: str) -> Any:
    raise ValueError(f"{what}, got {type(value).__name__}")


_FIELDS: Dict[Type[Message], Tuple[dataclasses.Field, ...]] = {}
_SPECS: Dict[Type[Message], Tuple[Tuple[str, Any, Optional[int]], ...]] = {}  # (name, check, minimum)
for _cls in MESSAGES.values():
    _hints = typing.get_type_hints(_cls)
    _FIELDS[_cls] = tuple(f for f in dataclasses.fields(_cls))
    _SPECS[_cls] = tuple((f.name, _checker(_hints[f.name]), f.metadata.get("min")) for f in _FIELDS[_cls])


def describe() -> List[Dict[str, Any]]:
    """Every message with its sender, receiver and fields (for docs and tests)."""
    out = []
    hints_cache = {cls: typing.get_type_hints(cls) for cls in MESSAGES.values()}
    for kind, cls in MESSAGES.items():
        out.append(
            {
                "kind": kind,
                "class": cls.__name__,
                "sender": [p.value for p in cls.sender],
                "receiver": [p.value for p in cls.receiver],
                "channel": cls.channel.value,
                "batch": cls.batch,
                "fields": {f.name: _type_name(hints_cache[cls][f.name]) for f in _FIELDS[cls]},
            }
        )
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:
        return "Optional[" + _type_name(next(a for a in args if a is not type(None))) + "]"
    if origin in (list, List):
        return f"List[{_type_name(args[0])}]"
    if origin in (dict, Dict):
        return "Dict[str, Any]"
    return getattr(tp, "__name__", str(tp))
