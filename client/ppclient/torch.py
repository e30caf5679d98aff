"""PyTorch: a ppserver epoch as a `torch.utils.data.IterableDataset` (``pip install ./client[torch]``).

    from ppclient.torch import ServerDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = ServerDataset("tcp://trainer:5555", job="asr", batch_frames=20000, max_seqs=64, bucket_window=256)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    for epoch in range(1, 11):
        ds.set_epoch(epoch)                     # as with DistributedSampler
        for batch in loader:
            ...                                 # {"data": (B, T, 80), "data:lengths": (B,), "seq_tag": [...], ...}

Rank and world size come from `torch.distributed` when it is initialised, else from the
RANK and WORLD_SIZE environment variables, else 0 and 1; each rank reads its strided shard.
With batching the server cuts the epoch into batches and its workers pad them; batch j goes
to rank j % world_size. Under a DataLoader with k workers, worker w reads every k-th seq (or
batch) of the rank's shard from its w-th on (a subshard), so a loader that takes from its
workers in turn (batch_size=None) yields the rank's part in epoch order. `set_epoch` reaches
persistent DataLoader workers too (the epoch lives in shared memory). `state_dict()` /
`load_state_dict()` follow the stateful protocol of torchdata's StatefulDataLoader: per
worker, the epoch and the position in its subshard, so a resumed loader delivers exactly what
the interrupted one would have delivered next; a state applies to its own epoch (a state
from an epoch's end, also one taken in the loop right after its last item, resumed with
set_epoch of another epoch reads that epoch from its start).

Arrays become tensors with `torch.from_numpy`, sharing the received memory (a worker's shared
memory on one host, else the received frames; writable with pyzmq 27 and later; with older
pyzmq a frame is read-only and is copied once, to spare PyTorch's warning about non-writable
arrays). That is no copy where the dataset is iterated; from DataLoader workers, PyTorch moves
each tensor into shared memory once (a copy) to pass it to the main process. Pinning belongs
in the main process: `DataLoader(pin_memory=True)` pins the seqs and batches (dicts of
tensors) there; `ServerDataset(pin_memory=True)` pins only when the dataset is iterated in
the main process (num_workers=0).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from multiprocessing import util as mp_util
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple, Union

import numpy
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import collate
from .batching import Batching
from .client import Client, EpochIterator, _close_open
from .errors import Error, UsageError

log = logging.getLogger("ppclient.torch")

__all__ = ["ServerDataset", "collate_padded", "pinned", "rank_and_world"]


def rank_and_world() -> Tuple[int, int]:
    """This process's rank and world size: torch.distributed, else RANK/WORLD_SIZE, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UsageError(
            f"RANK={os.environ.get('RANK')!r} / WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} must be integers"
        ) from None


TENSOR_KINDS = "biufc"  # numpy dtype kinds a tensor can hold (bool, ints, floats, complex)


def to_tensors(seq: Dict[str, Any]) -> Dict[str, Any]:
    """Arrays as tensors sharing their memory; meta entries stay Python values, and so do arrays
    a tensor cannot hold: strings (the server's "string" dtype, e.g. a transcription) become a
    str, or a list of str, as `seq_tag` is."""
    out: Dict[str, Any] = {}
    for key, value in seq.items():
        if not isinstance(value, numpy.ndarray):
            out[key] = value
        elif value.dtype.kind not in TENSOR_KINDS:
            out[key] = value.tolist()
        else:
            out[key] = torch.from_numpy(value if value.flags.writeable else value.copy())
    return out


def collate_padded(seqs: List[Dict[str, Any]], pin_memory: bool = False) -> Dict[str, Any]:
    """Seqs (dicts of tensors or arrays) as one batch, as the server's workers pad a batch: every
    array key zero-padded to the longest along its first axis, with `key + ":lengths"` (int64);
    scalars stacked; `seq_tag` (and string keys) as lists, `seq_idx` and `complete_frac` as
    tensors. A collate_fn for a DataLoader over seqs."""
    as_numpy = [{k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in seq.items()} for seq in seqs]
    batch = to_tensors(collate.pad(as_numpy))
    return pinned(batch) if pin_memory else batch


class _Plan(NamedTuple):
    epoch: int
    resume: Optional[Dict[str, Any]] = None  # an EpochIterator state (plus the batching's) to start from
    finished: bool = False  # the state was taken at the epoch's end
    refusal: Optional[str] = None  # why the state cannot apply (raised when the first item is asked for)
    # after a loaded state: False, the state's own epoch goes on; True, another epoch, from its start
    after: Optional[bool] = None


MAX_TURNS = 256  # DataLoader workers whose turns a restored loader can be told (_Turns)


class _Turns:
    """Which part of the rank's shard each worker of a restored StatefulDataLoader reads.

    A loader takes from its k workers in turn and, restored, goes on with the worker after the
    one that yielded last; with the epoch from its start, worker 0 reads part 0 of the rank's
    shard. An epoch begun in a restored iteration must begin with the worker whose turn it is:
    worker w reads part (w - shift) % k. Each worker is given only its own state, but all of them
    load theirs before the first item is asked for (the loader collects their states first): each
    notes here, in memory shared by the loader's processes, how many items its state's epoch had
    yielded and which part it read; from all of them a worker knows the shift."""

    def __init__(self) -> None:
        self.table = torch.full((2, MAX_TURNS), -1, dtype=torch.int64).share_memory_()

    def note(self, worker: int, parts: int, state: Dict[str, Any]) -> None:
        if parts == 1 or parts > MAX_TURNS:
            return
        resume = state.get("resume") or {}
        # (a finished state without its count, of an older ppclient, leaves the turns unknown)
        count = resume.get("position", state.get("position", -1 if state.get("finished") else 0))
        saved = resume.get("subshard", state.get("subshard"))
        shift = (worker - saved[0]) % parts if saved is not None and saved[1] == parts else -1
        self.table[0, worker], self.table[1, worker] = count, shift

    def shift(self, parts: int, after: bool) -> Optional[int]:
        """How far the parts are turned for an epoch begun in the restored iteration (`after`: not
        the state's, but the next one, whose first item is the turn of the worker after the last)."""
        if parts > MAX_TURNS:
            return None
        counts, shifts = self.table[0, :parts].tolist(), self.table[1, :parts].tolist()
        if min(counts) < 0:
            return None
        known = [s for s in shifts if s >= 0]  # (equal: a state's readers turn alike)
        return ((known[0] if known else 0) + (sum(counts) if after else 0)) % parts


class ServerDataset(IterableDataset):
    """One ppserver epoch per iteration (`set_epoch(n)` picks it), this rank's shard of it.

    Without `batch_frames`/`max_seqs`/`max_duration` it yields what the server's config says: one
    seq at a time (a dict of tensors plus `seq_tag`, `seq_idx`, `complete_frac`) unless the config
    sets a `batching` (then the config's settings apply: `bucket_window`, `length_key` and `pad`
    are refused without them). With them the server cuts the epoch into batches (at most `max_seqs` seqs,
    `batch_frames` padded frames and `max_duration` seconds as Lhotse counts them, with its
    `quadratic_duration`, each; sorted by length, or duration, `bucket_window` seqs at a time) and its
    workers pad them: it yields batches `{key: (B, T, ...), key + ":lengths": (B,), "seq_tag":
    [...], "seq_idx": (B,), "complete_frac": (B,)}`. Batch j of the epoch goes to rank
    j % world_size, so with drop_last every rank takes the same number of steps. Use it with
    `DataLoader(batch_size=None)`.
    `config=PATH` instead of an address: a local server for that ppserver config, started by the
    first rank on this node and stopped with the last (see ppclient.local_server).
    """

    def __init__(
        self,
        address: Optional[str] = None,
        *,
        config: Optional[str] = None,
        job: str = "default",
        epoch: int = 1,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = True,
        timeout: float = 30.0,
        window: Optional[int] = None,
        keys: Optional[str] = None,
        direct: Union[bool, str] = True,
        batch_frames: Optional[int] = None,
        max_seqs: Optional[int] = None,
        max_duration: Optional[float] = None,
        quadratic_duration: Optional[float] = None,
        bucket_window: int = 1,
        length_key: Optional[str] = None,
        pad: Optional[Dict[str, float]] = None,
        pin_memory: bool = False,
    ):
        super().__init__()
        for name, value in (("batch_frames", batch_frames), ("max_seqs", max_seqs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{name} must be an int >= 1 or None, got {value!r}")
        if isinstance(bucket_window, bool) or not isinstance(bucket_window, int) or bucket_window < 1:
            raise UsageError(f"bucket_window must be an int >= 1, got {bucket_window!r}")
        batching: Optional[Dict[str, Any]] = None  # the server's default
        caps = (batch_frames, max_seqs, max_duration, quadratic_duration)
        cut = {"bucket_window": bucket_window != 1, "length_key": length_key is not None, "pad": bool(pad)}
        if all(v is None for v in caps) and any(cut.values()):
            raise UsageError(
                f"{', '.join(k for k, v in cut.items() if v)} without batch_frames, max_seqs or max_duration: they are "
                "settings of a cut this dataset asks for (without one it takes the server's, with that one's settings)"
            )
        if any(v is not None for v in caps):
            batching = {
                "max_frames": batch_frames,
                "max_seqs": max_seqs,
                "max_duration": max_duration,
                "quadratic_duration": quadratic_duration,
                "bucket_window": bucket_window,
                "length_key": length_key,
                "pad": pad or {},
            }
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise UsageError(f"epoch must be an int >= 0, got {epoch!r}")
        self.job = job
        self._fixed = (rank, world_size)
        rank, world_size = self._resolve()
        if (address is None) == (config is None):
            raise UsageError("give the address of a running server or config=PATH for a local one (one of the two)")
        if address is None:  # a local server for this config, one for all ranks on this node
            from .local_server import local_address

            address = local_address(str(config), job=job, shared=world_size > 1)
        self.address = address
        # What set_epoch sets, in shared memory: DataLoader workers (persistent ones too, which keep
        # their copy of the dataset from one epoch to the next) read it when an iteration begins.
        # [epoch, 1 once set_epoch was called, rank, world_size]
        self._shared = torch.tensor([epoch, 0, rank, world_size], dtype=torch.int64).share_memory_()
        self.client_options: Dict[str, Any] = {
            "timeout": timeout,
            "window": window,
            "keys": keys,
            "direct": direct,
            "drop_last": drop_last,
            "batching": batching,
        }
        if batching is not None:
            Batching.from_dict(batching, "ServerDataset's batching")  # a bad value is a UsageError now
        self.pin_memory = pin_memory
        self._loaded: Optional[Dict[str, Any]] = None  # a state to start the next iteration from
        self._num_seqs: Optional[int] = None  # seqs per epoch, once asked for (len())
        self._stream: Optional[_Stream] = None
        self._client: Optional[Client] = None
        self._client_key: Optional[Tuple[int, ...]] = None
        self._closer: Optional[mp_util.Finalize] = None  # closes the client, at the latest when its process exits
        self._turns = _Turns()

    def _resolve(self) -> Tuple[int, int]:
        rank, world = self._fixed
        if rank is None or world is None:
            found = rank_and_world()
            rank = found[0] if rank is None else rank
            world = found[1] if world is None else world
        return rank, world

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (set it with `set_epoch`)."""
        return self._plan(self._loaded, apply=False).epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.set_epoch(value)

    @property
    def rank(self) -> int:
        return int(self._shared[2])

    @property
    def world_size(self) -> int:
        return int(self._shared[3])

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (call it before each epoch, as with DistributedSampler).

        It reaches DataLoader workers also with `persistent_workers=True`. A loaded state (e.g.
        `loader.load_state_dict(...)`, which loads lazily, when the next iteration begins) applies
        to its own epoch: the usual loop `ds.set_epoch(epoch); for batch in loader: ...` goes on
        with the rest of the state's epoch, or, after a state taken at an epoch's end (after the
        loop, or in it right after the last item), with set_epoch's epoch from its start. A state
        taken in the middle of another epoch is refused (UsageError) when the iteration begins.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise UsageError(f"epoch must be an int >= 0, got {epoch!r}")
        rank, world = self._resolve()  # torch.distributed may be initialised by now
        self._shared.copy_(torch.tensor([epoch, 1, rank, world], dtype=torch.int64))

    def _plan(self, state: Optional[Dict[str, Any]], apply: bool = True) -> _Plan:
        """Where an iteration that starts from `state` (a loaded state, or None) begins.

        The epoch is set_epoch's, if it was called, else the state's, else the one given at
        construction. A state applies to its own epoch: there it goes on from its position, and a
        state from the end of that epoch yields nothing more (a StatefulDataLoader restored as
        finished then begins a new iteration, which reads set_epoch's epoch). To another epoch a
        state that holds nothing of its own epoch (taken at its end, e.g. inside the loop right
        after the last batch, or before it began) is no state: that epoch from its start. A state
        from the middle of another epoch is refused when the first item is asked for (the rest of
        its epoch would be lost); the refusal waits because a loader with workers may restore its
        workers' last states, which need not say they had finished, and then discard that
        iteration as finished without taking from it. `apply`: the iteration begins; without
        set_epoch, the state's epoch then stays the dataset's (in shared memory, for every
        DataLoader worker and the main process).
        """
        epoch, explicit = int(self._shared[0]), bool(self._shared[1])
        if state is None:
            return _Plan(epoch)
        saved, finished, resume = int(state["epoch"]), bool(state.get("finished")), state.get("resume")
        if not explicit:
            if apply:
                self._shared[0] = saved
            epoch = saved
        elif saved != epoch:
            if finished or resume is None:
                return _Plan(epoch, after=True)
            return _Plan(
                epoch,
                refusal=(
                    f"the loaded state is in the middle of epoch {saved}, but set_epoch({epoch}) was called: "
                    f"call set_epoch({saved}) to finish epoch {saved} from where the state is, or load no state "
                    f"to read epoch {epoch} from its start"
                ),
                after=True,
            )
        # the state's own epoch: a finished one yields nothing more (this reader's part was all yielded)
        return _Plan(epoch, None if finished else resume, finished, after=False)

    # ---- the stateful protocol (torchdata.stateful_dataloader) --------------------------------
    def state_dict(self) -> Dict[str, Any]:
        if self._stream is not None:
            return self._stream.state_dict()
        if self._loaded is not None:
            return self._loaded
        return {"epoch": self.epoch, "resume": None}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Start the next iteration where the state says (see `set_epoch` for which epoch applies)."""
        if not isinstance(state, dict) or not isinstance(state.get("epoch"), int):
            raise UsageError(f"state must be a dict from ServerDataset.state_dict(), got {state!r:.100}")
        self._loaded = state
        self._stream = None

    def __len__(self) -> int:
        """Seqs this rank gets in an epoch, so that `len(DataLoader(ds, batch_size=None))` works
        (an LR schedule, a progress bar); the server is asked once. TypeError (as for any iterable
        without a length) when it is not known in advance: with batches (their number depends on
        the epoch's order; `len()` of the iterator of an epoch that has begun gives it), or when
        the server does not know the count of an epoch before reading it."""
        opts = self.client_options
        batches = TypeError(
            "len() of a ServerDataset that batches is not known before its epoch begins: the number of "
            "batches depends on the epoch's order of lengths"
        )
        if opts["batching"]:
            raise batches  # whatever the server says
        if self._num_seqs is None:
            with Client(self.address, timeout=opts["timeout"], keys=opts["keys"], direct=False) as client:
                info = client.info()
            if opts["batching"] is None and info.get("batching"):
                raise batches
            self._num_seqs = info["num_seqs"]
            if self._num_seqs is None:
                raise TypeError(
                    "len() of this ServerDataset is not known in advance: the server learns an epoch's number "
                    "of seqs only by reading it (a map_seq_stream mapper that may change the count, or "
                    "partition_epoch)"
                )
        n, rank, world = self._num_seqs, self.rank, self.world_size
        return n // world if self.client_options["drop_last"] else max(0, -(-(n - rank) // world))

    # ---- iteration -----------------------------------------------------------------------
    def _client_for(self, part: int, parts: int) -> Client:
        key = (os.getpid(), part, parts, self.rank, self.world_size)
        if self._client is None or self._client_key != key:  # a client made in another process is not ours
            self.close()  # one of ours for another rank or part: its keepalives would hold its old place in the job
            self._client = Client(
                self.address,
                rank=self.rank,
                world_size=self.world_size,
                job=self.job,
                subshard=(part, parts),
                **self.client_options,
            )
            self._client_key = key
            # A DataLoader worker may end without closing what it read (an iteration the loader
            # discards unread, a loop left early): its client then closes as the process exits,
            # instead of holding its place in the job until its timeout of silence.
            self._closer = mp_util.Finalize(self._client, self._client.close, exitpriority=0)
            if get_worker_info() is not None:
                _exit_on_sigterm()
        return self._client

    def __iter__(self) -> _Stream:
        info = get_worker_info()
        part, parts = (info.id, info.num_workers) if info is not None else (0, 1)
        state, self._loaded = self._loaded, None
        self._stream = _Stream(self, part, parts, state)
        return self._stream

    def close(self) -> None:
        if self._closer is not None and self._client_key is not None and self._client_key[0] == os.getpid():
            self._closer()  # (once: Client.close, and no longer at exit)
        self._client = self._closer = None

    def __getstate__(self) -> Dict[str, Any]:  # DataLoader workers get the settings, not the sockets
        state = dict(self.__dict__)
        state.update(_client=None, _client_key=None, _closer=None, _stream=None)
        return state


class _Stream(Iterator[Any]):
    """One iteration of a ServerDataset. Opens its epoch lazily, so a loaded state applies first.

    Its state is the iterator's (`EpochIterator.state_dict`: the position in this reader's part
    of the shard, in seqs or batches), so a resumed loader yields exactly what the interrupted
    one would have yielded next: the server's cut is the same every time."""

    def __init__(self, ds: ServerDataset, worker: int, workers: int, state: Optional[Dict[str, Any]]):
        self.ds = ds
        self.worker, self.parts = worker, workers
        # pinned memory survives only in the process that uses the tensors: the main one
        self.pin = ds.pin_memory and workers == 1 and get_worker_info() is None
        if ds.pin_memory and not self.pin:
            _warn_once(
                "pin in a worker",
                "ServerDataset(pin_memory=True) pins nothing in a DataLoader worker (the batches are copied to "
                "the main process, unpinned): pass pin_memory=True to the DataLoader, which pins in the main process",
            )
        self.error: Optional[Error] = None  # what ended the iteration, raised again by every later next()
        self.load_state_dict(state)

    def __len__(self) -> int:
        """What this iteration yields in all (seqs or batches), once its epoch has begun."""
        return len(self.it if self.it is not None else self._open())

    def state_dict(self) -> Dict[str, Any]:
        it = self.it
        if self.finished or (it is not None and it.num_seqs is not None and it.position >= it.start + it.num_seqs):
            # (all yielded, the end perhaps not asked for yet): how many, by which part, for _Turns
            end = {"position": it.position, "subshard": [self.part, self.parts]} if it is not None else self.ended
            return {"epoch": self.epoch, "resume": None, "finished": True, **end}
        if it is None:
            return {"epoch": self.epoch, "resume": self.resume}
        return {"epoch": self.epoch, "resume": it.state_dict()}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        plan = self.ds._plan(state)
        self.epoch, self.resume, self.finished, self.refusal = plan.epoch, plan.resume, plan.finished, plan.refusal
        self.after = plan.after
        self.it: Optional[EpochIterator] = None
        self.part: Optional[int] = None  # the part of the rank's shard it reads, once it opens
        self.ended: Dict[str, Any] = {}
        if state is not None:
            self.ended = {k: state[k] for k in ("position", "subshard") if k in state} if plan.finished else {}
            self.ds._turns.note(self.worker, self.parts, state)

    def _reader(self) -> int:
        """The part of the rank's shard this stream reads: its worker's, but for a state's (a resume),
        or one turned as the restored loader takes its workers' turns (_Turns)."""
        if self.resume is not None:
            saved = list(self.resume.get("subshard", [0, 1]))
            if saved[1] != self.parts:
                raise UsageError(
                    f"the state was saved by reader {saved[0]} of {saved[1]} of the rank (DataLoader num_workers "
                    f"{saved[1]}); this is reader {self.worker} of {self.parts}: resume with the same num_workers"
                )
            return int(saved[0])
        if self.after is None or self.parts == 1:
            return self.worker  # (an iteration without a state: the loader begins with worker 0)
        shift = self.ds._turns.shift(self.parts, self.after)
        if shift is None:
            raise UsageError(
                f"which of the loader's {self.parts} workers has the first turn of epoch {self.epoch} is not known "
                "(the loaded state does not say how many items they had yielded, or they did not all load it before "
                f"the first item was asked for, or there are more than {MAX_TURNS}): call set_epoch with the state's "
                "epoch to finish it, then go on with the next"
            )
        return (self.worker - shift) % self.parts

    def _open(self) -> EpochIterator:
        self.part = self._reader()
        client = self.ds._client_for(self.part, self.parts)
        if self.resume is not None:
            self.it = client.epoch(state=self.resume)
        else:
            self.it = client.epoch(self.epoch)
        return self.it

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        if self.refusal is not None:
            raise UsageError(self.refusal)
        if self.finished:
            raise StopIteration
        if self.error is not None:
            raise self.error
        try:
            item = to_tensors(next(self.it if self.it is not None else self._open()))
        except StopIteration:
            self.finished = True
            self.ds.close()
            raise
        except Error as exc:  # the iteration is over: the client goes (its keepalives would hold the job)
            self.error = exc
            self.ds.close()
            raise
        return pinned(item) if self.pin else item


def _exit_on_sigterm() -> None:
    """In a DataLoader worker, SIGTERM closes the process's clients before it ends, so that the
    server frees their places in the job at once. The loader terminates a worker still waiting
    for the server when it shuts down (a loop left early, a training that exits mid-epoch), as a
    scheduler does; killed outright, a client would hold the job (against another world_size,
    another job) until its timeout of silence."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
        signal.SIG_DFL,
        None,
    ):
        signal.signal(signal.SIGTERM, _close_and_exit)


def _close_and_exit(signum: int, frame: Any) -> None:
    # Python runs this between bytecodes (after a blocking zmq call returned: no socket is mid-call).
    # Then exit 0, as PyTorch's own handler ends a worker that its loader terminates.
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM kills at once
    _close_open()  # every client of this process (a loader worker: this dataset's)
    os._exit(0)


def _can_pin() -> bool:
    accelerator = getattr(torch, "accelerator", None)  # torch 2.6 and later
    return bool(accelerator.is_available()) if accelerator is not None else torch.cuda.is_available()


_warned: Set[str] = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning(message)


def pinned(seq: Dict[str, Any]) -> Dict[str, Any]:
    """The tensors of a seq or batch in pinned memory (where an accelerator exists). Pin in the
    process that moves them to the device: memory pinned in a DataLoader worker is copied into
    ordinary shared memory on its way to the main process."""
    if not _can_pin():
        _warn_once("no accelerator", "pin_memory=True but no accelerator is available: nothing is pinned")
        return seq
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in seq.items()}
