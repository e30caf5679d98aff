"""The folder of a local server (see local_server.py), shared by the processes of a training and
the server: its lock, the pids of the processes using the server, and the server's state.

    GROUP/lock          flock'ed around every decision (who starts, who joins, when to stop)
    GROUP/users/PID     one per process using the server: the process's start time
    GROUP/server.json   the server: pid, start time, state (starting, ready, failed), address, log
    GROUP/sNNNN/        the server's Unix sockets

A pid is alive while /proc says so and its start time is the one registered (a pid taken
again by another process is not mistaken for it; a zombie has ended).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional

from .errors import Error, UsageError

LOCK_TIMEOUT_S = 30.0


def base_dir() -> str:
    """This user's folder of local servers (their groups and logs), private to the user."""
    path = os.path.join(tempfile.gettempdir(), f"ppserver-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UsageError(
            f"{path} is not a folder private to this user (owner {st.st_uid}, mode {oct(st.st_mode & 0o777)}); "
            "local servers keep their sockets there: remove it, or set TMPDIR to another folder"
        )
    return path


def _path(group: str, name: str) -> str:
    return os.path.join(group, name)


@contextlib.contextmanager
def locked(group: str, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold the group's lock (made if missing). A lock file unlinked while this process waited for
    it (the group was removed) is dropped and the group made again."""
    deadline = time.monotonic() + timeout
    lock = _path(group, "lock")
    while True:
        os.makedirs(group, 0o700, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise Error(f"the lock {lock} was held for over {timeout:g} s") from None
                    time.sleep(0.02)
            try:
                current = os.fstat(fd).st_ino == os.stat(lock).st_ino
            except FileNotFoundError:
                current = False
            if current:
                yield
                return
        finally:
            os.close(fd)  # releases the lock


def started(pid: int) -> Optional[str]:
    """When process `pid` started (so that a pid taken again is not mistaken for it): "" where that
    is unknown; None if there is no such process or it has exited (a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def alive(pid: int, since: Optional[str]) -> bool:
    now = started(pid)
    return now is not None and (not since or not now or now == since)


def register(group: str, pid: int) -> None:
    users = _path(group, "users")
    os.makedirs(users, 0o700, exist_ok=True)
    with open(os.path.join(users, str(pid)), "w") as f:
        f.write(started(pid) or "")


def unregister(group: str, pid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(_path(group, "users"), str(pid)))


def live_users(group: str) -> List[int]:
    """The registered processes that live; the entries of the others are removed."""
    users = _path(group, "users")
    live = []
    for name in os.listdir(users) if os.path.isdir(users) else []:
        try:
            with open(os.path.join(users, name)) as f:
                since = f.read().strip()
            pid = int(name)
        except (OSError, ValueError):
            continue
        if alive(pid, since):
            live.append(pid)
        else:
            unregister(group, pid)
    return sorted(live)


def read_state(group: str) -> Optional[Dict[str, Any]]:
    """The group's server: pid, since, state (starting, ready, failed), address, log, error."""
    try:
        with open(_path(group, "server.json")) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def write_state(group: str, state: Dict[str, Any]) -> None:
    path = _path(group, "server.json")
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


def serving(state: Optional[Dict[str, Any]]) -> bool:
    return state is not None and state.get("state") != "failed" and alive(state["pid"], state.get("since"))


def retire(group: str, pid: int, timeout: float = 5.0) -> bool:
    """For the server `pid`: True once no registered process lives. Its entry is removed then, under
    the lock, so no process joins it any more (one that comes later starts a new server)."""
    with locked(group, timeout):
        if live_users(group):
            return False
        state = read_state(group)
        if state is not None and state.get("pid") == pid:
            os.remove(_path(group, "server.json"))
        return True


def tidy(group: str) -> None:
    """Remove the group's folder if no process uses it and no server serves it."""
    if not os.path.isdir(group):
        return
    with contextlib.suppress(Error, OSError), locked(group, 5.0):
        if live_users(group) or serving(read_state(group)):
            return
        for name in os.listdir(group):
            if name != "lock":
                path = _path(group, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        os.remove(_path(group, "lock"))  # last: a process waiting for the lock sees it unlinked
        os.rmdir(group)
