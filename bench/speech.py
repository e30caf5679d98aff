#!/usr/bin/env python3
"""Speech training input: audio seconds per second through ppserver and its peers, in one run.

A corpus of FLAC utterances (1-12 s, 16 kHz; espeak-ng's speech where it is installed, else a
synthetic voice) with a NeMo manifest and a Lhotse cuts manifest of the same files, and one
pipeline: FLAC decode -> speed perturbation (0.9/1.0/1.1) -> 80-dim fbank -> SpecAugment ->
padded batches of about 60 s of audio. Peers, 2 worker processes each where they have workers:

  in-process   the mappers and the padding in a loop in this process (one core, one thread)
  DataLoader   torch DataLoader(num_workers=2) over the same AudioManifest and mappers, tuned
  Lhotse       K2SpeechRecognitionDataset + OnTheFlyFeatures(Fbank) + PerturbSpeed + SpecAugment,
               DynamicBucketingSampler(max_duration=60), DataLoader(num_workers=2)
  ppserver     ppserver serve --workers 2 with AudioManifest and the speech mappers
  pp-remote    the server and its 2 workers in network namespaces (tests/netns.py; root), the
               trainer (this process) in the root namespace: its CPU per audio second

Usage:  python3 bench/speech.py [--quick] [--epochs N] [--hours H] [--peers a,b] [--json PATH]
See bench/README.md ("Speech benchmark").
"""

from __future__ import annotations

import os

# One thread per process everywhere (this process is the in-process peer and the trainer; the
# DataLoaders' workers inherit it): what a careful user sets, and what ppserver's workers get.
for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_name] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Dict, List, Optional, Sequence, Tuple  # noqa: E402

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, os.path.join(REPO, "tests")]  # throughput.py's helpers, tests/netns.py

from throughput import PPServer, _children, _cpu_of, fmt, log, ppserver_version, ratio  # noqa: E402

RATE = 16000
MAX_DURATION = 60.0  # seconds of (padded) audio per batch
BUCKET_WINDOW = 64  # ppserver: seqs sorted by length at a time before the cut
WORKERS = 2
BUF_SIZE = 4  # ppserver: batches in flight per worker
PREFETCH = 4  # the DataLoaders' prefetch_factor: batches in flight per worker, as buf_size
FACTORS = (0.9, 1.0, 1.1)
SEED = 0
NCPU = len(os.sched_getaffinity(0))
MAP_COST = 0.010  # seconds of mapping per utterance for the "cores one server feeds" line
PEERS = ("in-process", "DataLoader", "Lhotse", "ppserver", "pp-remote")

TARGETS = [  # (label, measured, wanted): ratios of the same run
    ("ppserver >= 0.9 x ideal (2 cores x in-process)", "pp_over_ideal", 0.9, ">="),
    ("ppserver >= 1.1 x tuned DataLoader", "pp_over_dataloader", 1.1, ">="),
    ("ppserver >= 1.3 x Lhotse's stack", "pp_over_lhotse", 1.3, ">="),
    ("trainer CPU, remote workers <= 1% of DataLoader's", "remote_cpu_over_dataloader", 0.01, "<="),
]

SENTENCES = [
    "The server reads bytes and never decodes them.",
    "Decoding, speed perturbation and the filterbank features run in the workers.",
    "The trainer gets padded batches of about one minute of audio.",
    "Every epoch is a pure function of the configuration, the epoch and the seed.",
    "A worker may die at any time, and its utterances are mapped again elsewhere.",
    "Batches are cut up front from the durations in the manifest.",
    "Speech corpora are served as they are, with no conversion step.",
    "The quick brown fox jumps over the lazy dog near the riverbank.",
    "She sells sea shells by the sea shore on a bright summer morning.",
    "Seven hundred and twenty three utterances were read from the manifest.",
    "Workers on other hosts join at any time and leave without losing anything.",
    "A thin client on the training node pulls the results in order.",
]

CONFIG = """\
from ppserver.mappers import Sequential, decode, fbank, spec_augment, speed_perturb

dataset = {{"class": "AudioManifest", "manifest": {manifest!r}}}
map_seq = Sequential(
    decode(sample_rate={rate}),
    speed_perturb(factors={factors!r}, sample_rate={rate}),
    fbank(num_mel_bins=80, sample_rate={rate}),
    spec_augment,
)
buf_size = {buf_size}
num_workers = {workers}
seed = {seed}
"""


def tuned_loader(dataset: Any, sampler: Any) -> Any:
    """A DataLoader as a careful user tunes it (the DataLoader and Lhotse peers alike): WORKERS
    persistent workers of one thread each, PREFETCH batches ahead, the sampler's batches as they are."""
    from torch.utils.data import DataLoader

    return DataLoader(
        dataset,
        sampler=sampler,
        batch_size=None,
        num_workers=WORKERS,
        persistent_workers=True,
        prefetch_factor=PREFETCH,
        pin_memory=False,
        worker_init_fn=one_thread,
    )


def batching() -> Dict[str, Any]:
    """ppserver's batching: about MAX_DURATION s per batch, padded, as Lhotse counts it."""
    return {"max_duration": MAX_DURATION, "bucket_window": BUCKET_WINDOW}


# ---- the corpus -------------------------------------------------------------------------------


@dataclass
class Corpus:
    manifest: str  # NeMo JSON lines
    cuts: str  # Lhotse CutSet (jsonl.gz) of the same files
    durations: List[float]
    source: str  # "espeak-ng" or "synthetic"

    @property
    def seconds(self) -> float:
        return float(sum(self.durations))


def speech_clips(folder: str) -> Tuple[List[Tuple[np.ndarray, str]], str]:
    """Spoken sentences at 16 kHz: espeak-ng's (at a few speeds) where installed, else synthetic."""
    import soundfile as sf
    import soxr

    clips: List[Tuple[np.ndarray, str]] = []
    if shutil.which("espeak-ng"):
        for i, text in enumerate(SENTENCES):
            path = os.path.join(folder, f"clip{i}.wav")
            speed = str(140 + 15 * (i % 4))
            subprocess.run(["espeak-ng", "-s", speed, "-w", path, text], check=True, timeout=60, capture_output=True)
            x, rate = sf.read(path, dtype="float32")
            os.unlink(path)
            clips.append((soxr.resample(x, rate, RATE).astype(np.float32), text))
        return clips, "espeak-ng"
    for i, text in enumerate(SENTENCES):
        r = np.random.RandomState(i)
        t = np.arange(int(RATE * (1.5 + 0.1 * len(text.split())))) / RATE
        f0 = 110 + 20 * i % 60 + 25 * np.sin(2 * np.pi * 0.6 * t)
        voice = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / RATE) / k for k in range(1, 8))
        x = 0.2 * voice * np.clip(np.sin(2 * np.pi * 3.5 * t), 0, None) + 0.005 * r.randn(len(t))
        clips.append((x.astype(np.float32), text))
    return clips, "synthetic"


def make_corpus(folder: str, seconds: float, seed: int = 1) -> Corpus:
    """FLAC files of 1-12 s (uniform) until `seconds` of audio: clips tiled with short pauses and
    cut to the drawn duration, with a little noise; a NeMo manifest and a Lhotse cuts manifest."""
    import soundfile as sf
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    os.makedirs(os.path.join(folder, "audio"), exist_ok=True)
    clips, source = speech_clips(folder)
    rng = np.random.RandomState(seed)
    lines, cuts, durations = [], [], []
    total, i = 0.0, 0
    while total < seconds:
        n = int(rng.uniform(1.0, 12.0) * RATE)
        parts, texts, have = [], [], 0
        while have < n:
            clip, text = clips[rng.randint(len(clips))]
            pause = np.zeros(int(rng.uniform(0.1, 0.4) * RATE), np.float32)
            parts += [clip, pause]
            texts.append(text)
            have += len(clip) + len(pause)
        x = np.concatenate(parts)[:n] * np.float32(rng.uniform(0.5, 1.0))
        x += np.float32(1e-3) * rng.standard_normal(n).astype(np.float32)
        name = f"utt{i:05d}"
        path = os.path.join(folder, "audio", f"{name}.flac")
        sf.write(path, np.clip(x, -1, 1), RATE, format="FLAC", subtype="PCM_16")
        duration = n / RATE
        text = " ".join(texts)
        lines.append(json.dumps({"audio_filepath": path, "duration": duration, "text": text, "id": name}))
        rec = Recording.from_file(path, recording_id=name)
        sup = SupervisionSegment(id=name, recording_id=name, start=0.0, duration=rec.duration, channel=0, text=text)
        cuts.append(MonoCut(id=name, start=0.0, duration=rec.duration, channel=0, recording=rec, supervisions=[sup]))
        durations.append(duration)
        total += duration
        i += 1
    manifest = os.path.join(folder, "train.jsonl")
    with open(manifest, "w") as f:
        f.write("\n".join(lines) + "\n")
    cuts_path = os.path.join(folder, "cuts_train.jsonl.gz")
    CutSet.from_cuts(cuts).to_file(cuts_path)
    return Corpus(manifest, cuts_path, durations, source)


# ---- what the DataLoader peer runs in its workers (module level: picklable) -------------------


def one_thread(worker_id: int) -> None:
    """worker_init_fn: one torch thread per DataLoader worker (the env vars do numpy's pools)."""
    import torch

    torch.set_num_threads(1)


def pad_shared(seqs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A ppserver-style batch of mapped seqs: `data` zero-padded (B, T, 80) and `data:lengths`,
    `seq_tag`, `seq_idx`, `text`. In a DataLoader worker the padded tensor is allocated in
    shared memory (as default_collate allocates), so it reaches the trainer without a copy."""
    import torch
    from torch.utils.data import get_worker_info

    arrays = [s["data"] for s in seqs]
    lengths = [len(a) for a in arrays]
    shape = (len(arrays), max(lengths), arrays[0].shape[1])
    if get_worker_info() is not None:
        storage = torch.from_numpy(arrays[0])._typed_storage()._new_shared(math.prod(shape), device="cpu")
        out = torch.empty(0, dtype=torch.float32).new(storage).resize_(shape)
    else:
        out = torch.empty(shape, dtype=torch.float32)
    view = out.numpy()
    for row, a, n in zip(view, arrays, lengths):
        row[:n] = a
        row[n:] = 0
    return {
        "data": out,
        "data:lengths": torch.tensor(lengths, dtype=torch.int64),
        "seq_tag": [s["seq_tag"] for s in seqs],
        "seq_idx": torch.tensor([int(s["seq_idx"]) for s in seqs], dtype=torch.int64),
        "text": [str(s["text"]) for s in seqs],
    }


class MappedBatches:
    """The tuned DataLoader's dataset: item (epoch, positions) is that batch of the epoch, read
    with AudioManifest (as ppserver's reader reads it), mapped with the config's map_seq and
    the seq's rng (ppserver.mappers.apply.apply_map_seq, as ppserver's workers map) and padded."""

    def __init__(self, manifest: str, map_seq: Any, seed: int, templates: Dict[str, Any]):
        from ppserver.datasets.nemo import AudioManifest

        self.ds = AudioManifest(manifest=manifest)
        self.map_seq, self.seed, self.templates = map_seq, seed, templates
        self.epoch: Optional[int] = None

    def __len__(self) -> int:
        return self.ds.num_seqs

    def mapped(self, epoch: int, positions: Sequence[int]) -> List[Dict[str, Any]]:
        from ppserver.mappers.apply import apply_map_seq

        if epoch != self.epoch:
            self.ds.init_seq_order(epoch)
            self.epoch = epoch
        return [
            apply_map_seq(self.map_seq, self.ds.get_seq(p), epoch=epoch, seed=self.seed, templates=self.templates)
            for p in positions
        ]

    def __getitem__(self, key: Tuple[int, List[int]]) -> Dict[str, Any]:
        return pad_shared(self.mapped(*key))


class EpochBatches:
    """The DataLoader's sampler (batch_size=None): (epoch, positions) of each batch of the epoch
    set last, ppserver's cut of it (cut_epoch over the durations in epoch order)."""

    def __init__(self, cut_of):
        self.cut_of = cut_of
        self.epoch = 1

    def __iter__(self):
        return iter([(self.epoch, b) for b in self.cut_of(self.epoch)])

    def __len__(self) -> int:
        return len(self.cut_of(self.epoch))


# ---- results ----------------------------------------------------------------------------------


@dataclass
class Result:
    peer: str
    seconds: float = 0.0  # wall time of the timed epochs
    audio: float = 0.0  # audio seconds delivered over them
    utts: int = 0
    batches: int = 0
    epoch_rates: List[float] = field(default_factory=list)
    warmup: Optional[float] = None
    error: Optional[str] = None
    check: Optional[str] = None
    cpu: Dict[str, float] = field(default_factory=dict)  # CPU seconds over the timed epochs, by role
    other: float = 0.0  # CPU seconds of the machine outside this run's processes

    @property
    def ok(self) -> bool:
        return self.error is None and self.seconds > 0

    @property
    def rate(self) -> Optional[float]:
        return self.audio / self.seconds if self.ok else None

    @property
    def cpu_per_audio_s(self) -> Optional[float]:
        """CPU seconds of all the peer's processes (trainer, workers, server) per audio second."""
        return sum(self.cpu.values()) / self.audio if self.ok and self.cpu else None

    @property
    def cpu_bound(self) -> Optional[float]:
        """The audio s/s the machine's cores allow at this CPU cost: what a quiet machine gives
        at best (no idle time, nothing else running)."""
        cost = self.cpu_per_audio_s
        return NCPU / cost if cost else None

    def per_audio_s(self, role: str) -> Optional[float]:
        """CPU ms per audio second of one role."""
        return 1e3 * self.cpu[role] / self.audio if self.ok and role in self.cpu else None

    def as_json(self) -> Dict[str, Any]:
        return {
            "peer": self.peer,
            "audio_s_per_s": self.rate,
            "epoch_audio_s_per_s": self.epoch_rates,
            "timed_seconds": self.seconds,
            "audio_seconds": self.audio,
            "utterances": self.utts,
            "batches": self.batches,
            "warmup_seconds": self.warmup,
            "cpu_seconds": self.cpu,
            "cpu_bound_audio_s_per_s": self.cpu_bound,
            "other_cpu_seconds": self.other,
            "error": self.error,
            "check": self.check,
        }


def machine_cpu() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


# ---- peers ------------------------------------------------------------------------------------
# start() brings one up, epoch(e) delivers epoch e as batches (a list of (seq tags, padded
# data shape) and the first batch), cpu() its CPU seconds so far by role, close() stops it.


class Setup:
    """What every peer shares: the config, its map_seq and templates, the epoch cuts."""

    def __init__(self, corpus: Corpus, config: str):
        from ppclient.batching import Batching
        from ppserver.config.mappers import output_templates
        from ppserver.config.settings import load_config
        from ppserver.datasets.nemo import AudioManifest

        self.corpus, self.config = corpus, config
        self.cfg = load_config(config)
        self.ds = AudioManifest(manifest=corpus.manifest)
        self.templates = output_templates(self.cfg, self.ds.data_keys())
        self.batching = batching()
        self._batching = Batching.from_dict(self.batching)
        self._cuts: Dict[int, List[List[int]]] = {}

    def cut(self, epoch: int) -> List[List[int]]:
        """ppserver's batches of an epoch: epoch positions."""
        from ppserver.scheduler.cut import cut_epoch

        if epoch not in self._cuts:
            self.ds.init_seq_order(epoch)
            lengths = [int(n) for n in self.ds.epoch_lengths("audio")]
            self._cuts[epoch] = cut_epoch(lengths, self._batching, self.ds.epoch_durations())
        return self._cuts[epoch]

    def tags(self, epoch: int) -> List[Tuple[str, ...]]:
        """The seq tags of each of ppserver's batches of an epoch."""
        cut = self.cut(epoch)  # leaves the epoch's order set
        order = self.ds.order
        return [tuple(self.ds._tag(order[p]) for p in b) for b in cut]


class Epoch:
    """One epoch as the trainer got it."""

    def __init__(self) -> None:
        self.utts = 0
        self.audio = 0.0
        self.batches: List[Tuple[Tuple[str, ...], Tuple[int, ...]]] = []
        self.first: Optional[Dict[str, Any]] = None

    def add(self, tags: Sequence[str], data: Any, audio: float) -> None:
        self.utts += len(tags)
        self.audio += audio
        self.batches.append((tuple(tags), tuple(data.shape)))


class InProcess:
    name = "in-process"

    def __init__(self, setup: Setup):
        self.setup = setup

    def start(self) -> None:
        from ppclient import collate

        self.pad = collate.pad
        self.batches = MappedBatches(self.setup.corpus.manifest, self.setup.cfg.map_seq, SEED, self.setup.templates)

    def epoch(self, epoch: int) -> Epoch:
        got = Epoch()
        durations = self.setup.corpus.durations
        for b in self.setup.cut(epoch):
            seqs = self.batches.mapped(epoch, b)
            batch = self.pad(seqs)
            got.add(batch["seq_tag"], batch["data"], sum(durations[self.batches.ds.order[p]] for p in b))
            got.first = got.first or batch
        return got

    def cpu(self) -> Dict[str, float]:
        return {"trainer": time.process_time()}

    def close(self) -> None:
        pass


class TunedLoader:
    name = "DataLoader"

    def __init__(self, setup: Setup):
        self.setup = setup
        self.loader: Any = None

    def start(self) -> None:

        s = self.setup
        self.sampler = EpochBatches(s.cut)
        self.ds = MappedBatches(s.corpus.manifest, s.cfg.map_seq, SEED, s.templates)
        self.loader = tuned_loader(self.ds, self.sampler)

    def epoch(self, epoch: int) -> Epoch:
        self.sampler.epoch = epoch
        self.setup.ds.init_seq_order(epoch)
        order, durations = self.setup.ds.order, self.setup.corpus.durations
        got = Epoch()
        for batch in self.loader:
            idx = batch["seq_idx"].tolist()
            got.add(batch["seq_tag"], batch["data"], sum(durations[order[p]] for p in idx))
            got.first = got.first or batch
        return got

    def worker_pids(self) -> List[int]:
        it = getattr(self.loader, "_iterator", None)
        return [w.pid for w in getattr(it, "_workers", None) or []]

    def cpu(self) -> Dict[str, float]:
        return {"trainer": time.process_time(), "workers": sum(_cpu_of(p) for p in self.worker_pids())}

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        self.loader = None


class LhotseLoader(TunedLoader):
    """Lhotse's own stack over the cuts manifest of the same files."""

    name = "Lhotse"

    def start(self) -> None:
        from lhotse import CutSet, Fbank, FbankConfig
        from lhotse.dataset import (
            DynamicBucketingSampler,
            K2SpeechRecognitionDataset,
            OnTheFlyFeatures,
            PerturbSpeed,
            SpecAugment,
        )

        cuts = CutSet.from_file(self.setup.corpus.cuts)
        self.ds = K2SpeechRecognitionDataset(
            return_cuts=True,  # the cut ids: which utterances a batch holds
            # factors 0.9 and 1.1 with p 2/3: each of 0.9, 1.0, 1.1 a third of the time, as ours
            cut_transforms=[PerturbSpeed(factors=[0.9, 1.1], p=2 / 3)],
            input_strategy=OnTheFlyFeatures(Fbank(FbankConfig(num_filters=80))),
            # ours: up to 2 time masks of up to 20 frames, 2 feature masks of up to 10 bins, no warping
            input_transforms=[
                SpecAugment(
                    time_warp_factor=None,
                    num_frame_masks=2,
                    frames_mask_size=20,
                    num_feature_masks=2,
                    features_mask_size=10,
                )
            ],
        )
        self.sampler = DynamicBucketingSampler(cuts, max_duration=MAX_DURATION, shuffle=True, seed=SEED)
        self.loader = tuned_loader(self.ds, self.sampler)
        self.dur = {f"utt{i:05d}": d for i, d in enumerate(self.setup.corpus.durations)}

    def epoch(self, epoch: int) -> Epoch:
        self.sampler.set_epoch(epoch)
        got = Epoch()
        for batch in self.loader:
            tags = [c.id.split("_sp")[0] for c in batch["supervisions"]["cut"]]  # "_sp0.9": perturbed
            got.add(tags, batch["inputs"], sum(self.dur.get(t, 0.0) for t in tags))
            got.first = got.first or batch
        return got


class LocalServer:
    """ppserver serve --workers 2 on loopback, read with ppclient.Client(batching=...)."""

    name = "ppserver"

    def __init__(self, setup: Setup, log_path: str):
        self.setup = setup
        self.server = PPServer(setup.config, WORKERS, log_path, batching=setup.batching)

    def start(self) -> None:
        self.server.start()

    def epoch(self, epoch: int) -> Epoch:
        return consume(self.server.client.epoch(epoch), self.setup.corpus)

    def cpu(self) -> Dict[str, float]:
        c = self.server.cpu()
        return {"trainer": time.process_time(), "server": c["server"], "workers": c["workers"]}

    def server_pid(self) -> Optional[int]:
        return self.server.proc.pid if self.server.proc else None

    def close(self) -> None:
        note = self.server.close()
        if note:
            log(f"  ppserver: {note}")


def consume(batches, corpus: Corpus) -> Epoch:
    dur = {f"utt{i:05d}": d for i, d in enumerate(corpus.durations)}
    got = Epoch()
    for batch in batches:
        got.add(batch["seq_tag"], batch["data"], sum(dur[t] for t in batch["seq_tag"]))
        got.first = got.first or batch
    return got


class RemoteServer:
    """The server (--workers 0) and a worker host (ppserver worker --procs 2) in network
    namespaces, of a hostname of their own (so nothing goes through shared memory); the trainer
    is this process, in the root namespace."""

    name = "pp-remote"

    def __init__(self, setup: Setup, log_dir: str):
        self.setup, self.log_dir = setup, log_dir
        self.lab: Any = None
        self.client: Any = None
        self.handle: Any = None
        self.host: Any = None

    def start(self) -> None:
        from netns import Lab

        from ppclient import Client

        self.lab = Lab(hosts=1, log_dir=self.log_dir)
        self.lab.create()
        self.handle = self.lab.start_server(self.setup.config, port=5555)
        self.host = self.lab.start_workers(1, self.setup.config, port=self.handle.port, procs=WORKERS)
        self.handle.wait_count(WORKERS, timeout=120)
        self.client = Client(self.handle.address, timeout=60, batching=self.setup.batching)

    def epoch(self, epoch: int) -> Epoch:
        return consume(self.client.epoch(epoch), self.setup.corpus)

    def server_pid(self) -> Optional[int]:
        return self.handle.proc.pid if self.handle else None

    def cpu(self) -> Dict[str, float]:
        out = {"trainer": time.process_time()}
        if self.handle is not None:
            out["server"] = _cpu_of(self.handle.proc.pid)
        if self.host is not None:
            out["workers"] = sum(_cpu_of(p) for p in _descendants(self.host.pid))
        return out

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.lab is not None:
            self.lab.destroy()
            self.lab = None


def _descendants(pid: int) -> List[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


# ---- the run ----------------------------------------------------------------------------------


def run(peers: List[Any], results: Dict[str, Result], epochs: int, corpus: Corpus, setup: Setup) -> Dict[str, Epoch]:
    """Start each peer with its warm-up epoch 1, then time epochs 2, 3, ... round-robin (one peer
    at a time, the first rotated each round). Every peer is closed at the end."""
    live: List[Any] = []
    last: Dict[str, Epoch] = {}

    def fail(peer: Any, exc: BaseException) -> None:
        results[peer.name].error = f"{type(exc).__name__}: {exc}".strip()
        log(f"  {peer.name} failed: {results[peer.name].error}")
        traceback.print_exc(file=sys.stderr)
        if peer in live:
            live.remove(peer)
            peer.close()

    n = len(corpus.durations)
    try:
        for peer in peers:
            live.append(peer)
            try:
                t0 = time.perf_counter()
                peer.start()
                got = peer.epoch(1)
                results[peer.name].warmup = time.perf_counter() - t0
                if got.utts != n:
                    raise RuntimeError(f"warm-up epoch delivered {got.utts} utterances, expected {n}")
                log(f"  {peer.name:<10} started, warm-up epoch done ({results[peer.name].warmup:.1f} s)")
            except Exception as exc:
                fail(peer, exc)
        for k, epoch in enumerate(range(2, 2 + epochs)):
            for peer in live[k % len(live) :] + live[: k % len(live)] if live else []:
                res = results[peer.name]
                try:
                    cpu0, m0 = peer.cpu(), machine_cpu()
                    t0 = time.perf_counter()
                    got = peer.epoch(epoch)
                    dt = time.perf_counter() - t0
                    cpu1, m1 = peer.cpu(), machine_cpu()
                    if got.utts != n:
                        raise RuntimeError(f"epoch {epoch} delivered {got.utts} utterances, expected {n}")
                except Exception as exc:
                    fail(peer, exc)
                    continue
                ours = 0.0
                for role in cpu1:
                    res.cpu[role] = res.cpu.get(role, 0.0) + cpu1[role] - cpu0.get(role, cpu1[role])
                    ours += cpu1[role] - cpu0.get(role, cpu1[role])
                res.other += max(0.0, (m1 - m0) - ours)
                res.seconds += dt
                res.audio += got.audio
                res.utts += got.utts
                res.batches += len(got.batches)
                res.epoch_rates.append(got.audio / dt)
                last[peer.name] = got
                log(
                    f"  {peer.name:<10} epoch {epoch}: {got.audio:.0f} s of audio in {dt:.2f} s "
                    f"({got.audio / dt:.0f} s/s)"
                )
    finally:
        for peer in list(live):
            try:
                peer.close()
            except Exception as exc:  # keep tearing down
                log(f"  closing {peer.name} failed: {exc}")
    return last


def check_cuts(results: Dict[str, Result], last: Dict[str, Epoch], setup: Setup, epochs: int) -> None:
    """Every peer that uses ppserver's cut delivered exactly its batches (tags in order), and the
    first batch of the last epoch equals the in-process one bit for bit."""
    epoch = 1 + epochs
    want = setup.tags(epoch)
    ref = last.get("in-process")
    for name in ("in-process", "DataLoader", "ppserver", "pp-remote"):
        got = last.get(name)
        if got is None or not results[name].ok:
            continue
        tags = [b[0] for b in got.batches]
        problems = []
        if tags != want:
            problems.append(f"cut differs ({len(tags)} batches, expected {len(want)})")
        if ref is not None and ref.first is not None and got.first is not None and name != "in-process":
            a = np.asarray(got.first["data"].numpy() if hasattr(got.first["data"], "numpy") else got.first["data"])
            b = np.asarray(ref.first["data"])
            if a.shape != b.shape or not np.array_equal(a, b):
                problems.append("first batch's data differs from in-process")
        results[name].check = "ok" if not problems else "MISMATCH: " + "; ".join(problems)


def stage_costs(setup: Setup, count: int) -> Dict[str, float]:
    """CPU ms per utterance of each step (this thread's CPU time), over `count` utterances."""
    from ppclient import collate
    from ppserver.mappers.apply import seq_rng

    steps = list(getattr(setup.cfg.map_seq, "funcs", [setup.cfg.map_seq]))
    names = [type(m).__name__ if hasattr(m, "_settings") else getattr(m, "__name__", repr(m)) for m in steps]
    cost = {name: 0.0 for name in names}
    cost["read"] = cost["pad"] = 0.0
    setup.ds.init_seq_order(1)
    outs = []
    for pos in range(min(count, setup.ds.num_seqs)):
        t = time.thread_time()
        seq = setup.ds.get_seq(pos)
        cost["read"] += time.thread_time() - t
        rng = seq_rng(SEED, 1, pos)
        for name, m in zip(names, steps):
            t = time.thread_time()
            seq = m(seq, epoch=1, seq_idx=pos, rng=rng)
            cost[name] += time.thread_time() - t
        outs.append(seq)
        if len(outs) == 8:
            t = time.thread_time()
            collate.pad(outs)
            cost["pad"] += time.thread_time() - t
            outs = []
    n = min(count, setup.ds.num_seqs)
    return {k: 1e3 * v / n for k, v in cost.items()}


def ratios(results: Dict[str, Result]) -> Dict[str, Optional[float]]:
    r = {k: v.rate for k, v in results.items()}
    dl, remote = results["DataLoader"], results["pp-remote"]
    dl_host = None
    if dl.ok and "workers" in dl.cpu:
        dl_host = (dl.cpu["trainer"] + dl.cpu["workers"]) / dl.audio
    remote_trainer = remote.cpu["trainer"] / remote.audio if remote.ok and "trainer" in remote.cpu else None
    ideal = None if r["in-process"] is None else WORKERS * r["in-process"]
    ip = results["in-process"].cpu_bound / NCPU if results["in-process"].cpu_bound else None  # one core's
    return {
        "ideal": ideal,
        "pp_over_ideal": ratio(r["ppserver"], ideal),
        "pp_over_dataloader": ratio(r["ppserver"], r["DataLoader"]),
        "pp_over_lhotse": ratio(r["ppserver"], r["Lhotse"]),
        "remote_over_ideal": ratio(r["pp-remote"], ideal),
        "dataloader_over_ideal": ratio(r["DataLoader"], ideal),
        "lhotse_over_ideal": ratio(r["Lhotse"], ideal),
        "dataloader_host_cpu_per_audio_s": dl_host,
        "remote_trainer_cpu_per_audio_s": remote_trainer,
        "remote_cpu_over_dataloader": ratio(remote_trainer, dl_host),
        # the same ratios of the CPU-bound rates (cores / CPU per audio second of all processes)
        "cpu_bound_pp_over_ideal": ratio(results["ppserver"].cpu_bound, None if ip is None else WORKERS * ip),
        "cpu_bound_pp_over_dataloader": ratio(results["ppserver"].cpu_bound, results["DataLoader"].cpu_bound),
        "cpu_bound_pp_over_lhotse": ratio(results["ppserver"].cpu_bound, results["Lhotse"].cpu_bound),
    }


def server_per_utt(res: Result) -> Optional[float]:
    """The server process's CPU ms per utterance over the timed epochs."""
    return 1e3 * res.cpu["server"] / res.utts if res.ok and "server" in res.cpu and res.utts else None


def report(results: Dict[str, Result], header: List[str], stages: Dict[str, float], corpus: Corpus) -> Dict[str, Any]:
    r = ratios(results)
    print()
    print("\n".join(header))
    print()
    cols = [
        "peer",
        "audio s/s",
        "x ideal",
        "pp / this",
        "trainer ms/audio s",
        "workers ms/audio s",
        "server ms/utt",
        "all ms/audio s",
        "CPU-bound s/s",
        "other CPU",
        "check",
    ]
    rows = []
    for name in PEERS:
        res = results[name]
        other = res.other / (res.seconds * (os.cpu_count() or 1)) if res.ok else None
        rows.append(
            [
                name,
                fmt(res.rate, ".0f"),
                fmt(ratio(res.rate, r["ideal"]), ".2f"),
                fmt(ratio(results["ppserver"].rate, res.rate), ".2f", "x") if name not in ("ppserver",) else "",
                fmt(res.per_audio_s("trainer"), ".2f"),
                fmt(res.per_audio_s("workers"), ".1f"),
                fmt(server_per_utt(res), ".3f"),
                fmt(None if res.cpu_per_audio_s is None else 1e3 * res.cpu_per_audio_s, ".3f"),
                fmt(res.cpu_bound, ".0f"),
                fmt(None if other is None else 100 * other, ".0f", "%"),
                res.check or (res.error or "-")[:70],
            ]
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) if i in (0, 10) else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(
            "  ".join(c.ljust(w) if i in (0, 10) else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        )
    print()
    print("audio s/s: seconds of audio (as in the manifest, before speed perturbation) per wall second over the")
    print(f"           timed epochs; x ideal: over {WORKERS} x in-process (one core, one thread, no transport)")
    print("trainer ms/audio s: CPU of the consuming process (this one) per audio second; workers: all worker")
    print("           processes together; server ms/utt: the ppserver server process per utterance")
    print("all ms/audio s: CPU of all the peer's processes per audio second; CPU-bound s/s: the cores")
    print(f"           ({NCPU}) over that, the most a quiet machine would give at this cost")
    print("other CPU: what the rest of the machine used meanwhile (other people's work), share of all cores")
    print()
    print("CPU ms per utterance of each step, in this process (mean over the utterances timed):")
    print(
        "  "
        + ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
        + f"; mean utterance {corpus.seconds / len(corpus.durations):.2f} s"
    )
    dl_host, remote = r["dataloader_host_cpu_per_audio_s"], r["remote_trainer_cpu_per_audio_s"]
    if dl_host is not None and remote is not None:
        print(
            f"trainer host CPU per audio second: DataLoader (main + workers) {1e3 * dl_host:.1f} ms, "
            f"ppserver with remote workers {1e3 * remote:.3f} ms ({100 * remote / dl_host:.2f} %)"
        )
    server = [x for x in (server_per_utt(results["ppserver"]), server_per_utt(results["pp-remote"])) if x]
    if server:
        worst = max(server)
        print(
            f"one server feeds about {1e3 * MAP_COST / worst:.0f} worker cores at {1e3 * MAP_COST:.0f} ms of mapping "
            f"per utterance ({worst:.3f} ms of server CPU per utterance, the larger of local and remote)"
        )
    print()
    print("targets (ratios of this run):")
    verdicts = []
    for label, key, want, how in TARGETS:
        got = r.get(key)
        verdict = "n/a" if got is None else ("PASS" if (got >= want if how == ">=" else got <= want) else "FAIL")
        shown = "-" if got is None else (f"{100 * got:.2f} %" if key == "remote_cpu_over_dataloader" else f"{got:.2f}x")
        bound = r.get("cpu_bound_" + key)
        also = "" if bound is None else f"   (CPU-bound rates: {bound:.2f}x)"
        print(f"  {label:<52} {shown:>9}  {verdict}{also}")
        verdicts.append({"target": label, "value": got, "verdict": verdict, "cpu_bound_value": bound})
    sys.stdout.flush()
    return {"ratios": r, "targets": verdicts}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="speech input pipelines: ppserver against its peers (bench/README.md)")
    p.add_argument("--quick", action="store_true", help="a 10-minute corpus and 1 timed epoch")
    p.add_argument("--hours", type=float, default=None, help="hours of audio in the corpus (default 1; --quick 1/6)")
    p.add_argument("--epochs", type=int, default=None, help="timed epochs after the warm-up (default 3; --quick 1)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"a subset of {','.join(PEERS)}")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': stdout)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (corpus, config, logs)")
    args = p.parse_args(argv)
    hours = args.hours if args.hours is not None else (1 / 6 if args.quick else 1.0)
    epochs = args.epochs if args.epochs is not None else (1 if args.quick else 3)
    wanted = [x.strip() for x in args.peers.split(",") if x.strip()]
    bad = [x for x in wanted if x not in PEERS]
    if bad or epochs < 1 or hours <= 0:
        p.error(f"--peers from {','.join(PEERS)} (got {bad}), --epochs >= 1, --hours > 0")

    command = " ".join(shlex.quote(a) for a in [os.path.basename(sys.executable), *sys.argv])
    tmp = tempfile.mkdtemp(prefix="ppspeech-")
    results = {name: Result(name) for name in PEERS}
    try:
        t0 = time.perf_counter()
        corpus = make_corpus(os.path.join(tmp, "corpus"), hours * 3600)
        log(
            f"corpus: {len(corpus.durations)} utterances, {corpus.seconds / 60:.1f} min ({corpus.source}), "
            f"made in {time.perf_counter() - t0:.1f} s"
        )
        config = os.path.join(tmp, "config.py")
        with open(config, "w") as f:
            f.write(
                CONFIG.format(
                    manifest=corpus.manifest, rate=RATE, factors=FACTORS, buf_size=BUF_SIZE, workers=WORKERS, seed=SEED
                )
            )
        setup = Setup(corpus, config)
        log(f"batching {setup.batching}: {len(setup.cut(1))} batches per epoch")
        import torch

        torch.set_num_threads(1)
        makers = {
            "DataLoader": lambda: TunedLoader(setup),  # the forking peers first: before any ZeroMQ thread
            "Lhotse": lambda: LhotseLoader(setup),
            "in-process": lambda: InProcess(setup),
            "ppserver": lambda: LocalServer(setup, os.path.join(tmp, "server.log")),
            "pp-remote": lambda: RemoteServer(setup, tmp),
        }
        for name in PEERS:
            if name not in wanted:
                results[name].error = "skipped (--peers)"
        if "pp-remote" in wanted and os.geteuid() != 0:
            results["pp-remote"].error = "skipped (network namespaces need root)"
            wanted.remove("pp-remote")
        load = os.getloadavg()
        peers = [makers[name]() for name in makers if name in wanted]
        last = run(peers, results, epochs, corpus, setup)
        check_cuts(results, last, setup, epochs)
        stages = stage_costs(setup, 60 if args.quick else 200)
        header = [
            f"command:   {command}",
            f"machine:   nproc {len(os.sched_getaffinity(0))}, {platform.machine()}, "
            f"{platform.system()} {platform.release()}",
            f"software:  {ppserver_version()}, python {platform.python_version()}, numpy {np.__version__}, "
            f"torch {torch.__version__}, lhotse {_version('lhotse')}",
            f"load avg:  {' '.join(f'{x:.2f}' for x in load)} before the run, "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} after (1/5/15 min)",
            f"corpus:    {len(corpus.durations)} FLAC utterances (16 kHz, 1-12 s, {corpus.source}), "
            f"{corpus.seconds / 60:.1f} min of audio",
            f"pipeline:  decode -> speed_perturb {FACTORS} -> fbank 80 -> spec_augment -> padded batches, "
            f"ppserver batching {setup.batching}, Lhotse max_duration {MAX_DURATION:g}",
            f"setup:     {WORKERS} workers each, 1 warm-up + {epochs} timed epochs round-robin; buf_size {BUF_SIZE}, "
            f"prefetch_factor {PREFETCH}, one thread per process",
        ]
        summary = report(results, header, stages, corpus)
        if args.json:
            doc = {
                "command": command,
                "header": header,
                "results": [results[n].as_json() for n in PEERS],
                "stages_ms_per_utt": stages,
                **summary,
            }
            text = json.dumps(doc, indent=2)
            if args.json == "-":
                print(text)
            else:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
    finally:
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    failed = [r for r in results.values() if r.error and not r.error.startswith("skipped")]
    mismatched = [r for r in results.values() if r.check and r.check != "ok"]
    return 1 if failed or mismatched else 0


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
