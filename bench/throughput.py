#!/usr/bin/env python3
"""Throughput of ppserver against an in-process loop, RETURNN's PostprocessingDataset and PyTorch's DataLoader.

Cases a, b, c deliver one seq at a time, each through three pipelines on the same machine and
the same arrays:

  ppserver    `python -m ppserver serve CONFIG --workers N`, consumed through ppclient
  in-process  the same arrays (NumpyDataset) and the same map_seq, applied in a plain loop
              with ppserver.mappers.apply.apply_map_seq (what a worker does, minus the transport)
  RETURNN     returnn.datasets.postprocessing.PostprocessingDataset over a StaticDataset of
              the same arrays, num_workers=N, buf_size=10 (skipped if returnn does not import)

Cases d, e, f deliver batches (the server cuts each epoch, its workers map and pad):

  ppserver    the same server, `ppclient.Client(addr, batching={...})`, batches as numpy arrays
  pp-torch    another such server read through `ppclient.torch.ServerDataset` and
              `DataLoader(batch_size=None)` in the main process (tensors)
  DataLoader  torch.utils.data.DataLoader over a map-style Dataset of the same arrays whose
              __getitem__ applies the same mapper, num_workers=N, persistent_workers=True,
              prefetch_factor=10, collating in its workers: default_collate stacks (d, e), or a
              batch_sampler yielding ppserver's own cut and a collate_fn that pads (f)

Per case, every pipeline is started and runs one warm-up epoch (process start, worker
registration); then the timed epochs 2, 3, ... run round-robin over the pipelines, one
epoch at a time and never two at once, so a slow drift in machine load hits all of them
alike. seqs/s and MB/s (bytes of the arrays handed to the consumer, meta entries
excluded) are totals over the timed epochs.

Usage:  python3 bench/throughput.py [--quick] [--cases a,b,c,d,e,f] [--epochs N] [--json PATH|-]
See bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import numpy as np

from ppclient.collate import LENGTHS  # a padded key's lengths in a batch: key + LENGTHS
from ppclient.wire import META_KEYS as META

# Module level on purpose: RETURNN's workers are spawned processes that import this file
# again (as __mp_main__) and unpickle the mapper functions below by name. Everything that
# does real work is behind `if __name__ == "__main__"`.

BURN_SECONDS = 0.002  # CPU time (of the calling thread) case (c) burns per seq
BUF_SIZE = 10  # ppserver's buf_size (tasks, i.e. seqs or batches, in flight per worker) and RETURNN's
PREFETCH = 10  # the DataLoader's prefetch_factor: batches in flight per worker, as buf_size
NCPU = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
OTHER_CPU_WARN = 0.10  # warn when other processes used more than this share of the machine
MIN_ACCOUNTED_SECONDS = 0.5  # shorter timings are too coarse for /proc's CPU ticks


def burn_cpu(seconds: float) -> None:
    """Busy loop until this thread has used `seconds` of CPU time (preemption does not count)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def returnn_double(tensor_dict, **kwargs):
    """RETURNN map_seq: data * 2 (dtype kept)."""
    t = tensor_dict.data["data"]
    x = t.raw_tensor
    t.raw_tensor = x * x.dtype.type(2)
    return tensor_dict


def returnn_burn_double(tensor_dict, **kwargs):
    """RETURNN map_seq for case (c): burn BURN_SECONDS of CPU, then data * 2."""
    burn_cpu(BURN_SECONDS)
    return returnn_double(tensor_dict, **kwargs)


class MappedArrays:
    """The DataLoader peer's map-style dataset: seq i of the arrays in memory, with the mapper
    applied in __getitem__ (so in the DataLoader's workers), as numpy arrays. Items carry the
    seq_tag and seq_idx the server gives the same seq, so a collated batch has what a ppserver
    batch has (bar complete_frac). Module level: a DataLoader with a spawning start method
    pickles it into its workers."""

    def __init__(self, arrays, tags, mapper):
        self.arrays = arrays
        self.tags = tags
        self.mapper = mapper

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, i: int):
        return self.mapper({"data": self.arrays[i], "seq_tag": self.tags[i], "seq_idx": i})


def pad_collate(items):
    """collate_fn of case (f)'s DataLoader: `data` zero-padded to the batch's longest seq,
    `data:lengths` (int64), `seq_tag` as a list, `seq_idx` as a tensor: the layout of a ppserver
    batch. In a DataLoader worker the padded tensor is allocated in shared memory, as
    default_collate allocates what it stacks, so it travels to the main process without a
    further copy; the rows are filled through a numpy view."""
    import torch
    from torch.utils.data import get_worker_info

    arrays = [it["data"] for it in items]
    lengths = [a.shape[0] for a in arrays]
    longest = max(lengths)
    shape = (len(arrays), longest, *arrays[0].shape[1:])
    first = torch.from_numpy(arrays[0])
    if get_worker_info() is not None:
        numel = 1
        for n in shape:
            numel *= n
        storage = first._typed_storage()._new_shared(numel, device=first.device)
        out = first.new(storage).resize_(shape)
    else:
        out = torch.empty(shape, dtype=first.dtype)
    view = out.numpy()
    for row, a, n in zip(view, arrays, lengths):
        row[:n] = a
        if n < longest:
            row[n:] = 0
    return {
        "data": out,
        "data" + LENGTHS: torch.tensor(lengths, dtype=torch.int64),
        "seq_tag": [it["seq_tag"] for it in items],
        "seq_idx": torch.tensor([it["seq_idx"] for it in items], dtype=torch.int64),
    }


# ppserver configs. The server and each worker execute the file; the in-process baseline
# loads it with ppserver.config.settings.load_config, so both run the very same map_seq.
CONFIG_DOUBLE = """\
from ppserver.mappers.builtin import double

dataset = {{"class": "NumpyDataset", "path": {path!r}}}
map_seq = double
buf_size = {buf_size}
num_workers = {workers}
seed = 0
"""

CONFIG_BURN = '''\
import time

from ppserver.mappers.builtin import double

BURN_SECONDS = {burn!r}


def map_seq(seq, **kwargs):
    """Burn BURN_SECONDS of this thread's CPU time, then multiply float arrays by 2."""
    end = time.thread_time() + BURN_SECONDS
    while time.thread_time() < end:
        pass
    return double(seq)


dataset = {{"class": "NumpyDataset", "path": {path!r}}}
buf_size = {buf_size}
num_workers = {workers}
seed = 0
'''


@dataclass
class Case:
    key: str
    title: str
    shape: Tuple[int, int]  # (frames, features) of every seq; with `frames`, the longest
    seqs_full: int
    seqs_quick: int
    burn: bool = False
    # batched cases: ppserver's batching (and the DataLoader peer's batch_size, or its cut)
    batching: Optional[Dict[str, Any]] = None
    frames: Optional[Tuple[int, int]] = None  # variable lengths: frames uniform in [lo, hi]

    @property
    def batched(self) -> bool:
        return self.batching is not None

    @property
    def seq_bytes(self) -> float:
        """Bytes of one seq's array (the mean, with variable lengths)."""
        if self.frames is not None:
            return (self.frames[0] + self.frames[1]) / 2 * self.shape[1] * 4
        return float(np.prod(self.shape)) * 4

    @property
    def pipelines(self) -> Tuple[str, ...]:
        return BATCH_PIPELINES if self.batched else PIPELINES


CASES: Dict[str, Case] = {
    "a": Case("a", "32 KB seqs (100x80 f32), x*2", (100, 80), 5000, 1000),
    "b": Case("b", "1.28 MB seqs (4000x80 f32), x*2", (4000, 80), 500, 100),
    "c": Case("c", "2 ms CPU/seq + x*2 (100x80 f32)", (100, 80), 1000, 200, burn=True),
    "d": Case("d", "32 KB seqs (128x64 f32), batches of 16, x*2", (128, 64), 10000, 2000, batching={"max_seqs": 16}),
    "e": Case("e", "1.28 MB seqs (4000x80 f32), batches of 4, x*2", (4000, 80), 1000, 200, batching={"max_seqs": 4}),
    "f": Case(
        "f",
        "50-400 x 80 f32, max_frames 8000, bucket_window 256, x*2",
        (400, 80),
        4000,
        1000,
        batching={"max_frames": 8000, "bucket_window": 256},
        frames=(50, 400),
    ),
}

PIPELINES = ("ppserver", "pp-via-server", "in-process", "RETURNN")
BATCH_PIPELINES = ("ppserver", "pp-torch", "DataLoader")
# pp-via-server: the same server with every result through the server's loop and no shared
# memory (direct_results = False, shm_mb = 0), the data path before direct results
VIA_SERVER = "direct_results = False\nshm_mb = 0\n"

TARGETS = [  # (case, measure, minimum ratio ppserver / RETURNN)
    ("a", "seqs/s", 6.0),
    ("b", "MB/s", 4.0),
]
BATCH_TARGETS = [  # (case, minimum ratio ppserver / DataLoader in seqs/s)
    ("d", 1.5),
    ("e", 3.0),
    ("f", 1.5),
]
CPU_TARGETS = [  # (case, process, maximum CPU microseconds per delivered seq)
    ("a", "server", 30.0),
    ("b", "server", 150.0),
    ("a", "client", 30.0),
    ("d", "server", 10.0),
    ("d", "client", 5.0),
]
ROLES = ("server", "workers", "client")


@dataclass
class Result:
    case: str
    pipeline: str
    seqs: int = 0  # delivered over the timed epochs
    batches: int = 0  # batched cases: batches delivered over the timed epochs
    nbytes: int = 0
    seconds: float = 0.0
    epoch_seconds: List[float] = field(default_factory=list)
    warmup_seconds: Optional[float] = None
    error: Optional[str] = None
    note: Optional[str] = None
    check: Optional[str] = None  # "ok", "MISMATCH: ..." or None (not checked)
    # CPU time used outside this benchmark's processes during the timed epochs (other
    # processes, hypervisor steal), in core-seconds; None where /proc cannot be read
    other_cpu: Optional[float] = 0.0
    # CPU seconds per role over the timed epochs: ppserver's server, workers and client; the
    # DataLoader's workers and main process (client)
    cpu: Dict[str, float] = field(default_factory=dict)

    def cpu_us(self, role: str) -> Optional[float]:
        """CPU microseconds per delivered seq of one role (server, workers together, client)."""
        if role not in self.cpu or not self.seqs:
            return None
        return self.cpu[role] / self.seqs * 1e6

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds > 0

    @property
    def seqs_per_s(self) -> Optional[float]:
        return self.seqs / self.seconds if self.ok else None

    @property
    def mb_per_s(self) -> Optional[float]:
        return self.nbytes / self.seconds / 1e6 if self.ok else None

    @property
    def batches_per_s(self) -> Optional[float]:
        return self.batches / self.seconds if self.ok and self.batches else None

    @property
    def other_cpu_frac(self) -> Optional[float]:
        """other_cpu as a share of the machine (cores x timed seconds)."""
        if self.other_cpu is None or self.seconds <= 0:
            return None
        return max(self.other_cpu, 0.0) / (self.seconds * NCPU)

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text

    def as_json(self) -> Dict[str, Any]:
        return {
            "case": self.case,
            "pipeline": self.pipeline,
            "seqs": self.seqs,
            "batches": self.batches or None,
            "bytes": self.nbytes,
            "seconds": round(self.seconds, 6),
            "epoch_seconds": [round(s, 6) for s in self.epoch_seconds],
            "warmup_seconds": None if self.warmup_seconds is None else round(self.warmup_seconds, 6),
            "seqs_per_s": self.seqs_per_s,
            "mb_per_s": self.mb_per_s,
            "batches_per_s": self.batches_per_s,
            "best_epoch_seqs_per_s": (
                self.seqs / len(self.epoch_seconds) / min(self.epoch_seconds) if self.ok else None
            ),
            "other_cpu_core_seconds": None if self.other_cpu is None else round(self.other_cpu, 3),
            "other_cpu_fraction": self.other_cpu_frac,
            "cpu_us_per_seq": {role: self.cpu_us(role) for role in ROLES if role in self.cpu},
            "error": self.error,
            "note": self.note,
            "check": self.check,
        }


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def array_bytes(seq: Dict[str, Any]) -> int:
    return sum(v.nbytes for v in seq.values() if isinstance(v, np.ndarray))


class Tally(NamedTuple):
    """One epoch as the consumer got it."""

    seqs: int
    nbytes: int  # array bytes (meta entries and lengths excluded)
    first: Optional[Dict[str, Any]]  # the first and last seq (or batch)
    last: Optional[Dict[str, Any]]
    batches: int = 0  # batched cases: batches delivered
    cut: Optional[List[Tuple[Tuple[str, ...], Tuple[int, ...]]]] = None  # batched: (seq tags, data shape) of each


def tally(seqs) -> Tally:
    """Consume an epoch of seqs: (seqs, array bytes, first seq, last seq), as every pipeline reports it."""
    n = nbytes = 0
    first = last = None
    for last in seqs:
        nbytes += array_bytes(last)
        n += 1
        if first is None:
            first = last
    return Tally(n, nbytes, first, last)


def batch_bytes(batch: Dict[str, Any]) -> int:
    """Bytes of a batch's padded arrays (numpy arrays or tensors; meta entries and lengths excluded)."""
    return sum(
        int(v.nbytes) for k, v in batch.items() if k not in META and not k.endswith(LENGTHS) and hasattr(v, "nbytes")
    )


def tally_batches(batches) -> Tally:
    """Consume an epoch of batches: seqs counted by their tags, and each batch's tags and shape kept
    for the check that every pipeline got the same cut."""
    n = nbytes = 0
    first = last = None
    cut = []
    for last in batches:
        tags = last["seq_tag"]
        n += len(tags)
        nbytes += batch_bytes(last)
        cut.append((tuple(tags), tuple(last["data"].shape)))
        if first is None:
            first = last
    return Tally(n, nbytes, first, last, len(cut), cut)


# ---- CPU accounting: is anything else running on the machine? ----------------------------


def _stat_fields(pid: str) -> Optional[List[str]]:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return None


def own_cpu_seconds() -> float:
    """CPU time of this process and its live descendants, including their reaped children."""
    parent: Dict[str, str] = {}
    cpu: Dict[str, int] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            f = _stat_fields(pid)
            if f is not None:
                parent[pid] = f[1]
                cpu[pid] = int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])  # utime stime cutime cstime
    children: Dict[str, List[str]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [str(os.getpid())]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0)
        todo.extend(children.get(pid, ()))
    return total / os.sysconf("SC_CLK_TCK")


def machine_cpu_seconds() -> float:
    """Busy plus stolen CPU time of the whole machine, summed over its cores."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


def cpu_sample() -> Optional[Tuple[float, float]]:
    try:
        return machine_cpu_seconds(), own_cpu_seconds()
    except (OSError, ValueError, IndexError):
        return None


# ---- pipelines --------------------------------------------------------------------------
#
# start() brings a pipeline up, epoch(e) delivers epoch e to the consumer and returns
# (seqs, array bytes, first seq, last seq), close() tears it down (idempotent).


class InProcess:
    name = "in-process"

    def __init__(self, config: str, seqs: List[Dict[str, np.ndarray]]):
        self.config = config
        self.seqs = seqs

    def start(self) -> None:
        from ppserver.config.mappers import output_templates
        from ppserver.config.settings import load_config
        from ppserver.datasets import NumpyDataset
        from ppserver.mappers.apply import apply_map_seq

        self.apply = apply_map_seq
        self.cfg = load_config(self.config)
        self.dataset = NumpyDataset(seqs=self.seqs)  # the arrays the server reads from the same npz
        self.templates = output_templates(self.cfg, self.dataset.data_keys())

    def epoch(self, epoch: int):
        ds, apply, map_seq, seed, templates = self.dataset, self.apply, self.cfg.map_seq, self.cfg.seed, self.templates
        ds.init_seq_order(epoch)
        return tally(
            apply(map_seq, ds.get_seq(pos), epoch=epoch, seed=seed, templates=templates) for pos in range(ds.num_seqs)
        )

    def close(self) -> Optional[str]:
        self.dataset = None
        return None


def _cpu_of(pid: int) -> float:
    """utime + stime of one process, in seconds (0 if it is gone)."""
    f = _stat_fields(str(pid))
    return 0.0 if f is None else (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> List[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            f = _stat_fields(p)
            if f is not None and f[1] == str(pid):
                out.append(int(p))
    return out


class PPServer:
    name = "ppserver"

    def __init__(
        self,
        config: str,
        workers: int,
        log_path: str,
        name: str = "ppserver",
        batching: Optional[Dict[str, Any]] = None,
    ):
        self.name = name
        self.config = config
        self.workers = workers
        self.log_path = log_path
        self.batching = batching  # None: one seq at a time; else asked for with every epoch
        self.proc: Optional[subprocess.Popen] = None
        self.client = None

    def serve(self) -> str:
        """Start the server; its address once it is ready."""
        from ppserver.cli import wait_ready

        argv = [
            sys.executable,
            "-m",
            "ppserver",
            "serve",
            self.config,
            "--bind",
            "tcp://127.0.0.1:0",
            "--workers",
            str(self.workers),
        ]
        with open(self.log_path, "w") as server_log:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=server_log, text=True)
        return wait_ready(self.proc, timeout=60)

    def start(self) -> None:
        from ppclient import Client

        address = self.serve()
        self.client = Client(address, timeout=60, batching=self.batching)  # None: the server's default

    def epoch(self, epoch: int) -> Tally:
        if self.batching is not None:
            return tally_batches(self.client.epoch(epoch))
        return tally(self.client.epoch(epoch))

    def cpu(self) -> Dict[str, float]:
        """CPU seconds so far of the server, its workers (together) and this process (the client)."""
        assert self.proc is not None
        t = os.times()
        return {
            "server": _cpu_of(self.proc.pid),
            "workers": sum(_cpu_of(pid) for pid in _children(self.proc.pid)),
            "client": t.user + t.system,
        }

    def close(self) -> Optional[str]:
        """Stop the server: SIGTERM, SIGKILL after 10 s, always reaped. Returns a note or None."""
        if self.client is not None:
            self.client.close()
            self.client = None
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log(f"  ppserver pid {proc.pid} ignored SIGTERM for 10 s; killing it")
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.returncode != 0:
            return f"ppserver serve exited with code {proc.returncode}"
        return None


class Returnn:
    name = "RETURNN"

    def __init__(self, burn: bool, seqs: List[Dict[str, np.ndarray]], workers: int):
        self.burn = burn
        self.seqs = seqs
        self.workers = workers
        self.ds = None
        self.procs: List[Any] = []

    def start(self) -> None:
        from returnn.datasets.postprocessing import PostprocessingDataset

        self.ds = PostprocessingDataset(
            dataset={"class": "StaticDataset", "data": self.seqs},
            map_seq=returnn_burn_double if self.burn else returnn_double,
            num_workers=self.workers,
            buf_size=BUF_SIZE,
        )
        self.ds.initialize()
        self.keys = self.ds.get_data_keys()

    def epoch(self, epoch: int):
        ds, keys = self.ds, self.keys
        ds.init_seq_order(epoch=epoch)  # the first call spawns the worker processes
        if not self.procs:
            self.procs = [wp.worker_proc for wp in (getattr(ds, "_worker_procs", None) or [])]

        def seqs():
            pos = 0
            while ds.is_less_than_num_seqs(pos):
                ds.load_seqs(pos, pos + 1)
                yield {k: ds.get_data(pos, k) for k in keys}
                pos += 1

        return tally(seqs())

    def close(self) -> Optional[str]:
        ds, self.ds = self.ds, None
        note = None
        if ds is not None:
            try:
                ds.finish_epoch(free_resources=True)  # stops the feeder thread, joins the workers
            except Exception as exc:
                note = f"finish_epoch failed: {type(exc).__name__}: {exc}"
        for p in self.procs:  # only if finish_epoch could not stop them
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.procs = []
        return note


class TorchServer(PPServer):
    """A ppserver read through ppclient.torch.ServerDataset, iterated in the main process by a
    `DataLoader(batch_size=None)` (num_workers=0): the batches as a PyTorch training loop gets them."""

    def __init__(self, config: str, workers: int, log_path: str, batching: Dict[str, Any]):
        super().__init__(config, workers, log_path, name="pp-torch", batching=batching)
        self.ds: Any = None
        self.loader: Any = None

    def start(self) -> None:
        from torch.utils.data import DataLoader

        from ppclient.torch import ServerDataset

        address = self.serve()
        b = self.batching or {}
        self.ds = ServerDataset(
            address,
            timeout=60,
            max_seqs=b.get("max_seqs"),
            batch_frames=b.get("max_frames"),
            bucket_window=b.get("bucket_window", 1),
        )
        self.loader = DataLoader(self.ds, batch_size=None)

    def epoch(self, epoch: int) -> Tally:
        self.ds.set_epoch(epoch)
        return tally_batches(self.loader)

    def close(self) -> Optional[str]:
        if self.ds is not None:
            self.ds.close()
        self.ds = self.loader = None
        return super().close()


class TorchLoader:
    """PyTorch's DataLoader over the same arrays in memory (MappedArrays: the mapper runs in its
    workers), persistent workers, PREFETCH batches in flight per worker, collating in the
    workers: default_collate stacks `batch_size` seqs (all of a length), or `batches` (lists of
    dataset indices: ppserver's cut of the epoch) are the batch_sampler and pad_collate pads."""

    name = "DataLoader"

    def __init__(
        self,
        seqs: List[Dict[str, np.ndarray]],
        tags: List[str],
        workers: int,
        batch_size: Optional[int] = None,
        batches: Optional[List[List[int]]] = None,
    ):
        self.seqs = seqs
        self.tags = tags
        self.workers = workers
        self.batch_size = batch_size
        self.batches = batches
        self.loader: Any = None

    def start(self) -> None:
        from torch.utils.data import DataLoader

        from ppserver.mappers.builtin import double

        ds = MappedArrays([s["data"] for s in self.seqs], self.tags, double)
        common: Dict[str, Any] = {"num_workers": self.workers, "persistent_workers": True, "prefetch_factor": PREFETCH}
        if self.batches is None:
            self.loader = DataLoader(ds, batch_size=self.batch_size, shuffle=False, **common)
        else:
            self.loader = DataLoader(ds, batch_sampler=self.batches, collate_fn=pad_collate, **common)

    def epoch(self, epoch: int) -> Tally:
        return tally_batches(self.loader)  # persistent workers: each iter() begins the next epoch

    def worker_pids(self) -> List[int]:
        it = getattr(self.loader, "_iterator", None)  # the persistent iterator, once the first epoch began
        return [w.pid for w in getattr(it, "_workers", None) or []]

    def cpu(self) -> Dict[str, float]:
        """CPU seconds so far of the DataLoader's workers (together) and this process (the client)."""
        t = os.times()
        return {"workers": sum(_cpu_of(pid) for pid in self.worker_pids()), "client": t.user + t.system}

    def close(self) -> Optional[str]:
        loader, self.loader = self.loader, None
        it = getattr(loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()  # what the iterator's __del__ does; here at a time of our choosing
        return None


def ppserver_version() -> str:
    """ppserver's version, plus the git commit of its source tree when there is one (read-only git calls)."""
    try:
        from importlib.metadata import version

        text = f"ppserver {version('ppserver')}"
    except Exception:
        text = "ppserver ?"
    import ppserver

    src = os.path.dirname(os.path.dirname(os.path.abspath(ppserver.__file__)))
    try:
        sha = subprocess.run(
            ["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", src, "status", "--porcelain", "--untracked-files=no", "--", "ppserver", "client"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if sha.returncode == 0:
            text += f" (git {sha.stdout.strip()}{', modified' if dirty.stdout.strip() else ''})"
    except (OSError, subprocess.SubprocessError):
        pass
    return text


def torch_version() -> Tuple[Optional[str], Optional[str]]:
    """(version, None) if torch's DataLoader and ppclient.torch import, else (None, reason)."""
    try:
        import torch
        from torch.utils.data import DataLoader  # noqa: F401

        from ppclient.torch import ServerDataset  # noqa: F401
    except Exception as exc:  # any import problem means: skip the DataLoader and pp-torch rows
        return None, f"{type(exc).__name__}: {exc}"
    return str(torch.__version__), None


def returnn_version() -> Tuple[Optional[str], Optional[str]]:
    """(version, None) if RETURNN's PostprocessingDataset imports, else (None, reason)."""
    try:
        import returnn
        from returnn.datasets.postprocessing import PostprocessingDataset  # noqa: F401
    except Exception as exc:  # any import problem means: skip the column
        return None, f"{type(exc).__name__}: {exc}"
    return str(getattr(returnn, "__version__", "?")), None


# ---- correctness ------------------------------------------------------------------------


def compare(got: Dict[str, Any], want: Dict[str, Any], *, meta: bool) -> Optional[str]:
    """None if equal, else what differs. Arrays by numpy.array_equal plus dtype and shape."""
    want_arrays = {k for k, v in want.items() if isinstance(v, np.ndarray)}
    got_arrays = {k for k, v in got.items() if isinstance(v, np.ndarray)}
    if want_arrays != got_arrays:
        return f"array keys {sorted(got_arrays)} != {sorted(want_arrays)}"
    for k in sorted(want_arrays):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            return f"{k!r} differs ({a.dtype}{a.shape} vs {b.dtype}{b.shape})"
    if meta:
        for k in ("seq_tag", "seq_idx", "complete_frac"):
            if got.get(k) != want.get(k):
                return f"{k} {got.get(k)!r} != {want.get(k)!r}"
    return None


def check(res: Result, got: Tuple[Any, Any], ref: Tuple[Any, Any], *, meta: bool) -> None:
    problems = []
    for which, g, w in (("first", got[0], ref[0]), ("last", got[1], ref[1])):
        diff = compare(g, w, meta=meta)
        if diff:
            problems.append(f"{which} seq: {diff}")
    res.check = "ok" if not problems else "MISMATCH: " + "; ".join(problems)


def as_numpy(value: Any) -> Any:
    return value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else value


def compare_batch(got: Dict[str, Any], want: Dict[str, Any], *, lengths: bool) -> Optional[str]:
    """None if a batch (numpy arrays or tensors) equals the reference batch: `data` (dtype, shape,
    values), `data:lengths` (where `lengths`: default_collate makes none), `seq_tag`, `seq_idx`."""
    for key in ("data", "data" + LENGTHS):
        if key not in got:
            if key.endswith(LENGTHS) and not lengths:
                continue
            return f"no {key!r}"
        a, b = as_numpy(got[key]), want[key]
        if not isinstance(a, np.ndarray) or a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
            return f"{key!r} differs ({getattr(a, 'dtype', type(a))}{getattr(a, 'shape', '')} vs {b.dtype}{b.shape})"
    if list(got.get("seq_tag") or []) != list(want["seq_tag"]):
        return f"seq_tag {list(got.get('seq_tag') or [])[:3]}... != {list(want['seq_tag'])[:3]}..."
    idx = as_numpy(got.get("seq_idx"))
    if idx is None or np.asarray(idx).tolist() != want["seq_idx"].tolist():
        return "seq_idx differs"
    return None


def check_batches(res: Result, got: Tally, first: Dict[str, Any], last: Dict[str, Any], cut: List[Any]) -> None:
    """The last timed epoch's cut (every batch's tags and shape) is the expected one, and its first
    and last batch equal the reference batches bit for bit."""
    problems = []
    if got.cut != cut:
        at = next((i for i, (g, w) in enumerate(zip(got.cut or [], cut)) if g != w), min(len(got.cut or []), len(cut)))
        problems.append(f"cut: {len(got.cut or [])} batches, expected {len(cut)}; first difference at batch {at}")
    for which, g, w in (("first", got.first, first), ("last", got.last, last)):
        diff = "missing" if g is None else compare_batch(g, w, lengths=res.pipeline != "DataLoader")
        if diff:
            problems.append(f"{which} batch: {diff}")
    res.check = "ok" if not problems else "MISMATCH: " + "; ".join(problems)


# ---- one case ---------------------------------------------------------------------------


def make_data(case: Case, n: int, path: str) -> List[Dict[str, np.ndarray]]:
    from ppserver.datasets import load_npz, save_npz

    rng = np.random.default_rng(1234 + ord(case.key))
    if case.frames is None:
        shapes = [case.shape] * n
    else:
        lo, hi = case.frames
        shapes = [(int(t), case.shape[1]) for t in rng.integers(lo, hi + 1, size=n)]
    save_npz(path, [{"data": rng.standard_normal(shape, dtype=np.float32)} for shape in shapes])
    seqs, _ = load_npz(path)  # exactly the arrays the server will read
    return seqs


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def run_case(
    case: Case, args, tmpdir: str, rt_reason: Optional[str], torch_reason: Optional[str] = None
) -> List[Result]:
    n = case.seqs_quick if args.quick else case.seqs_full
    log(
        f"case ({case.key}) {case.title}: {n} seqs x {case.seq_bytes / 1e6:.3f} MB"
        f"{' (mean)' if case.frames else ''}; 1 warm-up + {args.epochs} timed epochs per pipeline"
    )
    npz = os.path.join(tmpdir, f"case_{case.key}.npz")
    seqs = make_data(case, n, npz)
    config = os.path.join(tmpdir, f"config_{case.key}.py")
    with open(config, "w") as f:
        f.write(
            (CONFIG_BURN if case.burn else CONFIG_DOUBLE).format(
                path=npz, buf_size=BUF_SIZE, workers=args.workers, burn=BURN_SECONDS
            )
        )
    if case.batched:
        return run_batched(case, args, tmpdir, config, seqs, n, torch_reason)
    server_log = os.path.join(tmpdir, f"server_{case.key}.log")
    relay_config = os.path.join(tmpdir, f"config_{case.key}_via_server.py")
    with open(config) as src, open(relay_config, "w") as dst:
        dst.write(src.read() + VIA_SERVER)
    relay_log = os.path.join(tmpdir, f"server_{case.key}_via_server.log")
    logs = {"ppserver": server_log, "pp-via-server": relay_log}

    results = {p: Result(case.key, p) for p in PIPELINES}
    pipes = [InProcess(config, seqs), PPServer(config, args.workers, server_log)]
    if args.via_server:
        pipes.append(PPServer(relay_config, args.workers, relay_log, name="pp-via-server"))
    else:
        results["pp-via-server"].error = "skipped (--no-via-server)"
    if rt_reason is None:
        pipes.append(Returnn(case.burn, seqs, args.workers))
    else:
        results["RETURNN"].error = "skipped (returnn not importable)"

    last = round_robin(pipes, results, logs, n, args.epochs)
    ref = last.get("in-process")
    if ref is not None:
        for name, meta in (("ppserver", True), ("pp-via-server", True), ("RETURNN", False)):
            if name in last and results[name].ok:
                check(results[name], (last[name].first, last[name].last), (ref.first, ref.last), meta=meta)
    return [results[p] for p in PIPELINES]


def run_batched(
    case: Case, args, tmpdir: str, config: str, seqs: List[Dict[str, np.ndarray]], n: int, torch_reason: Optional[str]
) -> List[Result]:
    """A batched case: ppserver (numpy), ppserver through ServerDataset, and the DataLoader peer."""
    from ppclient import collate
    from ppclient.batching import Batching
    from ppserver.datasets import NumpyDataset
    from ppserver.mappers.builtin import double
    from ppserver.scheduler.cut import cut_epoch

    assert case.batching is not None
    batching = Batching.from_dict(case.batching)
    # The epoch as the server orders it (seq_ordering "default": the corpus order, every epoch)
    # and cuts it: by the lengths of `data` in that order.
    ds = NumpyDataset(seqs=seqs)
    ds.init_seq_order(1)
    if ds.order != list(range(n)):  # so epoch positions are dataset indices for the DataLoader
        raise RuntimeError("the default seq_ordering no longer keeps the corpus order")
    lengths = [int(x) for x in ds.epoch_lengths("data")]
    batches = cut_epoch(lengths, batching)
    tags = [ds.get_seq(pos)["seq_tag"] for pos in range(n)]
    cut = [(tuple(tags[p] for p in b), (len(b), max(lengths[p] for p in b), case.shape[1])) for b in batches]

    def reference(batch: List[int]) -> Dict[str, Any]:
        return collate.pad([double(ds.get_seq(p)) for p in batch])

    ref_first, ref_last = reference(batches[0]), reference(batches[-1])
    sizes = sorted({len(b) for b in batches})
    log(
        f"  {len(batches)} batches per epoch ({batching.describe()}), "
        f"{sizes[0]}-{sizes[-1]} seqs each, {n / len(batches):.1f} on average"
    )

    logs = {"ppserver": os.path.join(tmpdir, f"server_{case.key}.log")}
    results = {p: Result(case.key, p) for p in BATCH_PIPELINES}
    pipes: List[Any] = []
    if torch_reason is None:
        if batching.bucket_window == 1 and batching.max_frames is None:
            loader = TorchLoader(seqs, tags, args.workers, batch_size=batching.max_seqs)
        else:
            loader = TorchLoader(seqs, tags, args.workers, batches=batches)
        # first: its workers fork before this case's clients start ZeroMQ threads in this process
        pipes.append(loader)
    pipes.append(PPServer(config, args.workers, logs["ppserver"], batching=case.batching))
    if torch_reason is None:
        logs["pp-torch"] = os.path.join(tmpdir, f"server_{case.key}_torch.log")
        pipes.append(TorchServer(config, args.workers, logs["pp-torch"], case.batching))
    else:
        for name in ("pp-torch", "DataLoader"):
            results[name].error = "skipped (torch not importable)"

    last = round_robin(pipes, results, logs, n, args.epochs)
    for name, got in last.items():
        if results[name].ok:
            check_batches(results[name], got, ref_first, ref_last, cut)
    return [results[p] for p in BATCH_PIPELINES]


def round_robin(
    pipes: List[Any], results: Dict[str, Result], logs: Dict[str, str], n: int, epochs: int
) -> Dict[str, Tally]:
    """Start each pipeline with its warm-up epoch 1, one after the other, then time epochs 2, 3, ...
    round-robin (the starting pipeline rotated each round). Fills `results`; returns each
    pipeline's last timed epoch. Every pipeline is closed at the end, also on errors."""

    def fail(pipe, exc: BaseException) -> None:
        res = results[pipe.name]
        res.error = f"{type(exc).__name__}: {exc}".strip()
        log(f"  {pipe.name} failed: {res.error}")
        traceback.print_exc(file=sys.stderr)
        shut(pipe)
        if pipe.name in logs:
            log(f"  last lines of the server log:\n{tail(logs[pipe.name])}")

    def shut(pipe) -> None:
        if pipe in live:
            live.remove(pipe)
            note = pipe.close()
            if note:
                results[pipe.name].add_note(note)

    live: List[Any] = []
    last: Dict[str, Tally] = {}
    try:
        for pipe in pipes:  # start + warm-up epoch, one pipeline after the other
            res = results[pipe.name]
            live.append(pipe)
            try:
                t0 = time.perf_counter()
                pipe.start()
                got_n = pipe.epoch(1).seqs
                res.warmup_seconds = time.perf_counter() - t0
                if got_n != n:
                    raise RuntimeError(f"warm-up epoch delivered {got_n} seqs, expected {n}")
                log(f"  {pipe.name:<10} started, warm-up epoch 1 done ({res.warmup_seconds:.2f} s with start-up)")
            except Exception as exc:
                fail(pipe, exc)
        for k, epoch in enumerate(range(2, 2 + epochs)):
            order = live[k % len(live) :] + live[: k % len(live)] if live else []
            for pipe in order:
                res = results[pipe.name]
                try:
                    roles = pipe.cpu() if hasattr(pipe, "cpu") else None
                    before = cpu_sample()
                    t0 = time.perf_counter()
                    got = pipe.epoch(epoch)
                    dt = time.perf_counter() - t0
                    after = cpu_sample()
                    if roles is not None:
                        for role, value in pipe.cpu().items():
                            res.cpu[role] = res.cpu.get(role, 0.0) + value - roles[role]
                    if got.seqs != n:
                        raise RuntimeError(f"epoch {epoch} delivered {got.seqs} seqs, expected {n}")
                except Exception as exc:
                    fail(pipe, exc)
                    continue
                res.seqs += got.seqs
                res.batches += got.batches
                res.nbytes += got.nbytes
                res.seconds += dt
                res.epoch_seconds.append(dt)
                if before is None or after is None or res.other_cpu is None:
                    res.other_cpu = None
                else:
                    res.other_cpu += (after[0] - before[0]) - (after[1] - before[1])
                last[pipe.name] = got
                log(
                    f"  {pipe.name:<10} epoch {epoch}: {got.seqs} seqs in {dt:.3f} s "
                    f"({got.seqs / dt:.0f} seqs/s, {got.nbytes / dt / 1e6:.1f} MB/s)"
                )
    finally:
        for pipe in list(live):
            shut(pipe)
    for name, path in logs.items():
        if results[name].note and not results[name].error:
            log(f"  {name}: {results[name].note}; last lines of the server log:\n{tail(path)}")
    return last


# ---- report -----------------------------------------------------------------------------


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def fmt(x: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def ratios(rows: List[Result]) -> Dict[str, Dict[str, Optional[float]]]:
    by = {(r.case, r.pipeline): r for r in rows}
    out = {}
    for case in dict.fromkeys(r.case for r in rows):
        if CASES[case].batched:
            pp, pt, dl = by[(case, "ppserver")], by[(case, "pp-torch")], by[(case, "DataLoader")]
            out[case] = {
                "pp_over_dataloader_seqs": ratio(pp.seqs_per_s, dl.seqs_per_s),
                "pp_torch_over_dataloader_seqs": ratio(pt.seqs_per_s, dl.seqs_per_s),
            }
            continue
        pp, rt, ip = by[(case, "ppserver")], by[(case, "RETURNN")], by[(case, "in-process")]
        vs = by[(case, "pp-via-server")]
        out[case] = {
            "pp_over_returnn_seqs": ratio(pp.seqs_per_s, rt.seqs_per_s),
            "pp_over_returnn_mb": ratio(pp.mb_per_s, rt.mb_per_s),
            "pp_over_inprocess_seqs": ratio(pp.seqs_per_s, ip.seqs_per_s),
            "pp_over_via_server_seqs": ratio(pp.seqs_per_s, vs.seqs_per_s),
            "via_server_over_returnn_seqs": ratio(vs.seqs_per_s, rt.seqs_per_s),
        }
    return out


def target_verdicts(
    rows: List[Result], rt_reason: Optional[str], torch_reason: Optional[str] = None
) -> List[Dict[str, Any]]:
    r = ratios(rows)
    verdicts = []
    for case, what, want in TARGETS:
        label = f"({case}) ppserver >= {want:g}x RETURNN {what}"
        if case not in r:
            verdicts.append({"target": label, "ratio": None, "verdict": "not run"})
            continue
        got = r[case]["pp_over_returnn_seqs" if what == "seqs/s" else "pp_over_returnn_mb"]
        if got is None:
            why = "RETURNN not available" if rt_reason else "missing measurement"
            verdicts.append({"target": label, "ratio": None, "verdict": f"n/a ({why})"})
        else:
            verdicts.append({"target": label, "ratio": got, "verdict": "PASS" if got >= want else "FAIL"})
    for case, want in BATCH_TARGETS:
        label = f"({case}) ppserver >= {want:g}x DataLoader seqs/s"
        if case not in r:
            verdicts.append({"target": label, "ratio": None, "verdict": "not run"})
            continue
        got = r[case]["pp_over_dataloader_seqs"]
        if got is None:
            why = "torch not available" if torch_reason else "missing measurement"
            verdicts.append({"target": label, "ratio": None, "verdict": f"n/a ({why})"})
        else:
            verdicts.append({"target": label, "ratio": got, "verdict": "PASS" if got >= want else "FAIL"})
    by = {(res.case, res.pipeline): res for res in rows}
    for case, role, limit in CPU_TARGETS:
        label = f"({case}) {role} CPU <= {limit:g} us/seq"
        res = by.get((case, "ppserver"))
        got = res.cpu_us(role) if res is not None and res.ok else None
        if got is None:
            verdicts.append({"target": label, "value": None, "verdict": "not run"})
        else:
            assert res is not None
            tick = 1e6 / os.sysconf("SC_CLK_TCK") / res.seqs  # /proc counts CPU in ticks: one, per seq
            verdict = "PASS" if got <= limit else "FAIL"
            if tick > limit / 10:
                verdict += f" (coarse: one /proc tick is {tick:.1f} us per seq here; run more seqs)"
            verdicts.append({"target": label, "value": got, "tick_us": tick, "verdict": verdict})
    return verdicts


def status_of(res: Result, notes: List[str]) -> str:
    """The check column: the check's verdict, or the error (long ones in full under notes)."""
    if res.note:
        notes.append(f"  {res.case}/{res.pipeline}: {res.note}")
    if res.ok:
        return res.check or ("reference" if res.pipeline == "in-process" else "-")
    status = res.error or "-"
    if len(status) > 60:
        notes.append(f"  {res.case}/{res.pipeline}: {status}")
        status = status[:57] + "..."
    return status


def other_cpu_cell(res: Result) -> str:
    if not res.ok or res.seconds < MIN_ACCOUNTED_SECONDS:
        return ""
    return fmt(None if res.other_cpu_frac is None else 100 * res.other_cpu_frac, ".0f", "%")


def print_table(cols: List[str], right: set, rows: List[Result], table: List[List[str]]) -> None:
    widths = [max([len(c)] + [len(row[i]) for row in table]) for i, c in enumerate(cols)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(cols).rstrip())
    print("  ".join("-" * w for w in widths))
    prev = None
    for res, row in zip(rows, table):
        if prev is not None and res.case != prev:
            print()
        prev = res.case
        print(line(row).rstrip())


def print_seq_table(rows: List[Result], notes: List[str]) -> None:
    """Cases a, b, c: ppserver and pp-via-server against RETURNN and the in-process loop."""
    r = ratios(rows)
    cols = [
        "case",
        "pipeline",
        "seqs/s",
        "MB/s",
        "pp/RT seqs/s",
        "pp/RT MB/s",
        "pp/in-proc",
        "server us/seq",
        "workers us/seq",
        "client us/seq",
        "other CPU",
        "check",
    ]
    table = []
    rows_by = {(res.case, res.pipeline): res for res in rows}
    for res in rows:
        is_pp = res.pipeline in ("ppserver", "pp-via-server")
        via = res.pipeline == "pp-via-server"
        rr = r[res.case]
        status = status_of(res, notes)
        table.append(
            [
                res.case,
                res.pipeline,
                fmt(res.seqs_per_s, ".0f"),
                fmt(res.mb_per_s, ".1f"),
                fmt(rr["via_server_over_returnn_seqs" if via else "pp_over_returnn_seqs"], ".2f", "x") if is_pp else "",
                fmt(
                    ratio(res.mb_per_s, rows_by[(res.case, "RETURNN")].mb_per_s) if via else rr["pp_over_returnn_mb"],
                    ".2f",
                    "x",
                )
                if is_pp
                else "",
                fmt(ratio(res.seqs_per_s, rows_by[(res.case, "in-process")].seqs_per_s), ".2f", "x") if is_pp else "",
                fmt(res.cpu_us("server"), ".0f"),
                fmt(res.cpu_us("workers"), ".0f"),
                fmt(res.cpu_us("client"), ".0f"),
                other_cpu_cell(res),
                status,
            ]
        )
    print_table(cols, {2, 3, 4, 5, 6, 7, 8, 9, 10}, rows, table)
    print()
    print("seqs/s, MB/s: totals over the timed epochs; MB = array bytes handed to the consumer (1e6 B)")
    print("pp/RT, pp/in-proc: ppserver over RETURNN and over the in-process loop, same run")
    print("pp-via-server: the same server with every result through its loop, no shared memory")
    print("us/seq: CPU (user + system, /proc) per delivered seq over the timed epochs: the server process,")
    print("        its workers together, and the client (this process, idle otherwise)")
    print("check: first and last seq of the last timed epoch equal the in-process result")
    print("       (numpy.array_equal, dtype, shape; for ppserver also seq_tag, seq_idx, complete_frac)")


def print_batch_table(rows: List[Result], notes: List[str]) -> None:
    """Cases d, e, f: ppserver (numpy and through ServerDataset) against PyTorch's DataLoader."""
    cols = [
        "case",
        "pipeline",
        "seqs/s",
        "batches/s",
        "MB/s",
        "/DataLoader",
        "server us/seq",
        "workers us/seq",
        "client us/seq",
        "other CPU",
        "check",
    ]
    table = []
    rows_by = {(res.case, res.pipeline): res for res in rows}
    for res in rows:
        dl = rows_by[(res.case, "DataLoader")]
        table.append(
            [
                res.case,
                res.pipeline,
                fmt(res.seqs_per_s, ".0f"),
                fmt(res.batches_per_s, ".0f"),
                fmt(res.mb_per_s, ".1f"),
                fmt(ratio(res.seqs_per_s, dl.seqs_per_s), ".2f", "x") if res.pipeline != "DataLoader" else "",
                fmt(res.cpu_us("server"), ".1f"),
                fmt(res.cpu_us("workers"), ".0f"),
                fmt(res.cpu_us("client"), ".1f"),
                other_cpu_cell(res),
                status_of(res, notes),
            ]
        )
    print_table(cols, {2, 3, 4, 5, 6, 7, 8, 9}, rows, table)
    print()
    print("batched cases: seqs/s counts real seqs (not padded rows); MB = bytes of the padded arrays handed over")
    print("/DataLoader: seqs/s over the DataLoader's in the same run; ppserver: batches as numpy arrays from")
    print("        ppclient.Client; pp-torch: tensors from ppclient.torch.ServerDataset + DataLoader(batch_size=None)")
    print("        in the main process; DataLoader: num_workers as ppserver's workers, persistent_workers=True,")
    print(f"        prefetch_factor={PREFETCH}, collating (stacking or padding) in its workers")
    print("us/seq: CPU per seq over the timed epochs: the server process, the workers together (ppserver's or")
    print("        the DataLoader's), the client (this process: the consumer, or the DataLoader's main process)")
    print("check: the last timed epoch's cut (every batch's seq tags and shape) is")
    print("       ppserver.scheduler.cut.cut_epoch's, and")
    print("       its first and last batch equal the in-process reference (the mapper, then")
    print("       ppclient.collate.pad) bit for bit: data, data:lengths, seq_tag, seq_idx")


def batching_words(case: Case) -> str:
    """A batched case's settings in words: ppserver's batching and what the DataLoader does."""
    b = case.batching or {}
    if b.get("max_frames") is None and b.get("bucket_window", 1) == 1:
        return f"batching {b}, DataLoader batch_size {b.get('max_seqs')} (default_collate)"
    return f"batching {b}, DataLoader batch_sampler = ppserver's cut, padding collate_fn"


def print_report(rows: List[Result], verdicts, header: List[str]) -> None:
    notes: List[str] = []
    seq_rows = [res for res in rows if not CASES[res.case].batched]
    batch_rows = [res for res in rows if CASES[res.case].batched]
    print()
    for h in header:
        print(h)
    if seq_rows:
        print()
        print_seq_table(seq_rows, notes)
    if batch_rows:
        print()
        print_batch_table(batch_rows, notes)
    print()
    print("other CPU: CPU used outside this benchmark during its timed epochs (other processes, VM steal)")
    print(f"           as a share of the machine ({NCPU} cores x timed seconds); blank when the timed epochs")
    print(f"           took under {MIN_ACCOUNTED_SECONDS:g} s, too short for /proc's 10 ms ticks")
    busy = [
        res
        for res in rows
        if res.ok and res.seconds >= MIN_ACCOUNTED_SECONDS and (res.other_cpu_frac or 0) > OTHER_CPU_WARN
    ]
    if busy:
        print()
        print(
            f"WARNING: other processes used more than {OTHER_CPU_WARN:.0%} of the machine during "
            + ", ".join(f"{res.case}/{res.pipeline}" for res in busy)
            + "; those numbers are not reliable."
        )
    print()
    print("targets:")
    for v in verdicts:
        if "value" in v:
            shown = "" if v["value"] is None else f"{v['value']:.1f} us  "
            print(f"  {v['target']:<40} {shown}{v['verdict']}")
            continue
        shown = "" if v["ratio"] is None else f"{v['ratio']:.2f}x  "
        print(f"  {v['target']:<40} {shown}{v['verdict']}")
    if notes:
        print()
        print("notes:")
        print("\n".join(notes))
    sys.stdout.flush()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        description="ppserver throughput vs an in-process loop, RETURNN's PostprocessingDataset and PyTorch's "
        "DataLoader (see bench/README.md)"
    )
    p.add_argument("--quick", action="store_true", help="about 1/5 of the seqs per case and 1 timed epoch")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of a,b,c,d,e,f (default: all)")
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="timed epochs per pipeline after the warm-up epoch (default 3, 1 with --quick)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=2,
        help="ppserver --workers, RETURNN and DataLoader num_workers (default %(default)s)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH ('-': stdout)")
    p.add_argument("--strict", action="store_true", help="exit with 1 if a target FAILs")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (data, configs, server logs)")
    p.add_argument(
        "--no-via-server",
        dest="via_server",
        action="store_false",
        help="skip the pp-via-server pipeline (results through the server, no shared memory)",
    )
    args = p.parse_args(argv)
    keys = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in keys if c not in CASES]
    if bad or not keys:
        p.error(f"--cases: unknown case(s) {bad or keys!r}; choose from {','.join(CASES)}")
    keys = list(dict.fromkeys(keys))
    if args.epochs is None:
        args.epochs = 1 if args.quick else 3
    if args.epochs < 1 or args.workers < 1:
        p.error("--epochs and --workers must be >= 1")

    rt_version, rt_reason = returnn_version()
    batched = any(CASES[c].batched for c in keys)
    torch_ver, torch_reason = torch_version() if batched else (None, None)
    pp_version = ppserver_version()
    command = " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv])
    header = [
        f"command:   {command}",
        f"machine:   nproc {NCPU} (cpu_count {os.cpu_count()}), {platform.machine()}, "
        f"{platform.system()} {platform.release()}",
        f"software:  {pp_version}, python {platform.python_version()}, numpy {np.__version__}, "
        f"RETURNN {rt_version if rt_version else 'not available: ' + str(rt_reason)}"
        + (f", torch {torch_ver if torch_ver else 'not available: ' + str(torch_reason)}" if batched else ""),
        f"load avg:  {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15 min, before the run)",
        f"setup:     {args.workers} workers, buf_size {BUF_SIZE}, 1 warm-up + {args.epochs} timed epochs "
        "(round-robin over the pipelines); "
        + "; ".join(f"({c}) {CASES[c].seqs_quick if args.quick else CASES[c].seqs_full} seqs" for c in keys),
    ]
    if batched:
        header.append(
            f"batched:   DataLoader num_workers {args.workers}, persistent_workers, prefetch_factor {PREFETCH}; "
            + "; ".join(f"({c}) {batching_words(CASES[c])}" for c in keys if CASES[c].batched)
        )
    if rt_reason:
        log(f"RETURNN column skipped: {rt_reason}")
    if torch_reason:
        log(f"DataLoader and pp-torch rows skipped: {torch_reason}")

    tmpdir = tempfile.mkdtemp(prefix="ppbench-")
    started = time.perf_counter()
    rows: List[Result] = []
    try:
        for key in keys:
            rows.extend(run_case(CASES[key], args, tmpdir, rt_reason, torch_reason))
    finally:
        if args.keep:
            log(f"kept {tmpdir}")
        else:
            shutil.rmtree(tmpdir, ignore_errors=True)
    total = time.perf_counter() - started
    header.append(f"wall time: {total:.1f} s")

    verdicts = target_verdicts(rows, rt_reason, torch_reason)
    print_report(rows, verdicts, header)

    if args.json:
        doc = {
            "command": command,
            "ppserver": pp_version,
            "machine": {
                "nproc": NCPU,
                "cpu_count": os.cpu_count(),
                "arch": platform.machine(),
                "python": platform.python_version(),
                "numpy": np.__version__,
                "returnn": rt_version,
                "returnn_skipped": rt_reason,
                "torch": torch_ver,
                "torch_skipped": torch_reason,
            },
            "settings": {
                "workers": args.workers,
                "buf_size": BUF_SIZE,
                "timed_epochs": args.epochs,
                "quick": args.quick,
                "burn_seconds": BURN_SECONDS,
                "dataloader_prefetch_factor": PREFETCH,
            },
            "cases": {
                c: {
                    "title": CASES[c].title,
                    "shape": list(CASES[c].shape),
                    "dtype": "float32",
                    "seqs": CASES[c].seqs_quick if args.quick else CASES[c].seqs_full,
                    "seq_bytes": CASES[c].seq_bytes,
                    "frames": None if CASES[c].frames is None else list(CASES[c].frames),
                    "batching": CASES[c].batching,
                }
                for c in keys
            },
            "results": [r.as_json() for r in rows],
            "ratios": ratios(rows),
            "targets": verdicts,
            "wall_seconds": round(total, 3),
        }
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
            log(f"wrote {args.json}")

    failed = [r for r in rows if r.error and not r.error.startswith("skipped")]
    mismatched = [r for r in rows if r.check and r.check != "ok"]
    if failed or mismatched:
        return 1
    if args.strict and any(v["verdict"].startswith("FAIL") for v in verdicts):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
