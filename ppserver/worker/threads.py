"""The thread pools of numpy, torch, librosa, ... in worker processes.

Each of these libraries starts one pool per process, as wide as the host. With one worker
process per core that is cores times cores threads fighting over the cores. A worker runs its
pools `worker_threads` wide (default 1): the environment variables the libraries read when
they load are set for the worker before it starts (so before its config is imported), and
torch, which may already be loaded by then, is told as well.
"""

from __future__ import annotations

import os
import sys
from typing import Dict

ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def thread_env(n: int) -> Dict[str, str]:
    """The environment a worker process is started with."""
    return {name: str(n) for name in ENV_VARS}


def limit_threads(n: int) -> None:
    """In a worker process, once its config is loaded: the environment for libraries the mappers
    load later, and torch's pool if the config loaded torch."""
    os.environ.update(thread_env(n))
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "set_num_threads") and torch.get_num_threads() != n:
        torch.set_num_threads(n)
