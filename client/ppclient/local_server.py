"""A ppserver started for one training and gone with it: what the adapters do without an address.

`local_address(config, ...)` gives the address of a server for a config (a ppserver config,
or one dataset of a RETURNN config). The first process of a training starts
`python -m ppserver serve` with its sockets in a private folder (Unix sockets, mode 0700,
so no other user can connect); the training's other processes on this node (DDP ranks)
find that server there and use it too. Every process that uses a server registers its pid
in the folder (local_group.py), and the server (`serve --owners`) stops within a second or so of the last
one's exit, however it ended, kill -9 included: a parent-death signal would follow only the
process that started it. DataLoader workers get the address with the dataset and register
nothing; they end with their rank.

The folder of a server is keyed by the config (path and bytes), the RETURNN dataset, the
job and who shares it: one process alone, or the processes of one launcher (torchrun, a
Slurm step, mp.spawn's parent) and its rendezvous. Only the standard library is used here,
and ppserver is run, never imported: ppclient stays installable alone.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import logging
import os
import select
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Optional, Tuple

from . import endpoints
from .errors import Error, UsageError
from .local_group import (
    alive,
    base_dir,
    live_users,
    locked,
    read_state,
    register,
    serving,
    started,
    tidy,
    unregister,
    write_state,
)

log = logging.getLogger("ppclient.local_server")

__all__ = ["local_address"]

START_TIMEOUT_S = 300.0  # the server loads the config and opens the dataset before it is ready
VERDICT_WAIT_S = 20.0  # a joined process, its server gone while starting: how long the starter has to say why
STOP_WAIT_S = 10.0  # at exit: the server sees its last user gone (0.25 s) and stops its workers (3 s at most)
# torch.distributed's launcher variables: the server and its workers are no rank
RANK_ENV = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
}

Say = Callable[[str], None]


def _key(path: str, data: bytes, returnn_dataset: Optional[str], job: str, shared: bool) -> str:
    me = os.getpid()
    parts = [path, hashlib.sha256(data).hexdigest(), returnn_dataset or "", job]
    if shared:  # the launcher of the training's processes, and their rendezvous
        parts += [f"{os.getppid()}@{started(os.getppid())}"]
        parts += [os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")]
    else:
        parts += [f"{me}@{started(me)}"]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _log_tail_line(path: str) -> str:
    """The line of a failed server's log that says why: its last error line, else its last line."""
    try:
        with open(path, "rb") as f:
            f.seek(max(os.path.getsize(path) - 65536, 0))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(its log cannot be read)"
    errors = [line for line in lines if "error:" in line.lower() or "Error" in line]
    line = (errors or lines or ["(its log is empty)"])[-1]
    return " ".join(line.split())[:600]


def _describe_exit(rc: int) -> str:
    return f"killed by signal {-rc}" if rc < 0 else f"exit code {rc}"


class _Server:
    """This process's use of one local server (`proc`: it started it)."""

    def __init__(self, group: str, what: str, state: Dict[str, Any], proc: Optional[subprocess.Popen]):
        self.group = group
        self.what = what
        self.pid: int = state["pid"]
        self.since: Optional[str] = state.get("since")
        self.address: str = state["address"]
        self.log: str = state["log"]
        self.proc = proc
        self.user = os.getpid()

    def usable(self) -> bool:
        return self.user == os.getpid() and alive(self.pid, self.since)

    def release(self) -> None:
        """At this process's exit: leave the server. The process that started it waits (up to
        STOP_WAIT_S) for it to stop, which it does once no registered process lives: other ranks
        usually end together with this one. If they go on, it goes on for them."""
        if self.user != os.getpid():
            return  # a forked child's copy
        with contextlib.suppress(Error, OSError), locked(self.group, 5.0):
            unregister(self.group, self.user)
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            others = live_users(self.group)
            if others:
                log.info("the local ppserver (pid %d) goes on for pids %s", self.pid, others)
                return
            log.warning("the local ppserver (pid %d) did not stop within %g s; stopping it", self.pid, STOP_WAIT_S)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        tidy(self.group)


_servers: Dict[str, _Server] = {}


def _release_all() -> None:
    for srv in list(_servers.values()):
        srv.release()
    _servers.clear()


atexit.register(_release_all)


def local_address(
    config: str,
    *,
    returnn_dataset: Optional[str] = None,
    job: str,
    shared: bool,
    say: Optional[Say] = None,
    timeout: float = START_TIMEOUT_S,
) -> str:
    """The address of a local server for `config` (`returnn_dataset`: that dataset of a RETURNN config),
    started if this process's training has none yet. `shared`: the training has other processes on
    this node (DDP ranks) that use the same server. `say` logs the start-up (default: logging)."""
    say = say or log.info
    path = os.path.abspath(config)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise UsageError(f"config {config!r} cannot be read: {exc.strerror}") from None
    if importlib.util.find_spec("ppserver") is None:
        raise UsageError(
            "without an address a local ppserver is started, but ppserver is not installed here: install it "
            "beside this ppclient (`pip install ./client .` in its repository), or give the address of a running server"
        )
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if shared and local and world and local != world:
        raise UsageError(
            f"a local ppserver serves the ranks of one node, but this training has {world} ranks, {local} on "
            "this node: start `ppserver serve` (with workers on any hosts) and give its address"
        )
    key = _key(path, data, returnn_dataset, job, shared)
    srv = _servers.get(key)
    if srv is not None and srv.usable():
        return srv.address
    if srv is not None:  # it exited (crashed): reap it, and start a new one
        srv.release()
    what = f"dataset {returnn_dataset!r} of {path}" if returnn_dataset else path
    srv = _open(os.path.join(base_dir(), key), what, path, returnn_dataset, say, timeout)
    _servers[key] = srv
    return srv.address


def _open(group: str, what: str, path: str, returnn_dataset: Optional[str], say: Say, timeout: float) -> _Server:
    """Join the group's server, or start one; return once it is ready."""
    deadline = time.monotonic() + timeout
    me = os.getpid()
    proc = None
    with locked(group):
        register(group, me)
        state = read_state(group)
        if not serving(state):
            proc, state = _spawn(group, path, returnn_dataset)
    assert state is not None
    try:
        if proc is not None:
            say(f"starting a local ppserver for {what} (pid {proc.pid}, log {state['log']})")
            state = _wait_started(group, proc, state, what, deadline)
            say(
                f"local ppserver for {what} ready at {state['address']} in {state['took']:.1f} s "
                f"(pid {proc.pid}, log {state['log']})"
            )
        else:
            state = _wait_joined(group, state, what, deadline)
            say(f"using the local ppserver for {what} at {state['address']} (pid {state['pid']}, log {state['log']})")
    except BaseException:
        with contextlib.suppress(Error, OSError), locked(group, 5.0):
            unregister(group, me)
        tidy(group)  # whoever leaves a failed start last removes the folder
        raise
    return _Server(group, what, state, proc)


def _spawn(group: str, path: str, returnn_dataset: Optional[str]) -> Tuple[subprocess.Popen, Dict[str, Any]]:
    """Start the server (under the group's lock) and publish it as starting."""
    sockets = tempfile.mkdtemp(prefix="s", dir=group)
    control = f"ipc://{sockets}/control"
    if endpoints.ipc_fits(f"{sockets}/workers"):  # else (a long temp folder) loopback TCP
        bind = ["--bind", control, "--worker-bind", f"ipc://{sockets}/workers"]
    else:
        os.rmdir(sockets)
        control, bind = "", ["--bind", "tcp://127.0.0.1:0"]
    source = [path] if returnn_dataset is None else ["--returnn-config", path, "--dataset", returnn_dataset]
    logs = os.path.join(base_dir(), "logs")
    os.makedirs(logs, 0o700, exist_ok=True)
    label = returnn_dataset or os.path.splitext(os.path.basename(path))[0]
    log_path = os.path.join(logs, f"{label}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log")
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV and not k.startswith("TORCHELASTIC_")}
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ppserver", "serve", *source, *bind, "--owners", group],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            env=env,
            text=True,
            # not in the trainer's process group: a signal to that group (Ctrl-C, a kill -9 of the group)
            # reaches the trainer, and the server stops by itself once it sees its users gone
            start_new_session=True,
        )
    state = {
        "pid": proc.pid,
        "since": started(proc.pid),
        "state": "starting",
        "address": control,
        "log": log_path,
        "by": os.getpid(),
        "by_since": started(os.getpid()),
    }
    write_state(group, state)
    return proc, state


def _wait_started(
    group: str, proc: subprocess.Popen, state: Dict[str, Any], what: str, deadline: float
) -> Dict[str, Any]:
    """Read the server's `ready ADDRESS` line; a server that exits or stalls first is an Error in one line."""
    assert proc.stdout is not None
    start = time.monotonic()
    failure = None
    try:
        while failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.terminate()
                failure = f"not ready within {time.monotonic() - start:.0f} s"
                break
            if not select.select([proc.stdout], [], [], min(left, 1.0))[0]:
                continue
            line = proc.stdout.readline()
            if line.startswith("ready "):
                state = dict(state, state="ready", address=line.split()[1], took=time.monotonic() - start)
                with locked(group):
                    write_state(group, state)
                return state
            if not line:
                try:
                    rc = proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
                failure = _describe_exit(rc)
    finally:
        proc.stdout.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    message = (
        f"the local ppserver for {what} failed to start ({failure}): {_log_tail_line(state['log'])} "
        f"(its log: {state['log']})"
    )
    with contextlib.suppress(Error, OSError), locked(group, 5.0):
        write_state(group, dict(state, state="failed", error=message))
    raise Error(message)


def _wait_joined(group: str, state: Dict[str, Any], what: str, deadline: float) -> Dict[str, Any]:
    """Wait for the server another process of the training started. A server that fails is the
    starter's one line (it alone learns the exit code): a server gone while its starter lives
    waits for that line (VERDICT_WAIT_S at most)."""
    gone_at: Optional[float] = None
    while True:
        now = read_state(group)
        if now is not None and now.get("pid") == state["pid"]:
            if now.get("state") == "ready":
                return now
            if now.get("state") == "failed":
                raise Error(now.get("error") or f"the local ppserver for {what} failed to start")
            state = now
        if not alive(state["pid"], state.get("since")):
            gone_at = time.monotonic() if gone_at is None else gone_at
            by = state.get("by")
            starter = isinstance(by, int) and alive(by, state.get("by_since"))
            if not starter or time.monotonic() - gone_at > VERDICT_WAIT_S:
                raise Error(
                    f"the local ppserver for {what} (pid {state['pid']}, started by pid {by}) exited before it was "
                    f"ready: {_log_tail_line(state['log'])} (its log: {state.get('log')})"
                )
        if time.monotonic() > deadline:
            raise Error(
                f"the local ppserver for {what} (pid {state['pid']}, started by pid {state.get('by')}) was not "
                f"ready in time (its log: {state.get('log')})"
            )
        time.sleep(0.05)
