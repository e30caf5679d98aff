"""RETURNN: a ppserver epoch as a RETURNN dataset (``pip install ./client[returnn]``).

In a RETURNN config (the PyTorch backend), a PostprocessingDataset dict with its class
changed, served by a local server that starts for it and stops with the trainer::

    from ppclient.returnn import ServerDataset

    train = {"class": ServerDataset, "dataset": {...}, "map_seq": my_mapper, "num_workers": 4}

or reading from a running server (which may serve this very dict, see `ppserver serve
--returnn-config`)::

    train = {"class": ServerDataset, "address": "tcp://trainer:5555", "job": "asr"}

RETURNN resolves a class given by name only among its own modules, so the config imports
the class and passes the object. RETURNN's epoch n is the server's epoch n; the
server's dataset decides which seqs an epoch holds and in which order, so `partition_epoch`
is refused and `seq_ordering` has no effect.

RETURNN's shards (`torch_distributed` with ``"dataset_distribution": "shard"``) become ranks
of one job. The DataLoader workers RETURNN shards (``torch_dataloader_opts = {"num_workers": k}``:
shard rank * k + w of n * k) are the readers of their rank, as with ppclient.torch. Where the
server serves them, each reader gets RETURNN's own shard (`sharding` "contiguous": a contiguous
chunk of the epoch's order); else shard k of n reads the positions i with i % n == k (strided),
and worker w every k-th seq of its rank's shard from its w-th on. `drop_last` (the default) gives
every rank num_seqs // n seqs. Without "shard", every rank would read as the one shard of its
job and take it from the others.

The client connects in the process that reads (a DataLoader worker), when an epoch starts.
The data keys come from one info request when RETURNN initializes the dataset (its
num_outputs must be known then) and travel with the dataset when it is pickled; the
connection never does.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import numpy
from returnn.datasets.basic import DatasetSeq
from returnn.datasets.cached2 import CachedDataset2
from returnn.util.basic import OptionalNotImplementedError

from . import endpoints
from .arguments import sharding_arg
from .client import Client, EpochIterator
from .errors import Error, UsageError
from .wire import META_KEYS

__all__ = ["ServerDataset", "config_entry", "returnn_dtype"]

# A PostprocessingDataset's own keys: the local server's settings (read from the config file by the
# server), never needed by a copy of the dataset, which gets the server's address.
SERVER_KEYS = (
    "dataset",
    "map_seq",
    "map_seq_stream",
    "map_outputs",
    "map_seq_stream_preserves_num_seqs",
    "num_workers",
    "buf_size",
    "server_settings",
)

STRING = "string"  # the template dtype of str arrays, RETURNN's name for them too


def returnn_dtype(template: Dict[str, Any]) -> str:
    """RETURNN's dtype name for a template: numpy's name, "string" for str arrays."""
    if template["dtype"] == STRING:
        return STRING
    dtype = numpy.dtype(template["dtype"])
    return STRING if dtype.kind == "U" else dtype.name


def num_outputs_entry(template: Dict[str, Any]) -> Tuple[int, int]:
    """(dim, ndim) as RETURNN's num_outputs holds them: the sparse dim, else the last feature
    dim (1 if there is none or it varies), and the ndim including time."""
    shape = template["shape"]
    if template.get("sparse_dim") is not None:
        return int(template["sparse_dim"]), len(shape)
    last = shape[-1] if len(shape) > 1 else None
    return (1 if last is None else int(last)), len(shape)


def config_entry(config: Mapping[str, Any], name: str) -> Dict[str, Any]:
    """The dict RETURNN builds its dataset `name` from: the config's entry of that name (train, dev,
    eval, ...) or eval_datasets[name]; a function there is called, as RETURNN does. KeyError if none."""
    value = config.get(name)
    evals = config.get("eval_datasets")
    if value is None and isinstance(evals, dict):
        value = evals.get(name)
    if callable(value) and not isinstance(value, dict):
        value = value()
    if not isinstance(value, dict):
        names = [k for k in ("train", "dev", "eval") if isinstance(config.get(k), dict)]
        names += [k for k in evals or {} if isinstance(evals, dict)]
        raise KeyError(
            f"the RETURNN config has no dataset dict {name!r} (it has {', '.join(map(repr, names)) or 'none'}; "
            "names are train, dev, eval and the keys of eval_datasets)"
        )
    return value


class ServerDataset(CachedDataset2):
    """This process's shard of each epoch of the ppserver at `address`, in the server's order.

    Without `address`, the keys of a PostprocessingDataset (`dataset`, `map_seq` or
    `map_seq_stream`, `map_outputs`, `map_seq_stream_preserves_num_seqs`, `num_workers`,
    `buf_size`) are served by a local ppserver started for this dataset of the RETURNN config
    (which the server loads too, for the same functions) and stopped with the trainer;
    `server_settings` adds other ppserver settings (e.g. ``{"worker_threads": 2}``). With
    `address` those keys are for `ppserver serve --returnn-config` and not used here, but where
    ppserver is installed they tell what the server should serve: its config fingerprint must be
    the one of this dict in this process's RETURNN config file, or the first request is an Error
    naming both (a daemon still serving the config as it was before an edit).

    `timeout`, `keys`, `drop_last` and `direct` are the Client's; `prefetch` is its `window` (the seqs
    the server may send ahead; RETURNN's Dataset already has an argument named `window`).
    `sharding` is the Client's too; None (the default): RETURNN's contiguous shards where the server
    serves them (map_seq, a dataset that reads any position), else strided ones: RETURNN batches
    the seqs a reader gets, and a strided reader's run of seqs spans `readers` times the lengths
    of a contiguous one in a length-sorted order (bench/RESULTS.md, "RETURNN sharding").
    Any other argument is RETURNN's (name, _num_shards, ...). Errors of the server (a
    ppclient.Error) reach the trainer as they are.
    """

    _getnewargs_exclude_attrs = CachedDataset2._getnewargs_exclude_attrs.union(SERVER_KEYS)

    def __init__(
        self,
        address: Optional[str] = None,
        *,
        job: str = "returnn",
        timeout: float = 30.0,
        prefetch: int = 32,
        keys: Optional[str] = None,
        drop_last: bool = True,
        direct: Union[bool, str] = True,
        sharding: Optional[str] = None,
        dataset: Optional[Dict[str, Any]] = None,
        map_seq: Optional[Callable] = None,
        map_seq_stream: Optional[Callable] = None,
        map_outputs: Optional[Dict[str, Any]] = None,
        map_seq_stream_preserves_num_seqs: Optional[bool] = None,
        num_workers: int = 0,
        buf_size: int = 1,
        server_settings: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ):
        if kwargs.get("partition_epoch") not in (None, 1):
            raise UsageError(
                f"partition_epoch={kwargs['partition_epoch']!r}: the server's dataset decides what an epoch is; "
                "split it there (or ask for shorter epochs) instead"
            )
        super().__init__(**kwargs)
        self._expect: Optional[Tuple[str, str]] = None  # (name, config fingerprint) the server must serve
        if address is None:
            if dataset is None:
                raise UsageError(
                    f"{self}: give 'address' (a running server) or the keys of a PostprocessingDataset "
                    "('dataset', 'map_seq' or 'map_seq_stream', ...) for a local server"
                )
            address = self._local_server(dataset, job)
        elif dataset is not None:
            self._expect = self._fingerprint_of(dataset)
        endpoints.check(address, "address")  # a bad address fails at config time, before any socket
        # Every argument is kept as `_<name>`: RETURNN's Dataset.__reduce__ builds the copy from them.
        self._address = address
        self._job = job
        self._timeout = timeout
        self._prefetch = prefetch
        self._keys = keys
        self._drop_last = drop_last
        self._direct = direct
        self._sharding = None if sharding is None else sharding_arg(sharding)
        self._info: Optional[Dict[str, Any]] = None  # {"templates": ..., "num_seqs": ...}: plain, picklable
        self._client: Optional[Client] = None
        self._client_key: Optional[Tuple[int, int, int]] = None  # (pid, shard, shards) it was made for
        self._iter: Optional[EpochIterator] = None
        self._next_idx = 0  # the RETURNN seq_idx of the next seq the iterator yields

    def _local_server(self, dataset: Dict[str, Any], job: str) -> str:
        """Start (or join) the local server of this dataset of the trainer's RETURNN config."""
        from returnn.config import get_global_config
        from returnn.log import log as returnn_log

        from .local_server import local_address

        config = get_global_config(raise_exception=False)
        files = list(getattr(config, "files", None) or [])
        if config is None or len(files) != 1:
            raise UsageError(
                f"{self}: without 'address' a local ppserver loads the trainer's RETURNN config file, but this "
                f"process has {'no RETURNN config' if config is None else f'{len(files)} config files'}; "
                "give 'address' of a running server"
            )
        name = self._name_in(config.typed_dict, dataset)

        def say(text: str) -> None:
            print(f"{self}: {text}", file=getattr(returnn_log, "v3", None) or sys.stderr)

        # several shards in this process's training (torch_distributed): its ranks share one server
        return local_address(files[0], returnn_dataset=name, job=job, shared=self._num_shards > 1, say=say)

    def _fingerprint_of(self, dataset: Dict[str, Any]) -> Optional[Tuple[str, str]]:
        """(name, config fingerprint) of this dataset's dict in this process's RETURNN config, as
        `ppserver serve --returnn-config FILE --dataset NAME` computes it; None where this process
        cannot tell (ppserver not installed, no single config file, the dict not found in it)."""
        try:
            from returnn.config import get_global_config

            from ppserver.config.returnn import loaded_returnn_config
            from ppserver.config.settings import read_source
            from ppserver.errors import ConfigError
        except ImportError:
            return None
        config = get_global_config(raise_exception=False)
        files = list(getattr(config, "files", None) or [])
        if config is None or len(files) != 1:
            return None
        try:
            name = self._name_in(config.typed_dict, dataset)
            path = files[0]
            return name, loaded_returnn_config(path, read_source(path, "config"), config, name).fingerprint
        except (UsageError, ConfigError):
            return None

    def _name_in(self, config: Dict[str, Any], dataset: Dict[str, Any]) -> str:
        """The name the server finds this dataset's dict under: RETURNN's name for it, else any whose
        inner dataset is this one."""
        names = [self.name] + [k for k in ("train", "dev", "eval") if k != self.name]
        evals = config.get("eval_datasets")
        names += [k for k in evals or {} if isinstance(evals, dict) and k not in names]
        for name in names:
            try:
                entry = config_entry(config, name)
            except Exception:  # not a dataset dict, or a function that fails: not this one
                continue
            if entry.get("dataset") is dataset or entry.get("dataset") == dataset:
                return name
        raise UsageError(
            f"{self}: without 'address' a local ppserver serves this dataset from the RETURNN config file, but "
            "its dict is none of the config's train, dev, eval or eval_datasets; give 'address' of a running server"
        )

    def __reduce__(self) -> Any:  # the copy gets the settings and the data keys, not the connection
        func, (cls, kwargs, state) = super().__reduce__()
        state = dict(
            state, _info=self._info, num_outputs=self.num_outputs, num_inputs=self.num_inputs, labels=self.labels
        )
        return func, (cls, kwargs, state)

    # ---- the connection ----------------------------------------------------------------------
    def _new_client(
        self, rank: int, world_size: int, subshard: Tuple[int, int] = (0, 1), sharding: str = "strided"
    ) -> Client:
        return Client(
            self._address,
            rank=rank,
            world_size=world_size,
            subshard=subshard,
            job=self._job,
            timeout=self._timeout,
            window=self._prefetch,
            keys=self._keys,
            drop_last=self._drop_last,
            direct=self._direct,
            batching=False,  # RETURNN batches by itself: one seq at a time
            sharding=sharding,
        )

    def _client_for_shard(self) -> Client:
        key = (os.getpid(), self._shard_index, self._num_shards)
        if self._client is None or self._client_key != key:
            self._close_client()
            self._client = self._new_client(*self._reader(), sharding=self._sharding_used())
            self._client_key = key
        return self._client

    def _reader(self) -> Tuple[int, int, Tuple[int, int]]:
        """(rank, world_size, subshard) this copy reads as: its shard as a rank, but in a DataLoader
        worker RETURNN sharded (shard rank * k + w of world_size * k, in worker w of k) the rank's
        reader w of k, so that the job is what it is: its ranks, each with k readers."""
        shard, shards = self._shard_index, self._num_shards
        data = sys.modules.get("torch.utils.data")  # (imported by RETURNN's loader where it runs)
        info = data.get_worker_info() if data is not None else None
        k = info.num_workers if info is not None else 1
        if info is not None and k > 1 and shards % k == 0 and shard % k == info.id:
            return shard // k, shards // k, (info.id, k)
        return shard, shards, (0, 1)

    def _sharding_used(self) -> str:
        """The one asked for, else contiguous (RETURNN's) where the server serves it."""
        if self._sharding is not None:
            return self._sharding
        return "contiguous" if "contiguous" in self._describe()["shardings"] else "strided"

    def _close_client(self) -> None:
        client, key = getattr(self, "_client", None), getattr(self, "_client_key", None)
        self._client = self._client_key = self._iter = None
        if client is not None and key is not None and key[0] == os.getpid():  # a forked parent's is not ours
            client.close()

    def _describe(self) -> Dict[str, Any]:
        """The server's data keys and seq count, asked for once (in the first process that needs them)."""
        if self._info is None:
            if self._client is not None and self._client_key is not None and self._client_key[0] == os.getpid():
                info = self._client.info()
            else:
                with self._new_client(0, 1) as client:
                    info = client.info()
            self._check_serves(info)
            templates = {k: v for k, v in info["data_keys"].items() if k not in META_KEYS}
            shardings = list(info.get("shardings") or ["strided"])  # (an older server's: strided)
            self._info = {"templates": templates, "num_seqs": info.get("num_seqs"), "shardings": shardings}
            self.num_outputs = {k: num_outputs_entry(t) for k, t in templates.items()}
            self.num_inputs = self.num_outputs["data"][0] if "data" in self.num_outputs else 0
            self.labels = {k: [str(s) for s in t["labels"]] for k, t in templates.items() if t.get("labels")}
        return self._info

    def _check_serves(self, info: Dict[str, Any]) -> None:
        """The server at the address must serve this dataset's dict as this process's config has it."""
        expect = self._expect
        if expect is not None and info.get("config_fingerprint") != expect[1]:
            raise Error(
                f"{self}: the server at {self._address} serves another config than this trainer's {expect[0]!r} "
                f"dict: its config fingerprint is {info.get('config_fingerprint')!r}, this dict's is {expect[1]!r} "
                "(the RETURNN config file, the local modules it uses or what the dict holds differ: restart the "
                "server with this config)"
            )

    def _template(self, key: str) -> Dict[str, Any]:
        templates = self._describe()["templates"]
        if key not in templates:
            raise KeyError(f"{self}: the server has no data key {key!r} (it has {', '.join(templates)})")
        return templates[key]

    # ---- what RETURNN asks before it reads ---------------------------------------------------
    def initialize(self) -> None:
        self._describe()  # RETURNN checks num_outputs here (and prints them)
        super().initialize()

    def get_data_keys(self) -> List[str]:
        return list(self._describe()["templates"])

    def get_target_list(self) -> List[str]:
        return [k for k in self.get_data_keys() if k != "data"]

    def get_data_dtype(self, key: str) -> str:
        return returnn_dtype(self._template(key))

    def is_data_sparse(self, key: str) -> bool:
        return self._template(key).get("sparse_dim") is not None

    def get_data_dim(self, key: str) -> int:
        return num_outputs_entry(self._template(key))[0]

    def get_data_shape(self, key: str) -> List[Optional[int]]:
        return list(self._template(key)["shape"][1:])  # without the time axis; None where it varies

    def supports_sharding(self) -> bool:
        return True  # the server cuts the shards

    def get_all_tags(self) -> List[str]:
        raise OptionalNotImplementedError(f"{self}: the server does not list its seq tags")

    def get_total_num_seqs(self, *, fast: bool = False) -> int:
        num_seqs = self._describe()["num_seqs"]
        if num_seqs is None:
            raise OptionalNotImplementedError(
                f"{self}: the server does not tell the size of its corpus (its epochs may be parts of the corpus, "
                "as with partition_epoch, its map_seq_stream may change the count, or its dataset learns the count "
                "only by reading)"
            )
        return int(num_seqs)

    # ---- reading -----------------------------------------------------------------------------
    def init_seq_order(
        self, epoch: Optional[int] = None, seq_list: Optional[List[str]] = None, seq_order: Optional[List[int]] = None
    ) -> bool:
        super().init_seq_order(epoch=epoch, seq_list=seq_list, seq_order=seq_order)
        self._iter = None
        self._next_idx = 0
        if epoch is None:  # RETURNN's initialize(): no epoch yet, so nothing to ask the server
            if seq_list is not None or seq_order is not None:
                raise UsageError(f"{self}: a seq_list or seq_order needs an epoch")
            return True
        client = self._client_for_shard()
        self._describe()
        self._iter = client.epoch(epoch, seq_list=seq_list, seq_order=seq_order)
        self._num_seqs = self._iter.num_seqs  # None: learnt at the end, as CachedDataset2 does
        return True

    def is_less_than_num_seqs(self, n: int) -> bool:
        # Seqs are read up to n first, so that an epoch found empty ends cleanly, and one whose
        # seqs the server's mapper skipped ends where they run out: its num_seqs (the positions
        # the server counts) becomes what came.
        if self._iter is not None and n >= self.expected_load_seq_start:
            self._load_seqs(self.expected_load_seq_start, n + 1)
        return super().is_less_than_num_seqs(n)

    def _collect_single_seq(self, seq_idx: int) -> Optional[DatasetSeq]:
        it = self._iter
        if it is None:
            return None
        if seq_idx < self._next_idx:
            raise UsageError(f"{self}: seq {seq_idx} was read already; the server sends an epoch once, in order")
        seq = None
        while self._next_idx <= seq_idx:  # seqs RETURNN skips are read and dropped
            seq = next(it, None)
            if seq is None:
                self._iter = None
                self._num_seqs = self._next_idx
                self.reached_final_seq = True
                return None
            self._next_idx += 1
        assert seq is not None
        features = {k: seq[k] for k in self._describe()["templates"]}
        return DatasetSeq(seq_idx, features, seq_tag=seq["seq_tag"], complete_frac=seq.get("complete_frac"))

    def finish_epoch(self, *, free_resources: bool = False) -> None:
        super().finish_epoch(free_resources=free_resources)
        self._iter = None
        if free_resources:
            self._close_client()

    def __del__(self) -> None:
        try:
            self._close_client()
        except Exception:  # at interpreter exit, or after a failed __init__
            pass
