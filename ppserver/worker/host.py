"""A self-sizing worker host (`ppserver worker --procs auto`) asks the server how many worker
processes it should run.

About once a second the host's supervisor sends HostRequest (its live processes and how many
it can run) over a REQ to the server's control address and starts processes up to the number
the reply names. It never stops one itself: the server retires a process it no longer needs
(the process exits with EXIT_RETIRED once it holds no work, and is not started again).
"""

from __future__ import annotations

import logging
import os
import random
import socket
from typing import List, Optional

import zmq

from ppclient import protocol
from ppclient.keyfiles import ClientKeys
from ppclient.protocol import Channel, Peer

log = logging.getLogger("ppserver.supervisor")

ASK_EVERY_S = 1.0
ANSWER_TIMEOUT_S = 2.0
CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" or "max PERIOD"


def host_cpus() -> int:
    """The CPUs this host gives its workers: those this process may run on (Slurm's and
    taskset's cpusets), at most its cgroup's CPU quota rounded up (a container's CPU limit)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open(CPU_MAX) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(-(-int(quota) // int(period)), 1))
    except (OSError, ValueError):
        pass
    return max(cpus, 1)


class HostAsker:
    def __init__(self, connect: str, keys: Optional[ClientKeys], max_procs: int):
        self.ctx = zmq.Context()
        self.connect = connect
        self.keys = keys
        self.max_procs = max_procs
        self.host = socket.gethostname()
        self.supervisor = f"{self.host}:{os.getpid()}:{random.getrandbits(32):08x}"
        self.silent = 0  # questions in a row without an answer

    def ask(self, pids: List[int]) -> Optional[int]:
        """The processes the server wants here; None: no answer (keep what runs)."""
        req = self.ctx.socket(zmq.REQ)
        req.linger = 0
        if self.keys is not None:
            self.keys.apply(req)
        req.connect(self.connect)
        msg = protocol.HostRequest(supervisor=self.supervisor, host=self.host, pids=pids, max_procs=self.max_procs)
        try:
            req.send_multipart(protocol.encode(msg))
            if not req.poll(int(ANSWER_TIMEOUT_S * 1000)):
                self._silent()
                return None
            reply = protocol.decode(req.recv_multipart(), Peer.WORKER, (Channel.CONTROL,)).msg
        except protocol.ProtocolError as exc:
            log.warning("bad answer to how many processes to run: %s", exc)
            return None
        finally:
            req.close(linger=0)
        if isinstance(reply, protocol.ErrorReply):
            log.warning("the server does not size this host: %s", reply.error)
            return None
        if not isinstance(reply, protocol.HostReply):
            return None
        self.silent = 0
        return min(reply.procs, self.max_procs)

    def _silent(self) -> None:
        self.silent += 1
        if self.silent == 1 or self.silent % 30 == 0:
            log.info("no answer from %s about how many processes to run (%d in a row)", self.connect, self.silent)

    def close(self) -> None:
        self.ctx.destroy(linger=0)
