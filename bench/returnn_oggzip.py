#!/usr/bin/env python3
"""RETURNN's most common ASR input, an OggZipDataset computing log-mel features, moved to ppserver.

Three pipelines over the same zip (synthesized utterances, Ogg) and the same dataset dict
(`"audio": {"features": "log_mel_filterbank", "num_feature_filters": 80}`), with the same
identity TensorDict map_seq, on the same machine:

  RETURNN          PostprocessingDataset(num_workers=W, buf_size=10) over the dict, read with
                   init_seq_order / load_seqs / get_data: its features run in the main process
  ppserver         the dict as the trainer's config holds it, class ServerDataset instead of
                   PostprocessingDataset, served by `ppserver serve --returnn-config FILE --dataset
                   train` with W local workers: the features run in the workers
  ppserver-reader  the same server with "audio_in_workers": False (its own config format): the
                   features run in the server's reader thread, as before they moved

Each pipeline runs one warm-up epoch (processes start, librosa's numba functions compile),
then the timed epochs run round-robin, one at a time. seqs/s are totals over the timed epochs;
the ratios are against RETURNN in the same run. Needs RETURNN, soundfile and librosa.
ppserver's workers run numpy's thread pools at 1 thread (worker_threads); `--threads 1` sets
OMP/OpenBLAS/MKL_NUM_THREADS=1 for every process, so that RETURNN's process (and the server's
reader) gets no advantage or handicap from its own BLAS threads either.

Usage:  python3 bench/returnn_oggzip.py [--seqs N] [--epochs N] [--workers W] [--threads N] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from typing import Any, Callable, Dict, List

AUDIO = {"features": "log_mel_filterbank", "num_feature_filters": 80, "window_len": 0.025, "step_len": 0.010}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def make_zip(folder: str, seqs: int) -> str:
    """seqs utterances of 1 to 4 s: chirps with noise, 16 kHz Ogg, and the zip's .txt."""
    import numpy as np
    import soundfile

    rng = np.random.RandomState(0)
    path = os.path.join(folder, "corpus.zip")
    entries = []
    with zipfile.ZipFile(path, "w") as z:
        for i in range(seqs):
            n = int(16000 * rng.uniform(1.0, 4.0))
            t = np.arange(n) / 16000
            signal_ = 0.3 * np.sin(2 * np.pi * (150 + 400 * rng.rand() * t) * t) + 0.05 * rng.randn(n)
            buf = io.BytesIO()
            soundfile.write(buf, signal_.astype("float32"), 16000, format="OGG")
            z.writestr(f"corpus/utt{i}.ogg", buf.getvalue())
            entries.append({"text": f"utterance {i}", "duration": n / 16000, "file": f"utt{i}.ogg"})
        z.writestr("corpus.txt", repr(entries))
    return path


def dataset_dict(zip_path: str) -> Dict[str, Any]:
    return {"class": "OggZipDataset", "path": zip_path, "audio": AUDIO, "targets": None, "seq_ordering": "random"}


MAPPERS = """
def identity(tdict, **kwargs):
    return tdict
"""


def _cpu_of(pid: int) -> float:
    """utime + stime of one process in seconds (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> List[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == str(pid):
                        out.append(int(p))
            except OSError:
                pass
    return out


class Returnn:
    name = "RETURNN"

    def __init__(self, spec: Dict[str, Any], workers: int):
        import oggzip_mappers
        from returnn.datasets.basic import init_dataset

        self.ds = init_dataset(
            {
                "class": "PostprocessingDataset",
                "dataset": spec,
                "map_seq": oggzip_mappers.identity,
                "num_workers": workers,
                "buf_size": 10,
            }
        )

    def epoch(self, epoch: int) -> int:
        ds = self.ds
        ds.init_seq_order(epoch=epoch)
        i = 0
        while ds.is_less_than_num_seqs(i):
            ds.load_seqs(i, i + 1)
            ds.get_data(i, "data")
            i += 1
        return i

    def cpu(self) -> Dict[str, float]:
        """CPU seconds so far: this process (where the features run) and RETURNN's workers."""
        return {"main": _cpu_of(os.getpid()), "workers": sum(_cpu_of(p) for p in _children(os.getpid()))}

    def close(self) -> None:
        self.ds.finish_epoch(free_resources=True)


class Server:
    def __init__(self, name: str, argv: List[str], log_path: str):
        from ppclient import Client
        from ppserver.cli import wait_ready

        self.name = name
        with open(log_path, "w") as server_log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ppserver", "serve", *argv, "--bind", "tcp://127.0.0.1:0"],
                stdout=subprocess.PIPE,
                stderr=server_log,
                text=True,
            )
        try:
            self.client = Client(wait_ready(self.proc, timeout=120), timeout=120)
        except BaseException:
            self.close()
            raise

    def epoch(self, epoch: int) -> int:
        return sum(1 for _ in self.client.epoch(epoch))

    def cpu(self) -> Dict[str, float]:
        """CPU seconds so far: the server (its reader) and its workers."""
        return {"main": _cpu_of(self.proc.pid), "workers": sum(_cpu_of(p) for p in _children(self.proc.pid))}

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=300, help="utterances in the zip (default 300)")
    ap.add_argument("--epochs", type=int, default=2, help="timed epochs per pipeline (default 2)")
    ap.add_argument("--workers", type=int, default=2, help="RETURNN's num_workers and ppserver's (default 2)")
    ap.add_argument("--threads", type=int, help="OMP/OpenBLAS/MKL_NUM_THREADS of every process (default: unset)")
    ap.add_argument("--json", help="also write the results as JSON (- : stdout)")
    args = ap.parse_args()
    if args.threads is not None:  # before numpy is imported (here, and by the processes started)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(args.threads)
    try:
        import librosa  # noqa: F401
        import returnn  # noqa: F401
        import soundfile  # noqa: F401
    except ImportError as exc:
        log(f"needs RETURNN, soundfile and librosa: {exc}")
        return 2
    folder = tempfile.mkdtemp(prefix="ppserver-oggzip-")
    sys.path.insert(0, folder)
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, *filter(None, [os.environ.get("PYTHONPATH")])])
    pipelines: List[Any] = []
    try:
        with open(os.path.join(folder, "oggzip_mappers.py"), "w") as f:
            f.write(MAPPERS)
        log(f"writing {args.seqs} utterances ...")
        spec = dataset_dict(make_zip(folder, args.seqs))
        returnn_config = os.path.join(folder, "train.config")
        with open(returnn_config, "w") as f:
            f.write(
                textwrap.dedent(
                    f"""\
                    #!rnn.py
                    import oggzip_mappers
                    from ppclient.returnn import ServerDataset
                    backend = "torch"
                    train = {{"class": ServerDataset, "dataset": {spec!r}, "map_seq": oggzip_mappers.identity,
                             "num_workers": {args.workers}, "buf_size": 10}}
                    """
                )
            )
        own_config = os.path.join(folder, "reader.py")
        with open(own_config, "w") as f:
            f.write(
                textwrap.dedent(
                    f"""\
                    import oggzip_mappers
                    mapper_api = "returnn"
                    dataset = {{"class": "returnn", "dataset": {spec!r}, "audio_in_workers": False}}
                    map_seq = oggzip_mappers.identity
                    num_workers = {args.workers}
                    buf_size = 10
                    """
                )
            )
        makers: List[Callable[[], Any]] = [
            lambda: Returnn(spec, args.workers),
            lambda: Server(
                "ppserver",
                ["--returnn-config", returnn_config, "--dataset", "train"],
                os.path.join(folder, "server.log"),
            ),
            lambda: Server("ppserver-reader", [own_config], os.path.join(folder, "server-reader.log")),
        ]
        for make in makers:
            pipeline = make()
            pipelines.append(pipeline)
            t0 = time.perf_counter()
            n = pipeline.epoch(1)
            log(f"{pipeline.name}: warm-up epoch of {n} seqs in {time.perf_counter() - t0:.1f} s")
        seconds: Dict[str, float] = {p.name: 0.0 for p in pipelines}
        seqs: Dict[str, int] = {p.name: 0 for p in pipelines}
        cpu: Dict[str, Dict[str, float]] = {p.name: {"main": 0.0, "workers": 0.0} for p in pipelines}
        for epoch in range(2, 2 + args.epochs):
            for pipeline in pipelines:
                c0, t0 = pipeline.cpu(), time.perf_counter()
                seqs[pipeline.name] += pipeline.epoch(epoch)
                seconds[pipeline.name] += time.perf_counter() - t0
                for k, v in pipeline.cpu().items():
                    cpu[pipeline.name][k] += v - c0[k]
        rates = {name: seqs[name] / seconds[name] for name in seqs}
        cpu_ms = {name: {k: 1000 * v / seqs[name] for k, v in c.items()} for name, c in cpu.items()}
        base = rates["RETURNN"]
        threads = "unset" if args.threads is None else args.threads
        print(
            f"{args.seqs} utterances (1-4 s, Ogg), log-mel 80, {args.workers} workers, {args.epochs} timed epochs, "
            f"BLAS threads {threads}"
        )
        for name, rate in rates.items():
            c = cpu_ms[name]
            print(
                f"  {name:<16} {rate:8.1f} seqs/s   x{rate / base:.2f} vs RETURNN   CPU ms per seq: "
                f"{c['main']:.2f} in the reading process, {c['workers']:.2f} in the workers"
            )
        if args.json:
            text = json.dumps(
                {
                    "rates": rates,
                    "cpu_ms_per_seq": cpu_ms,
                    "seqs": args.seqs,
                    "workers": args.workers,
                    "epochs": args.epochs,
                    "threads": threads,
                }
            )
            if args.json == "-":
                print(text)
            else:
                with open(args.json, "w") as f:
                    f.write(text + "\n")
        return 0
    finally:
        for pipeline in pipelines:
            pipeline.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
