"""One DDP rank of a tiny training that starts no server itself (run by tests/test_local_server.py
under torchrun; not a test module).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_local.py CONFIG OUT

Every rank makes ppclient.torch.ServerDataset(config=CONFIG): the ranks share one local server,
which the first of them starts. Trains a linear model on mean-pooled features with
DistributedDataParallel (gloo, CPU) for one epoch, read through a StatefulDataLoader with one
worker, and writes OUT.rankR.json: the address read from, this process's pid and each step's tags.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

from ppclient.torch import ServerDataset


def main() -> int:
    config, out = sys.argv[1], sys.argv[2]
    logging.basicConfig(level=logging.INFO, format=f"rank {os.environ['RANK']}: %(message)s")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = ServerDataset(config=config, job="ddp", batch_frames=80, max_seqs=2, timeout=30)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=1)
    steps = []
    for batch in loader:
        loss = model(batch["data"].mean(dim=1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps.append(batch["seq_tag"])
    dist.barrier()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"address": ds.address, "pid": os.getpid(), "steps": steps}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
