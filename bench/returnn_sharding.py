#!/usr/bin/env python3
"""Padding of RETURNN's batches over each reader's seqs: strided shards against RETURNN's contiguous ones.

A RETURNN trainer batches in its DataLoader workers (BatchingIterDataPipe: greedy over the seqs
a worker gets, `max_seqs` and `batch_size` in padded frames) and the DataLoader interleaves the
workers' batches. Which seqs a worker gets is the sharding: RETURNN cuts the epoch's order into
`ranks * loader_workers` contiguous chunks (`Dataset._apply_partition_epoch_and_sharding`, via
`set_sharding`), ppserver deals position i to reader i % (ranks * loader_workers) (strided) by
default. Both over the same `laplace` epoch order, computed by RETURNN's own code:

- `contiguous`: RETURNN's own shards (its Dataset with `_num_shards`/`_shard_index` set);
- `strided`: ppserver's default shards;
- `server-cut`: the server cuts the whole epoch into batches (ppserver's cut, `bucket_window` 1)
  and deals batch j to reader j % readers (a ppserver job with `batching`);
- `unsharded`: RETURNN's batching over the whole epoch (one reader), the floor.

Padding fraction = (padded frames - real frames) / padded frames, over all batches of the epoch.
Interleaving the loader workers' batches changes the order the trainer sees them in, not the
batches, so it is computed per reader (the report also checks this on the interleaved stream).

`--server` also runs the epoch through a real server (NumpyDataset with the same lengths and
ordering, 2 local workers) with one Client per reader for each sharding, batches what each
reader got with the same rule and checks the result is the offline figure.

Usage:  python3 bench/returnn_sharding.py [--seqs 20000] [--bin 1000] [--ranks 2] [--loader-workers 2]
            [--batch-frames 20000] [--max-seqs 100] [--epochs 3] [--server] [--json PATH|-]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Dict, List, Sequence

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "client")]


def lengths(n: int, seed: int = 1) -> np.ndarray:
    """Speech-like lengths in 10 ms frames: log-normal around 12 s, 1 to 35 s."""
    rng = np.random.RandomState(seed)
    return np.clip(rng.lognormal(np.log(1100), 0.55, n), 100, 3500).astype(np.int64)


def returnn_order(lens: np.ndarray, ordering: str, epoch: int, shards: int = 1, shard: int = 0) -> List[int]:
    """The epoch's order (or one shard of it) as RETURNN's Dataset computes it."""
    from returnn.datasets.basic import Dataset

    ds = Dataset(seq_ordering=ordering, _num_shards=shards, _shard_index=shard)
    return [int(i) for i in ds.get_seq_order_for_epoch(epoch, len(lens), lambda i: int(lens[i]))]


def returnn_batches(seq_lens: Sequence[int], batch_frames: int, max_seqs: int) -> List[List[int]]:
    """RETURNN's BatchingIterDataPipe over one stream: a seq joins while seqs * longest <= batch_frames."""
    out: List[List[int]] = []
    batch: List[int] = []
    longest = 0
    for n in seq_lens:
        if len(batch) >= max_seqs:
            out.append(batch)
            batch, longest = [], 0
        if batch and max(longest, n) * (len(batch) + 1) > batch_frames:
            out.append(batch)
            batch, longest = [n], n
        else:
            batch.append(n)
            longest = max(longest, n)
    return out + ([batch] if batch else [])


def padding(batches: Sequence[Sequence[int]]) -> Dict[str, Any]:
    padded = sum(len(b) * max(b) for b in batches)
    real = sum(sum(b) for b in batches)
    return {"batches": len(batches), "padded": padded, "real": real, "padding": (padded - real) / padded}


def strided(order: Sequence[int], readers: int, reader: int) -> List[int]:
    return list(order[reader::readers])


def interleave(streams: Sequence[List[List[int]]]) -> List[List[int]]:
    """A DataLoader's batches: one of each worker's in turn (a worker that ran out is skipped)."""
    out: List[List[int]] = []
    for i in range(max(len(s) for s in streams)):
        out += [s[i] for s in streams if i < len(s)]
    return out


def expected_streams(lens: np.ndarray, args: argparse.Namespace, epoch: int, sharding: str) -> List[List[List[int]]]:
    """The lengths each reader [rank][loader worker] gets: RETURNN's shard, or ppserver's strided lane."""
    ranks, k = args.ranks, args.loader_workers
    order = returnn_order(lens, args.ordering, epoch)
    out = []
    for rank in range(ranks):
        row = []
        for w in range(k):
            if sharding == "contiguous":
                seqs = returnn_order(lens, args.ordering, epoch, ranks * k, rank * k + w)
            else:
                seqs = strided(order, ranks * k, rank + w * ranks)
            row.append([int(lens[i]) for i in seqs])
        out.append(row)
    return out


def offline(lens: np.ndarray, args: argparse.Namespace, epoch: int) -> Dict[str, Any]:
    order = returnn_order(lens, args.ordering, epoch)
    res: Dict[str, Any] = {}
    for name in ("strided", "contiguous"):
        per_rank = [
            interleave([returnn_batches(stream, args.batch_frames, args.max_seqs) for stream in row])
            for row in expected_streams(lens, args, epoch, name)
        ]
        res[name] = padding([b for batches in per_rank for b in batches])
    from ppclient.batching import Batching
    from ppserver.scheduler.cut import cut_epoch

    cut = cut_epoch([int(lens[i]) for i in order], Batching(max_seqs=args.max_seqs, max_frames=args.batch_frames))
    res["server-cut"] = padding([[int(lens[order[p]]) for p in b] for b in cut])
    res["unsharded"] = padding(returnn_batches([int(lens[i]) for i in order], args.batch_frames, args.max_seqs))
    return res


CONFIG = """\
dataset = {{"class": "NumpyDataset", "path": {path!r}, "seq_ordering": {ordering!r}}}
num_workers = 2


def map_seq(seq, **kwargs):
    return seq
"""

READERS = """
import json, sys
import ppclient
address, ranks, k, epoch, sharding = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
clients = [[ppclient.Client(address, rank=r, world_size=ranks, subshard=(w, k), job="shard-" + sharding,
                            drop_last=False, sharding=sharding, timeout=60) for w in range(k)] for r in range(ranks)]
its = [[c.epoch(epoch) for c in row] for row in clients]
got = [[[] for _ in range(k)] for _ in range(ranks)]
live = [(r, w) for r in range(ranks) for w in range(k)]
while live:  # every reader pulls in turn, as the ranks and loader workers do at once
    for r, w in list(live):
        seq = next(its[r][w], None)
        if seq is None:
            live.remove((r, w))
        else:
            got[r][w].append(int(seq["data"].shape[0]))
for row in clients:
    for c in row:
        c.close()
print(json.dumps(got))
"""


def through_server(lens: np.ndarray, args: argparse.Namespace, epoch: int) -> Dict[str, Any]:
    """The same epoch read by ranks * loader_workers clients of a real server, per sharding."""
    from ppserver.cli import wait_ready
    from ppserver.datasets import save_npz

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "client")]))
    out: Dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lens.npz")
        save_npz(path, [{"data": np.zeros((int(n), 1), np.uint8)} for n in lens])
        config = os.path.join(tmp, "config.py")
        with open(config, "w") as f:
            f.write(CONFIG.format(path=path, ordering=args.ordering))
        server = subprocess.Popen(
            [sys.executable, "-m", "ppserver", "serve", config, "--bind", "tcp://127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(tmp, "server.log"), "w"),
            env=env,
            text=True,
        )
        try:
            address = wait_ready(server, 120)
            for sharding in ("strided", "contiguous"):
                got = json.loads(
                    subprocess.run(
                        [sys.executable, "-c", READERS, address, str(args.ranks), str(args.loader_workers)]
                        + [str(epoch), sharding],
                        env=env,
                        check=True,
                        capture_output=True,
                        text=True,
                        timeout=600,
                    ).stdout
                )
                batches = [
                    b
                    for row in got
                    for b in interleave([returnn_batches(s, args.batch_frames, args.max_seqs) for s in row])
                ]
                out[sharding] = padding(batches)
                out[sharding]["streams_as_offline"] = got == expected_streams(lens, args, epoch, sharding)
        finally:
            server.terminate()
            server.wait(30)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=20000)
    p.add_argument("--bin", type=int, default=1000, help="laplace bin size (seq_ordering laplace:.BIN)")
    p.add_argument("--ordering", default=None, help="seq_ordering (default laplace:.BIN)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--batch-frames", type=int, default=20000)
    p.add_argument("--max-seqs", type=int, default=100)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--server", action="store_true", help="also read one epoch through a real server")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    args.ordering = args.ordering or f"laplace:.{args.bin}"
    lens = lengths(args.seqs)
    report: Dict[str, Any] = {"settings": vars(args), "epochs": {}}
    print(
        f"{args.seqs} seqs, {args.ordering}, {args.ranks} ranks x {args.loader_workers} loader workers, "
        f"batch_size {args.batch_frames} frames, max_seqs {args.max_seqs}"
    )
    print(f"{'epoch':>5} {'sharding':>11} {'batches':>8} {'padding':>8}")
    for epoch in range(1, args.epochs + 1):
        res = report["epochs"][epoch] = offline(lens, args, epoch)
        for name, r in res.items():
            print(f"{epoch:>5} {name:>11} {r['batches']:>8} {100 * r['padding']:>7.1f}%")
    if args.server:
        res = report["server"] = through_server(lens, args, 1)
        for name, r in res.items():
            same = r.pop("streams_as_offline") and r == report["epochs"][1][name]
            print(f"server epoch 1 {name:>11} {r['batches']:>8} {100 * r['padding']:>7.1f}%  same as offline: {same}")
            if not same:
                return 1
    if args.json:
        text = json.dumps(report, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
