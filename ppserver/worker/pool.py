"""Starting, watching, respawning and reaping worker processes on one host.

Used by `ppserver serve` for its local workers and by `ppserver worker --procs N`. Children
get SIGTERM when their parent dies (Linux parent-death signal), so a killed server or
worker host process never leaves orphans behind. A child the server retired (the pool
shrank) exits with EXIT_RETIRED and is not started again; `add` starts one more.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

from ppserver.exits import describe_exit

log = logging.getLogger("ppserver.supervisor")

EXIT_REFUSED = 2  # a child that exits with this was refused by the server: do not respawn
EXIT_RETIRED = 3  # a child that exits with this was retired by the server (the pool shrank): do not respawn
_PR_SET_PDEATHSIG = 1
RESPAWN_MIN_INTERVAL = 0.5


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class ProcessPool:
    """N numbered child processes, each started from argv_for(index), with `env` added to this process's."""

    def __init__(
        self,
        argv_for: Callable[[int], List[str]],
        n: int,
        *,
        name: str,
        respawn: bool = True,
        env: Optional[Dict[str, str]] = None,
    ):
        self.argv_for = argv_for
        self.env = env
        self.n = n
        self.name = name
        self.respawn = respawn
        self.procs: List[Optional[subprocess.Popen]] = [None] * n
        self.started_at = [0.0] * n
        self.refused = False
        self.respawns = 0
        self.retired: Set[int] = set()  # slots whose child the server retired: empty until add() fills one

    @property
    def size(self) -> int:
        """The children meant to run (alive, starting or to be respawned)."""
        return self.n - len(self.retired)

    def add(self) -> int:
        """Start one more child, in the lowest retired slot or a new one; returns its index."""
        if self.retired:
            i = min(self.retired)
            self.retired.discard(i)
        else:
            i = self.n
            self.n += 1
            self.procs.append(None)
            self.started_at.append(0.0)
        self._spawn(i)
        return i

    def start(self) -> None:
        for i in range(self.n):
            self._spawn(i)

    def _spawn(self, i: int) -> None:
        self.procs[i] = subprocess.Popen(
            self.argv_for(i),
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr,
            env={**os.environ, **self.env} if self.env else None,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self.started_at[i] = time.monotonic()

    @property
    def pids(self) -> List[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]

    def poll(self) -> List[Tuple[int, int, int]]:
        """Reap exited children and respawn them; returns (index, pid, returncode) of each exit."""
        exited = []
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if p is None:
                if i in self.retired:
                    continue
                if self.respawn and not self.refused and now - self.started_at[i] >= RESPAWN_MIN_INTERVAL:
                    self._spawn(i)
                    self.respawns += 1
                continue
            rc = p.poll()
            if rc is None:
                continue
            exited.append((i, p.pid, rc))
            self.procs[i] = None
            if rc == EXIT_RETIRED:
                self.retired.add(i)
                log.info("%s process %d (pid %d) retired", self.name, i, p.pid)
                continue
            if rc == EXIT_REFUSED:
                self.refused = True
                log.error("%s process %d (pid %d) was refused by the server", self.name, i, p.pid)
                continue
            if self.respawn:
                log.warning("%s process %d (pid %d) exited with %s; respawning", self.name, i, p.pid, describe_exit(rc))
                if now - self.started_at[i] >= RESPAWN_MIN_INTERVAL:
                    self._spawn(i)
                    self.respawns += 1
        return exited

    def alive(self) -> int:
        return sum(1 for p in self.procs if p is not None and p.poll() is None)

    def stop(self, timeout: float = 4.0) -> None:
        """SIGTERM every child, wait up to timeout, SIGKILL the rest, reap all."""
        self.respawn = False
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for p in live:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log.warning("%s pid %d did not stop in %.1f s; killing it", self.name, p.pid, timeout)
                p.kill()
                p.wait(timeout=5)
        self.procs = [None] * self.n


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, wait up to timeout, then SIGKILL; the process is always reaped."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def worker_argv(
    config_path: str,
    connect: str,
    *,
    index: int,
    keys: Optional[str] = None,
    worker_endpoint: Optional[str] = None,
    local: bool = False,
    returnn_dataset: Optional[str] = None,
    config_source: Optional[str] = None,
) -> List[str]:
    """How a worker process is started; `local`: one of the server's own (its exit is reported by index);
    `returnn_dataset`: the config is a RETURNN config, and this the dataset in it; `config_source`: a
    file with the config's content as its starter loaded it, run instead of what `config_path` holds
    now (so a worker started after the file was edited runs the same config as the others)."""
    argv = [sys.executable, "-m", "ppserver.worker", config_path, "--connect", connect, "--index", str(index)]
    if returnn_dataset is not None:
        argv += ["--returnn-dataset", returnn_dataset]
    if config_source is not None:
        argv += ["--config-source", config_source]
    if keys:
        argv += ["--keys", keys]
    if worker_endpoint:
        argv += ["--worker-endpoint", worker_endpoint]
    if local:
        argv.append("--local")
    return argv


def set_process_title(title: str) -> None:
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{os.getpid()}/comm", "w") as f:
                f.write(title[:15])
        except OSError:
            pass
