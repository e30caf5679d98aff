"""worker_threads: the thread pools a worker's mapper sees (the environment numpy, MKL and OpenBLAS
read, and torch's), for the server's local workers and a worker host's, whatever the environment
they were started in says."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
from conftest import collect, numpy_config, run_server, run_worker_host

pytestmark = [pytest.mark.processes, pytest.mark.torch]

MAPPER = """
import os
import numpy as np
{top}

def map_seq(seq, **kwargs):
    import torch  # loaded by the mapper, or already by the config
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    seq["threads"] = np.array([int(os.environ.get(n, "-1")) for n in names] + [torch.get_num_threads()], "int32")
    return seq

map_outputs = {{
    "data": {{"shape": (None, 8), "dtype": "float32"}},
    "classes": {{"shape": (None,), "dtype": "int32"}},
    "threads": {{"shape": (4,), "dtype": "int32"}},
}}
"""


@pytest.mark.parametrize(
    "setting, top, remote",
    [("", "", False), ("worker_threads = 3\n", "import torch", False), ("worker_threads = 2\n", "", True)],
    ids=["default-local", "3-torch-in-config-local", "2-worker-host"],
)
def test_mapper_sees_worker_threads(tmp_path, monkeypatch, setting, top, remote):
    # what a shell may have exported for the trainer: the setting wins in the workers
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "7")
    cfg = numpy_config(tmp_path, MAPPER.format(top=top), n=6, extra=setting)
    want = int(setting.split("=")[1]) if setting else 1
    with run_server(cfg, workers=0 if remote else 2, wait_workers=not remote) as srv:
        with run_worker_host(cfg, srv.address, procs=2) if remote else nullcontext():
            srv.wait_workers(2)
            with srv.client() as c:
                got = collect(c.epoch(1))
    assert len(got) == 6
    assert all(seq["threads"].tolist() == [want] * 4 for seq in got), [seq["threads"] for seq in got]
