"""Network namespaces as stand-in hosts for multi-host tests and benchmarks (Linux, root).

One Lab is a server "host" and N worker "hosts", each a network namespace with `lo` up,
linked by veth pairs, plus a link from the root namespace to the server namespace so the
calling process can be the client:

    root  198.19.x.y/30  <->  srv  198.19.x.y+1/30      (client side; x.y picked per lab)
    srv   198.18.I.1/24  <->  hI   198.18.I.2/24        (worker host I = 1, 2, ...)
    root  198.19.u.v/30  <->  hI   198.19.u.v+1/30      (results straight to the client)

All addresses come from the benchmarking range 198.18.0.0/15. Only the root end of the
client link lives in the root namespace; its /30 is chosen so that it overlaps nothing
already configured there, so two labs can coexist.

Processes run inside with `ip netns exec NS ...` (which execs the command, so the Popen pid
is the process itself). A worker host's processes also get a UTS namespace of their own with
the host's name as hostname (`unshare --uts`, which execs too), as a real host has its own
name: their shared-memory host id then differs from the client's and the server's, so array
bytes between them go over the sockets, as between hosts, not through shared memory.
Lab.destroy() kills whatever still runs in the lab's namespaces, then deletes the namespaces
and the root end of the client link.
"""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Union

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IP_TIMEOUT = 10.0


class NetnsError(RuntimeError):
    pass


class NetnsUnavailable(NetnsError):
    """Namespaces cannot be made here (not root, no iproute2, no permission)."""


def ip(*args: str, check: bool = True, timeout: float = IP_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(["ip", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise NetnsUnavailable("the `ip` command (iproute2) is not installed") from None
    if check and res.returncode != 0:
        raise NetnsError(f"`ip {' '.join(args)}` failed ({res.returncode}): {res.stderr.strip()}")
    return res


# ---- /proc helpers (no dependency on the test suite's conftest) ----------------------------
def _proc_table() -> Dict[int, int]:
    parents: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                parents[int(entry)] = int(fields[1])
        except (OSError, IndexError):
            continue
    return parents


def children_of(pid: int) -> List[int]:
    """Live direct and indirect children of pid."""
    parents = _proc_table()
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = sorted(c for c, pp in parents.items() if pp == p)
        out.extend(kids)
        frontier.extend(kids)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_gone(pids: Sequence[int], timeout: float) -> List[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05):
    """Poll predicate until it returns a true value (returned); AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


# ---- processes --------------------------------------------------------------------------
class Proc:
    """A process started in a namespace; stop() always reaps it and its descendants."""

    def __init__(self, name: str, popen: subprocess.Popen, log_path: Optional[str]):
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.pid = popen.pid
        self.is_server = False
        self._kids: List[int] = []

    def running(self) -> bool:
        return self.popen.poll() is None

    def children(self) -> List[int]:
        return children_of(self.pid) if self.running() else []

    def log(self) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def terminate(self) -> None:
        """Send SIGTERM (and SIGCONT, so a stopped process or child sees it); does not wait."""
        self._kids = self.children()
        for pid in self._kids:
            _signal(pid, signal.SIGCONT)
        if self.running():
            _signal(self.pid, signal.SIGCONT)
            _signal(self.pid, signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM, wait up to timeout, then SIGKILL; descendants left behind are killed too."""
        if self.running():
            self.terminate()
        kids = self._kids
        try:
            rc = self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            rc = self.popen.wait(timeout=10)
        for pid in wait_gone(kids, 5.0):
            _signal(pid, signal.SIGKILL)
        wait_gone(kids, 5.0)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return rc


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


# ---- the lab ----------------------------------------------------------------------------
class Lab:
    """A server namespace, `hosts` worker namespaces and a client link from the root namespace."""

    def __init__(self, hosts: int = 2, log_dir: Optional[str] = None):
        self.token = f"{os.getpid()}{random.randrange(256):02x}"
        self.server_ns = f"ppsrv-{self.token}"
        self.host_ns = [f"pph{i + 1}-{self.token}" for i in range(hosts)]
        self.root_if = f"ppc{self.token}"[:15]
        self.client_net: Optional[ipaddress.IPv4Network] = None
        self.log_dir = log_dir
        self.created: List[str] = []
        self.procs: List[Proc] = []
        self.lock = threading.Lock()

    # addresses
    @property
    def server_client_ip(self) -> str:
        """The server namespace's address on the client link (the client connects here)."""
        assert self.client_net is not None
        return str(self.client_net.network_address + 2)

    def server_ip_for(self, host: int) -> str:
        """The server namespace's address on the link to worker host `host` (1-based)."""
        return f"198.18.{host}.1"

    def host_ip(self, host: int) -> str:
        return f"198.18.{host}.2"

    def hostname(self, host: int) -> str:
        """Worker host `host`'s hostname (its processes' UTS namespace)."""
        return self.host_ns[host - 1]

    def host_if(self, host: int) -> str:
        """Name of worker host `host`'s end of its link to the server (inside its namespace)."""
        return "to-srv"

    # lifecycle
    def create(self) -> Lab:
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"network namespaces need root (running as uid {os.geteuid()})")
        try:
            ip("netns", "add", self.server_ns)
        except NetnsUnavailable:
            raise
        except NetnsError as exc:
            raise NetnsUnavailable(f"`ip netns add` failed: {exc}") from None
        self.created.append(self.server_ns)
        try:
            for ns in self.host_ns:
                ip("netns", "add", ns)
                self.created.append(ns)
            for ns in [self.server_ns, *self.host_ns]:
                ip("-n", ns, "link", "set", "lo", "up")
            self.client_net = self._free_client_net()
            ip("link", "add", self.root_if, "type", "veth", "peer", "name", "to-client", "netns", self.server_ns)
            ip("addr", "add", f"{self.client_net.network_address + 1}/30", "dev", self.root_if)
            ip("link", "set", self.root_if, "up")
            ip("-n", self.server_ns, "addr", "add", f"{self.server_client_ip}/30", "dev", "to-client")
            ip("-n", self.server_ns, "link", "set", "to-client", "up")
            for i, ns in enumerate(self.host_ns, start=1):
                ip(
                    "-n",
                    self.server_ns,
                    "link",
                    "add",
                    f"to-h{i}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    self.host_if(i),
                    "netns",
                    ns,
                )
                ip("-n", self.server_ns, "addr", "add", f"{self.server_ip_for(i)}/24", "dev", f"to-h{i}")
                ip("-n", self.server_ns, "link", "set", f"to-h{i}", "up")
                ip("-n", ns, "addr", "add", f"{self.host_ip(i)}/24", "dev", self.host_if(i))
                ip("-n", ns, "link", "set", self.host_if(i), "up")
            wait_for(self._links_ready, 10.0, "the lab's links to come up")
            self._route_hosts_to_client()
        except BaseException:
            self.destroy()
            raise
        return self

    def _route_hosts_to_client(self) -> None:
        """Each worker host gets a link of its own to the client (the root namespace), for the
        results it sends the client directly: cutting a host's link to the server (`host_link`)
        leaves that path up, as when a host reaches its trainer but not the server."""
        assert self.client_net is not None
        for i, ns in enumerate(self.host_ns, start=1):
            net = self._free_client_net(salt=i)
            root_if = f"ppd{self.token}{i}"[:15]
            ip("link", "add", root_if, "type", "veth", "peer", "name", "to-trainer", "netns", ns)
            ip("addr", "add", f"{net.network_address + 1}/30", "dev", root_if)
            ip("link", "set", root_if, "up")
            ip("-n", ns, "addr", "add", f"{net.network_address + 2}/30", "dev", "to-trainer")
            ip("-n", ns, "link", "set", "to-trainer", "up")
            ip("-n", ns, "route", "add", str(self.client_net), "via", str(net.network_address + 1))
        wait_for(
            lambda: all(
                "LOWER_UP" in ip("-n", ns, "-o", "link", "show", "dev", "to-trainer", check=False).stdout
                for ns in self.host_ns
            ),
            10.0,
            "the worker hosts' links to the client to come up",
        )

    def _free_client_net(self, salt: int = 0) -> ipaddress.IPv4Network:
        """A /30 in 198.19.0.0/16 that overlaps no address or route of the root namespace."""
        used = []
        for args in (("-o", "-4", "addr", "show"), ("-4", "route", "show", "table", "all")):
            for line in ip(*args).stdout.splitlines():
                for word in line.split():
                    try:
                        used.append(ipaddress.ip_network(word, strict=False))
                    except ValueError:
                        continue
        used = [n for n in used if n.version == 4 and n.prefixlen > 0]
        base = ipaddress.ip_network("198.19.0.0/16")
        rng = random.Random(f"{self.token}-{salt}")
        for _ in range(1000):
            net = ipaddress.ip_network(f"{base.network_address + rng.randrange(1, 16384) * 4}/30")
            if not any(net.overlaps(u) for u in used):
                return net
        raise NetnsError("no free /30 in 198.19.0.0/16 for the client link")

    def _links_ready(self) -> bool:
        # veth carrier comes up asynchronously; ping is not assumed to exist, so check operstate
        checks = [(None, self.root_if), (self.server_ns, "to-client")]
        for i, ns in enumerate(self.host_ns, start=1):
            checks += [(self.server_ns, f"to-h{i}"), (ns, self.host_if(i))]
        for ns, dev in checks:
            args = (["-n", ns] if ns else []) + ["-o", "link", "show", "dev", dev]
            out = ip(*args, check=False).stdout
            if "state UP" not in out and "LOWER_UP" not in out:
                return False
        return True

    def destroy(self) -> None:
        """Kill what runs in the lab's namespaces, delete them and the client link. Idempotent."""
        self.stop_all()
        for ns in self.created:
            pids = [int(x) for x in ip("netns", "pids", ns, check=False).stdout.split() if x.isdigit()]
            for pid in pids:
                _signal(pid, signal.SIGKILL)
            wait_gone(pids, 5.0)
        ip("link", "del", self.root_if, check=False)
        for ns in reversed(self.created):
            ip("netns", "del", ns, check=False)
        self.created = []

    def __enter__(self) -> Lab:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.destroy()

    # faults
    def host_link(self, host: int, up: bool) -> None:
        ip("-n", self.host_ns[host - 1], "link", "set", self.host_if(host), "up" if up else "down")

    # processes
    def start(
        self, ns: str, argv: List[str], *, name: str, env: Optional[Dict[str, str]] = None, stdout_pipe: bool = False
    ) -> Proc:
        log_path = None
        if self.log_dir:
            log_path = os.path.join(self.log_dir, f"{name}.log")
        log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        try:
            popen = subprocess.Popen(
                ["ip", "netns", "exec", ns, *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else log,
                stderr=log,
                text=stdout_pipe,
                cwd=REPO,
                env={**os.environ, **(env or {})},
            )
        finally:
            if log_path:
                log.close()
        proc = Proc(name, popen, log_path)
        with self.lock:
            self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        """Stop every process started in the lab: all worker hosts at once, then the servers."""
        with self.lock:
            procs, self.procs = self.procs, []
        for group in ([p for p in procs if not p.is_server], [p for p in procs if p.is_server]):
            for p in group:
                p.terminate()
            for p in group:
                try:
                    p.stop(timeout=10.0)
                except Exception as exc:  # keep tearing down
                    print(f"netns: stopping {p.name} failed: {exc}", file=sys.stderr)

    def stop(self, proc: Proc, timeout: float = 10.0) -> Optional[int]:
        with self.lock:
            if proc in self.procs:
                self.procs.remove(proc)
        return proc.stop(timeout=timeout)

    def start_server(
        self, config: str, *, port: int, name: str = "server", ready_timeout: float = 60.0, extra: Sequence[str] = ()
    ) -> ServerHandle:
        """`ppserver serve --bind tcp://0.0.0.0:PORT --insecure --workers 0` in the server namespace."""
        from ppserver.cli import wait_ready

        argv = [
            sys.executable,
            "-m",
            "ppserver",
            "serve",
            config,
            "--bind",
            f"tcp://0.0.0.0:{port}",
            "--insecure",
            "--workers",
            "0",
            *extra,
        ]
        proc = self.start(self.server_ns, argv, name=name, stdout_pipe=True)
        proc.is_server = True
        try:
            printed = wait_ready(proc.popen, timeout=ready_timeout)
        except Exception:
            self.stop(proc)
            raise RuntimeError(f"server did not start:\n{proc.log()[-3000:]}") from None
        bound_port = int(printed.rpartition(":")[2])
        return ServerHandle(self, proc, bound_port)

    def start_workers(
        self,
        host: int,
        config: str,
        *,
        port: int,
        procs: Union[int, str],
        name: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
    ) -> Proc:
        """`ppserver worker --procs N` (or `auto`) in worker host `host` (1-based), connecting across
        its link, under the host's own hostname."""
        argv = [
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostname(host),
            sys.executable,
            "-m",
            "ppserver",
            "worker",
            config,
            "--connect",
            f"tcp://{self.server_ip_for(host)}:{port}",
            "--procs",
            str(procs),
        ]
        return self.start(self.host_ns[host - 1], argv, name=name or f"host{host}", env=env)


class ServerHandle:
    def __init__(self, lab: Lab, proc: Proc, port: int):
        self.lab = lab
        self.proc = proc
        self.port = port
        self.address = f"tcp://{lab.server_client_ip}:{port}"

    def client(self, timeout: float = 30.0):
        from ppclient import Client

        return Client(self.address, timeout=timeout)

    def status(self, timeout: float = 5.0) -> dict:
        with self.client(timeout=timeout) as c:
            return c.status()

    def worker_pids(self) -> List[int]:
        return [w["pid"] for w in self.status()["workers"]]

    def wait_pids(self, pids: Sequence[int], timeout: float, present: bool = True) -> dict:
        """Wait until every pid is registered (present=True) or none is (present=False); returns the status."""
        want = set(pids)

        def check():
            st = self.status()
            have = {w["pid"] for w in st["workers"]}
            ok = want <= have if present else not (want & have)
            return st if ok else None

        what = f"workers {sorted(want)} to {'register' if present else 'be declared dead'}"
        return wait_for(check, timeout, what, interval=0.1)

    def wait_count(self, n: int, timeout: float) -> dict:
        return wait_for(
            lambda: (lambda st: st if st["workers_alive"] >= n else None)(self.status()),
            timeout,
            f"{n} registered workers",
            interval=0.1,
        )

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        return self.lab.stop(self.proc, timeout=timeout)
