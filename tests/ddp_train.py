"""One DDP rank of a tiny training from a ppserver (run by tests/test_ddp.py; not a test module).

    python tests/ddp_train.py ADDRESS RANK WORLD MASTER_PORT WORKDIR KILL_AT_STEP LABEL

Trains a linear model on mean-pooled features with DistributedDataParallel (gloo, CPU),
reading batches through ppclient.torch.ServerDataset and torchdata's StatefulDataLoader.
After every step each rank writes a checkpoint (model, optimizer, loader state); a restart
resumes from the newest step that every rank has a checkpoint of, as a trainer would. Every
step's seq tags go to WORKDIR/seen.rankR.LABEL.jsonl. KILL_AT_STEP >= 1 makes the rank SIGKILL
itself after that step's update, before its checkpoint.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

from ppclient.torch import ServerDataset


def newest_complete_step(workdir: str, world: int) -> int:
    steps = {}
    for path in glob.glob(os.path.join(workdir, "ckpt-*.rank*.pt")):
        step, rank = os.path.basename(path)[len("ckpt-") : -len(".pt")].split(".rank")
        steps.setdefault(int(step), set()).add(int(rank))
    complete = [s for s, ranks in steps.items() if len(ranks) == world]
    return max(complete, default=0)


def main() -> int:
    address, workdir, label = sys.argv[1], sys.argv[5], sys.argv[7]
    rank, world, port, kill_at = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # batches of at most 2 seqs and 80 padded frames, cut by the server: batch j is rank j % 2's,
    # and with drop_last every rank gets as many batches, so the ranks take equally many steps
    ds = ServerDataset(address, job="ddp", epoch=1, batch_frames=80, max_seqs=2, timeout=10)  # rank, world: torch
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=1)
    step = newest_complete_step(workdir, world)
    if step:
        ckpt = torch.load(os.path.join(workdir, f"ckpt-{step}.rank{rank}.pt"), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        loader.load_state_dict(ckpt["loader"])
    log = open(os.path.join(workdir, f"seen.rank{rank}.{label}.jsonl"), "w")
    for batch in loader:
        step += 1
        loss = model(batch["data"].mean(dim=1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()  # the gradients are averaged across the ranks here
        opt.step()
        log.write(json.dumps({"step": step, "tags": batch["seq_tag"], "loss": float(loss.detach())}) + "\n")
        log.flush()
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        path = os.path.join(workdir, f"ckpt-{step}.rank{rank}.pt")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict()}, path + ".tmp")
        os.replace(path + ".tmp", path)
    dist.barrier()
    dist.destroy_process_group()
    print("done", step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
