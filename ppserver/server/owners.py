"""`serve --owners DIR`: a server that ends with the processes using it (ppclient's local servers).

The processes of a training that use a local server register their pids in DIR (see
ppclient.local_group). A thread looks at them every WATCH_S; once none lives, the server's
entry is removed under the group's lock (so no process joins it any more) and the server
stops as on SIGTERM: its workers, shared memory and sockets go with it. This also covers a
trainer killed with -9, and the DDP rank that started a server dying before the others.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading

from ppclient import Error, local_group
from ppclient.throttle import Throttled

log = logging.getLogger("ppserver.owners")

WATCH_S = 0.25


class OwnerWatch:
    def __init__(self, group: str, bind: str):
        self.group = os.path.abspath(group)
        # the starter's private folder of this server's sockets, if it bound them there
        path = bind[len("ipc://") :] if bind.startswith("ipc://") else ""
        self.sockets = os.path.dirname(path) if os.path.dirname(os.path.dirname(path)) == self.group else None
        self._stop = threading.Event()
        self._failed = Throttled(log, "cannot look at the processes using this server", interval=10.0)
        self._thread = threading.Thread(target=self._run, name="owners", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                gone = local_group.retire(self.group, os.getpid())
            except (Error, OSError) as exc:
                self._failed.hit(f"in {self.group}: {exc}")
                continue
            if gone:
                log.info("no process registered in %s lives any more: stopping", self.group)
                self._remove_sockets()  # nobody connects any more
                os.kill(os.getpid(), signal.SIGTERM)  # as a supervisor stops it (before serving: at once)
                return

    def ready(self, address: str) -> None:
        """Tell the processes waiting for this server that it serves (the one that started it says
        so too, unless it died meanwhile)."""
        try:
            with local_group.locked(self.group, 5.0):
                state = local_group.read_state(self.group)
                if state is not None and state.get("pid") == os.getpid() and state.get("state") != "ready":
                    local_group.write_state(self.group, dict(state, state="ready", address=address))
        except (Error, OSError) as exc:
            log.warning("cannot say in %s that this server is ready: %s", self.group, exc)

    def _remove_sockets(self) -> None:
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)

    def close(self) -> None:
        """After the server's shutdown: its sockets' folder, and the group's if no one else uses it."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * WATCH_S + 5)
        self._remove_sockets()
        local_group.tidy(self.group)
