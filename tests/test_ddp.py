"""DDP on CPU (gloo, 2 processes) reading the server's batches: a rank is killed mid-epoch and both resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

import pytest
from conftest import REPO, SCALE_MAPPER, free_port, numpy_config, reference_batches, run_server, shard

from ppserver.worker.pool import stop_process

# torch runs in the ranks' processes only: this module does not import it
pytestmark = [pytest.mark.processes, pytest.mark.torch]

MAPPER = SCALE_MAPPER
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_train.py")


def launch(address: str, workdir: str, label: str, kill_at: Dict[int, int]) -> List[subprocess.Popen]:
    port = free_port()
    return [
        subprocess.Popen(
            [sys.executable, SCRIPT, address, str(rank), "2", str(port), workdir, str(kill_at.get(rank, -1)), label],
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(workdir, f"rank{rank}.log"), "a"),
            text=True,
            cwd=REPO,
        )
        for rank in range(2)
    ]


def wait_all(procs: List[subprocess.Popen], timeout: float) -> List[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            stop_process(p, timeout=5)
            codes.append(None)
    return codes


def test_ddp_training_survives_a_killed_rank_and_sees_each_seq_once(tmp_path):
    cfg = numpy_config(tmp_path, MAPPER, n=41, ordering="random", extra="buf_size = 2\n")
    want = reference_batches(cfg, 1, {"max_frames": 80, "max_seqs": 2})
    workdir = str(tmp_path)
    with run_server(cfg, workers=2) as srv:
        first = launch(srv.address, workdir, "first", kill_at={1: 5})
        codes = wait_all(first, timeout=90)
        assert codes[1] == -9  # rank 1 killed itself after step 5
        assert codes[0] != 0  # rank 0 cannot go on without it (gloo fails, or it was stopped)
        resumed = launch(srv.address, workdir, "resumed", kill_at={})
        codes = wait_all(resumed, timeout=90)
        outs = [p.stdout.read() for p in resumed]
        logs = {r: open(os.path.join(workdir, f"rank{r}.log")).read()[-2000:] for r in range(2)}
        assert codes == [0, 0], (codes, logs)
    last = [int(out.split()[1]) for out in outs]
    assert last[0] == last[1] == len(want) // 2  # equally many steps: the epoch's batches, half each
    for rank in range(2):
        before, after = (
            [json.loads(line) for line in open(os.path.join(workdir, f"seen.rank{rank}.{label}.jsonl"))]
            for label in ("first", "resumed")
        )
        # the restart resumed from the newest step both ranks had checkpointed (4: rank 1 died
        # after step 5, before its checkpoint); steps after it were seen again, as in any
        # checkpointed training, and count once
        resumed_at = after[0]["step"] - 1
        assert resumed_at == 4 and [e["step"] for e in after] == list(range(5, last[rank] + 1))
        steps = [e for e in before if e["step"] <= resumed_at] + after
        # the rank's batches of the epoch's cut, none lost or repeated
        assert [e["tags"] for e in steps] == [b["seq_tag"] for b in shard(want, rank, 2)], rank
