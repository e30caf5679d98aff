"""Shared fixtures: real `ppserver serve` processes on loopback and helpers to read epochs."""

from __future__ import annotations

import _posixsubprocess
import builtins
import gc
import importlib
import importlib.util
import mmap
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set

import numpy as np
import pytest
import zmq
from netns import children_of, wait_for, wait_gone  # noqa: F401  (re-exported to the tests)

from ppclient import Client
from ppserver.cli import wait_ready
from ppserver.worker.pool import stop_process

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every process a test starts imports this checkout's ppserver and ppclient (in its client folder),
# not installed ones, wherever it runs (pyproject.toml's pythonpath does the same for this one).
os.environ["PYTHONPATH"] = os.pathsep.join(
    [REPO, os.path.join(REPO, "client")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
)

# ---- markers: what a test needs, and a guard that holds the tests to them -----------------------
# Every test is `unit` (pure code: no process, no socket, no RETURNN or PyTorch; `pytest -m unit`
# runs them in seconds) or names what it needs with the other markers; pyproject.toml registers them.
NEEDS = ("processes", "sockets", "netns", "returnn", "torch", "speech")
MARKERS = ("unit", *NEEDS)
# What a unit test may not import, nor a module of unit tests when it is imported (tests/test_markers.py).
HEAVY = ("returnn", "torch", "torchdata")
# The modules a test marked `returnn`, `torch` or `speech` needs: without them it is skipped.
NEEDED_MODULES = {
    "returnn": ("returnn",),
    "torch": ("torch", "torchdata"),
    "speech": ("soundfile", "soxr"),
}


class ImpureTest(AssertionError):
    """A test did what its markers do not admit: raised where it did it, and the test fails even if
    the code under test caught it."""


class _Guard:
    """What the running test (its setup and call) may do, by its markers, and what it did that they
    do not admit. Only what the test's own threads do counts (the main thread and threads started
    since), not threads left by earlier tests."""

    def __init__(self, item: pytest.Item):
        names = {m.name for m in item.iter_markers()}
        self.unit = "unit" in names
        self.allowed = {
            "process": "processes" in names,
            "socket": bool(names & {"processes", "sockets"}),
            "import": not self.unit,
        }
        self.main = threading.get_ident()
        if not hasattr(item, "threads_before"):  # (at its setup: its fixtures' threads are the test's too)
            item.threads_before = {t.ident for t in threading.enumerate()} - {self.main}  # type: ignore[attr-defined]
        self.others = item.threads_before  # type: ignore[attr-defined]
        self.violations: List[str] = []

    def check(self, kind: str, what: str) -> None:
        if self.allowed[kind] or threading.get_ident() in self.others:
            return
        if kind == "import":
            why = f"{what} in a test marked `unit`: mark it with what it needs (`returnn`, `torch`) instead"
        elif self.unit:
            marker = "processes" if kind == "process" else "sockets` or `processes"
            why = f"{what} in a test marked `unit` (pure code, no {kind}): mark it `{marker}` instead"
        elif kind == "process":
            why = f"{what} in a test not marked `processes`"
        else:
            why = f"{what} in a test marked neither `sockets` nor `processes`"
        self.violations.append(why)
        raise ImpureTest(why)


_guard: Optional[_Guard] = None  # the running test's, while its setup and call run


def _guarded(kind: str, what: str, fn: Callable) -> Callable:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _guard is not None:
            _guard.check(kind, what)
        return fn(*args, **kwargs)

    guarded.__wrapped__ = fn  # type: ignore[attr-defined]
    return guarded


def _install_guards() -> None:
    """Every way this process starts a process or opens a socket asks the running test's guard first."""
    subprocess.Popen._execute_child = _guarded("process", "subprocess.Popen", subprocess.Popen._execute_child)  # type: ignore[attr-defined]
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        setattr(os, name, _guarded("process", f"os.{name}", getattr(os, name)))
    _posixsubprocess.fork_exec = _guarded("process", "a spawned process", _posixsubprocess.fork_exec)  # multiprocessing
    socket.socket.__init__ = _guarded("socket", "socket.socket", socket.socket.__init__)  # type: ignore[method-assign]
    # before ZeroMQ makes the context or socket (which __init__ would be too late for)
    zmq.Context.__new__ = _guarded("socket", "zmq.Context", zmq.Context.__new__)  # type: ignore[method-assign]
    zmq.Socket.__new__ = _guarded("socket", "zmq.Socket", zmq.Socket.__new__)  # type: ignore[method-assign]


_real_import, _real_import_module = builtins.__import__, importlib.import_module


def _guarded_import(name: str, globals=None, locals=None, fromlist=(), level: int = 0):
    if _guard is not None and level == 0 and name.partition(".")[0] in HEAVY:
        _guard.check("import", f"import {name}")
    return _real_import(name, globals, locals, fromlist, level)


def _guarded_import_module(name: str, package: Optional[str] = None):
    if _guard is not None and name.partition(".")[0] in HEAVY:
        _guard.check("import", f"import {name}")
    return _real_import_module(name, package)


_install_guards()


def _guarded_phase(item: pytest.Item):
    global _guard
    _guard = guard = _Guard(item)
    if guard.unit:  # (only then: code that looks at builtins, as the config fingerprint does, sees them as they are)
        builtins.__import__, importlib.import_module = _guarded_import, _guarded_import_module
    try:
        result = yield
    except Exception as exc:
        if guard.violations and not isinstance(exc, ImpureTest):
            raise ImpureTest("; ".join(guard.violations)) from exc
        raise
    finally:
        _guard = None
        builtins.__import__, importlib.import_module = _real_import, _real_import_module
    if guard.violations:  # caught by the code under test: the test fails all the same
        raise ImpureTest("; ".join(guard.violations))
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded_phase(item))


def pytest_collection_modifyitems(config, items) -> None:
    """Every test is `unit` or names what it needs, never both; one that needs RETURNN or PyTorch
    is skipped where they are not installed."""
    unmarked, mixed = [], []
    for item in items:
        names = {m.name for m in item.iter_markers()}
        if not names & set(MARKERS):
            unmarked.append(item.nodeid)
        elif "unit" in names and names & set(NEEDS):
            mixed.append(f"{item.nodeid} ({', '.join(sorted(names & set(MARKERS)))})")
        for need, modules in NEEDED_MODULES.items():
            if need in names and not have_modules(*modules):
                item.add_marker(pytest.mark.skip(reason=f"needs {' and '.join(modules)}"))
    problems = []
    if unmarked:
        problems.append(f"tests with none of the markers {', '.join(MARKERS)}:\n  " + "\n  ".join(unmarked))
    if mixed:
        problems.append("tests marked `unit` and with what they need:\n  " + "\n  ".join(mixed))
    if problems:
        raise pytest.UsageError("\n".join(problems) + "\n(see the markers in pyproject.toml)")


def _dev_shm() -> set:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_dev_shm() -> Iterator[None]:
    """Segments are anonymous memfds: after the whole suite (kills included), nothing new may
    be in /dev/shm (the servers, workers, clients, RETURNN's and PyTorch's processes)."""
    before = _dev_shm()
    yield
    new = sorted(name for name in _dev_shm() - before if not held_by_others(os.path.join("/dev/shm", name)))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # beside other test processes: Python's multiprocessing semaphores are theirs (PyTorch's
        # and RETURNN's processes make them; ppserver does not use multiprocessing)
        new = [name for name in new if not name.startswith("sem.mp-")]
    assert not new, f"left in /dev/shm: {new}"


def held_by_others(path: str) -> bool:
    """Whether a live process other than this one maps or holds `path`: a file another program (or
    another process running tests beside this one) still uses, not one left behind."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    return True
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd")):
                return True
        except OSError:
            continue
    return False


def mapped_segments(pid: object = "self") -> Set[int]:
    """The shared-memory segments (memfds named ppshm) a process maps, by inode."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/memfd:ppshm" in line:
                    found.add(int(line.split()[4]))
    except OSError:
        pass
    return found


def open_segments(pid: object = "self") -> Set[int]:
    """The shared-memory segments a process holds open (made, or mapped: a mapping keeps an fd), by inode."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:ppshm"):
                    found.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
            except OSError:
                pass
    except OSError:
        pass
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "call":
        item.call_failed = outcome.get_result().failed


@pytest.fixture(autouse=True)
def no_segment_left_mapped(request) -> Iterator[None]:
    """After each test, neither this process nor a process the test started and left running
    maps a shared-memory segment (memfds never show in /dev/shm, so look at the mappings).
    Not after a failed test, whose traceback may hold its arrays; and what was mapped before the
    test (left by such a failure) is another test's doing."""
    me = os.getpid()
    before = set(children_of(me))
    mapped_before = mapped_segments()
    yield
    if getattr(request.node, "call_failed", False):
        return
    mine = mapped_segments() - mapped_before
    if mine:
        gc.collect()  # arrays in reference cycles
        mine = mapped_segments() - mapped_before
    left: Dict[str, Set[int]] = {"this process": mine} if mine else {}
    for pid in set(children_of(me)) - before:
        segments = mapped_segments(pid)
        if segments:
            left[f"pid {pid} ({_cmdline(pid)})"] = segments
    assert not left, f"shared-memory segments still mapped after the test: {left}"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


# The two data paths of map_seq results, as config lines: straight from the workers to the client
# (through shared memory on one host), and everything through the server over sockets.
DATA_PATHS = {"direct": "", "via-server": "direct_results = False\nshm_mb = 0\n"}


def assert_data_path(log: str, path: str) -> None:
    """A server's (or worker host's) log shows the results took `path`."""
    assert ("sending results directly" in log) == (path == "direct"), path


# The folder the servers and worker hosts the tests start run in (see in_temporary_cwd).
PROC_CWD = REPO


def sitecustomize_env(tmp_path, body: str) -> Dict[str, str]:
    """Environment for started processes that first run `body` (a patch of a test's making, e.g.
    to break shared memory), as Python runs a sitecustomize module on its path at start-up."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(body))
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ["PYTHONPATH"]])}


@pytest.fixture(scope="module")
def in_temporary_cwd(tmp_path_factory) -> Iterator[str]:
    """RETURNN's processes write faulthandler_dump.<pid>.log into their cwd (a process killed hard
    leaves it behind): a module using it runs its tests, and the servers and worker hosts they
    start, in a temporary folder instead of the repository."""
    path = str(tmp_path_factory.mktemp("cwd"))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(path)
        mp.setattr(sys.modules[__name__], "PROC_CWD", path)
        yield path


def have_modules(*names: str) -> bool:
    """Whether these modules can be imported, without importing them (a dotted name imports its
    parent package only): heavy ones such as torch stay out of the collection of every run."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in names)
    except ImportError:  # a parent package that is missing
        return False


def write_config(tmp_path, body: str, name: str = "config.py") -> str:
    path = os.path.join(str(tmp_path), name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(body))
    return path


class ServerProc:
    def __init__(self, proc: subprocess.Popen, address: str, before_ready: List[str]):
        self.proc = proc
        self.address = address
        self.before_ready = before_ready  # stdout lines before `ready` (there are none)

    def client(self, **kw) -> Client:
        kw.setdefault("timeout", 30.0)
        return Client(self.address, **kw)

    def worker_pids(self) -> List[int]:
        with self.client(timeout=10) as c:
            return [w["pid"] for w in c.status()["workers"]]

    def wait_workers(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.client(timeout=10) as c:
                if c.status()["workers_alive"] >= n:
                    return
            time.sleep(0.05)
        raise AssertionError(f"fewer than {n} workers registered within {timeout} s")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@contextmanager
def run_server(
    config: str,
    *,
    workers: Optional[int] = None,
    extra: Optional[List[str]] = None,
    wait_workers: bool = True,
    bind: str = "tcp://127.0.0.1:0",
    log_path: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    new_session: bool = False,
) -> Iterator[ServerProc]:
    """`ppserver serve`, stopped and reaped with every child it had. `new_session`: in a process group
    of its own (the server and its local workers), as a service manager starts it."""
    argv = [sys.executable, "-m", "ppserver", "serve", config, "--bind", bind]
    if workers is not None:
        argv += ["--workers", str(workers)]
    argv += extra or []
    log_file = open(log_path, "a") if log_path else None
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        cwd=PROC_CWD,
        env={**os.environ, **(env or {})},
        start_new_session=new_session,
    )
    kids: List[int] = []
    try:
        try:
            before: List[str] = []
            server = ServerProc(proc, wait_ready(proc, timeout=60, skipped=before), before)
        except RuntimeError as exc:
            if log_path:
                log_file.flush()
                raise RuntimeError(f"{exc}; its log:\n{read(log_path)[-3000:]}") from None
            raise
        if wait_workers and workers != 0:
            server.wait_workers(workers or 1)
        kids = children_of(proc.pid)
        yield server
    finally:
        _reap(proc, kids, log_file)


class Restartable:
    """A server at one address that a test kills with -9 (its process group: the server and its local
    workers, as a crash takes them) and starts again there after a while, as systemd's
    Restart=on-failure does. Made by `restartable`, which reaps every server it started."""

    def __init__(self, stack: ExitStack, config: str, log_dir: str, workers: int):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.config, self.log_dir, self.workers = config, log_dir, workers
        self.starts = 0
        self.srv: Optional[ServerProc] = None
        self._stack = stack
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, config: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> ServerProc:
        self.starts += 1
        self.srv = self._stack.enter_context(
            run_server(
                config or self.config,
                workers=self.workers,
                bind=self.address,
                log_path=self.log(self.starts),
                new_session=True,
                env=env,
            )
        )
        return self.srv

    def log(self, n: int) -> str:
        """The path of the n-th server's log (from 1)."""
        return os.path.join(self.log_dir, f"server{n}.log")

    def kill(self) -> None:
        assert self.srv is not None
        os.killpg(self.srv.proc.pid, signal.SIGKILL)
        self.srv.proc.wait(timeout=10)

    def restart_after(
        self, delay: float = 3.0, config: Optional[str] = None, env: Optional[Dict[str, str]] = None
    ) -> None:
        """Kill the server now and start a new one at its address `delay` seconds later (`env`
        added to its environment), in the background (the client under test goes on meanwhile)."""
        self.join()
        self.kill()

        def later() -> None:
            try:
                time.sleep(delay)
                self.start(config, env)
            except BaseException as exc:  # raised in the test by join()
                self._error = exc

        self._thread = threading.Thread(target=later, name="restart", daemon=True)
        self._thread.start()

    def join(self, timeout: float = 90.0) -> None:
        """Wait for a restart under way; its error, if it failed, is raised here."""
        if self._thread is not None:
            self._thread.join(timeout)
            assert not self._thread.is_alive(), "the server did not restart"
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


@contextmanager
def restartable(config: str, log_dir: str, *, workers: int = 2) -> Iterator[Restartable]:
    """A started Restartable; every server it started is stopped and reaped at the end."""
    with ExitStack() as stack:
        service = Restartable(stack, config, str(log_dir), workers)
        try:
            service.start()
            yield service
        finally:
            if service._thread is not None:
                service._thread.join(90)


def _reap(proc: subprocess.Popen, kids: List[int], log_file) -> None:
    """Stop a started process and every child it had; nothing outlives the test."""
    kids = sorted(set(kids + (children_of(proc.pid) if proc.poll() is None else [])))
    stop_process(proc, timeout=10)
    for pid in wait_gone(kids, 5.0):
        os.kill(pid, signal.SIGKILL)
    if log_file is not None:
        log_file.close()


def collect(it) -> List[dict]:
    return [dict(seq) for seq in it]


def collect_with(it, actions) -> List[dict]:
    """Collect an epoch, calling actions[n]() right after the n-th seq arrived (faults mid-epoch)."""
    got = []
    for seq in it:
        got.append(dict(seq))
        if len(got) in actions:
            actions[len(got)]()
    return got


def assert_same_epoch(got: List[dict], want: List[dict]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["seq_tag"] == w["seq_tag"], (i, g["seq_tag"], w["seq_tag"])
        assert set(g) == set(w), (i, set(g) ^ set(w))
        for k in w:
            if isinstance(w[k], np.ndarray):
                assert g[k].dtype == w[k].dtype, (i, k)
                assert np.array_equal(g[k], w[k]), (i, k, g["seq_tag"])
            elif k == "complete_frac":
                assert g[k] == pytest.approx(w[k], abs=1e-6), (i, k)
            else:
                assert g[k] == w[k], (i, k)


# Set while the reference is computed: a mapper that sleeps only to make an epoch last long enough
# for a fault skips `time.sleep(DELAY)` then (`if not os.environ.get(REFERENCE_RUN)`).
REFERENCE_RUN = "PPTEST_REFERENCE_RUN"

# A map_seq that takes `delay` seconds per seq in the service (so that a fault lands mid-epoch)
# and none in the reference run; fill in with SLOW_MAPPER.format(delay=...).
SLOW_MAPPER = f"""
import os
import time
def map_seq(seq, *, rng, **kwargs):
    if not os.environ.get("{REFERENCE_RUN}"):
        time.sleep({{delay}})
    seq["data"] = seq["data"] + rng.randn(*seq["data"].shape).astype("float32")
    return seq
"""


# Mappers the tests share (config text: numpy_config's mapper_body). Each result depends on the
# epoch's rng, so a seq mapped twice, or by the wrong worker's stream, would show.
SCALE_MAPPER = """
def map_seq(seq, *, rng, **kwargs):
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5)
    return seq
"""
NOISY_MAPPER = """
def map_seq(seq, *, rng, **kwargs):
    seq["data"] = seq["data"] * rng.uniform(0.5, 1.5) + rng.randn(*seq["data"].shape).astype("float32")
    return seq
"""
# A map_seq_stream that merges pairs of seqs and drops every 5th input, so an epoch has fewer seqs
# than the corpus, taking `delay` seconds per input in the service and none in the reference run;
# fill in with STREAM_MAPPER.format(delay=...).
STREAM_MAPPER = (
    """
import os
import time
import numpy as np
def map_seq_stream(seqs, *, rng, **kwargs):
    held = None
    for n, seq in enumerate(seqs):
        if {delay} and not os.environ.get("REFERENCE_RUN"):
            time.sleep({delay})
        if n % 5 == 4:
            continue
        if held is None:
            held = seq
            continue
        yield {{
            "data": np.concatenate([held["data"], seq["data"]]) * rng.uniform(0.5, 1.5),
            "classes": np.concatenate([held["classes"], seq["classes"]]),
            "seq_tag": held["seq_tag"] + "+" + seq["seq_tag"],
            "complete_frac": seq["complete_frac"],
        }}
        held = None
    if held is not None:
        yield held
"""
).replace("REFERENCE_RUN", REFERENCE_RUN)


def reference(config: str, epoch: int, **kw) -> List[Any]:
    """The epoch computed in this process by the same definition the service implements
    (`skipped=True`: with None for each seq map_seq skipped)."""
    from ppserver.config.mappers import output_templates
    from ppserver.config.settings import load_config
    from ppserver.datasets import make_dataset
    from ppserver.reference import reference_epoch

    cfg = load_config(config)
    ds = make_dataset(cfg.dataset, order_seed=cfg.seed)
    templates = output_templates(cfg, ds.data_keys())
    os.environ[REFERENCE_RUN] = "1"
    try:
        out = list(reference_epoch(cfg, ds, epoch, templates, **kw))
    finally:
        del os.environ[REFERENCE_RUN]
    # delivery enforces a non-decreasing complete_frac across the interleaved stream
    best = 0.0
    for seq in out:
        if seq is not None and seq.get("complete_frac") is not None:
            best = max(best, float(seq["complete_frac"]))
            seq["complete_frac"] = best
    return out


def reference_batches(config: str, epoch: int, batching: dict, **kw) -> List[dict]:
    """The epoch's batches as the service cuts and pads them: the reference epoch seq by seq, cut
    by the inputs' lengths (map_seq: the length_key's, or the config's batch_length) and durations
    (the dataset's, or the config's batch_duration) or by the outputs' lengths (map_seq_stream),
    each batch padded as the workers pad it, every seq of a batch with the batch's complete_frac:
    without the seqs map_seq skipped (a batch whose seqs were all skipped is empty, B = 0: see
    empty_batch)."""
    from ppclient import collate
    from ppclient.batching import Batching
    from ppserver.config.mappers import output_templates
    from ppserver.config.settings import load_config
    from ppserver.datasets import make_dataset
    from ppserver.scheduler.cut import cut_epoch

    seqs = reference(config, epoch, skipped=True, **kw)
    cfg = load_config(config)
    b = Batching.from_dict(batching)
    durations = None  # of the inputs, by max_duration: the config's batch_duration, else the dataset's
    if cfg.is_stream:
        key = b.length_key or "data"
        lengths = [s[key].shape[0] if s[key].ndim else 1 for s in seqs]
    else:
        ds = make_dataset(cfg.dataset, order_seed=cfg.seed)
        ds.init_seq_order(epoch, kw.get("seq_list"), kw.get("seq_order"))
        key = b.length_key or ("data" if "data" in ds.data_keys() else next(iter(ds.data_keys())))
        length = cfg.batch_length or (lambda seq: seq[key].shape[0] if seq[key].ndim else 1)
        lengths = [int(length(ds.get_seq(pos))) for pos in range(len(seqs))]
        if b.max_duration is not None:
            fn = cfg.batch_duration
            durations = [float(fn(ds.get_seq(p))) for p in range(len(seqs))] if fn else ds.epoch_durations()
    batches, reach = [], -1
    for batch in cut_epoch(lengths, b, durations):
        reach = max(reach, *batch)  # a batch's complete_frac: the furthest seq's in it or before it
        src = seqs[reach] if cfg.is_stream else ds.get_seq(reach)  # (the input's: a skipped seq has no output)
        frac = {"complete_frac": src["complete_frac"]} if "complete_frac" in src else {}
        kept = [{**seqs[p], **frac} for p in batch if seqs[p] is not None]
        batches.append(collate.pad(kept, dict(b.pad)) if kept else empty_batch(output_templates(cfg, ds.data_keys())))
    return batches


def empty_batch(templates: Dict[str, Any]) -> dict:
    """A batch whose seqs map_seq all skipped, as a trainer gets it: every key of the output templates
    with B = 0 (and 0 for its varying axes), its empty lengths, no tags."""
    out: Dict[str, Any] = {"seq_tag": [], "seq_idx": np.zeros((0,), np.int64)}
    for key, tpl in templates.items():
        shape = [0 if d is None else d for d in tpl["shape"]]
        out[key] = np.zeros([0, *shape], tpl["dtype"])
        if shape:
            out[key + ":lengths"] = np.zeros((0,), np.int64)
    return out


def assert_same_batches(got: List[dict], want: List[dict]) -> None:
    """Batches equal bit for bit: padded arrays, their lengths, tags, positions and complete_frac."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        assert list(g["seq_tag"]) == list(w["seq_tag"]), (i, g["seq_tag"], w["seq_tag"])
        assert set(g) == set(w), (i, set(g) ^ set(w))
        for k in w:
            gv = g[k].numpy() if hasattr(g[k], "numpy") else g[k]
            if k == "complete_frac":
                assert np.allclose(np.asarray(gv), np.asarray(w[k]), atol=1e-6), (i, k)
            elif isinstance(w[k], np.ndarray):
                assert gv.dtype == w[k].dtype and np.array_equal(gv, w[k]), (i, k, g["seq_tag"])
            else:
                assert list(gv) == list(w[k]), (i, k)


def shard(items: List[dict], rank: int, world: int, drop_last: bool = True) -> List[dict]:
    """Rank `rank`'s part of an epoch's seqs or batches (strided)."""
    end = len(items) // world * world if drop_last else len(items)
    return items[rank:end:world]


NUMPY_DATA = """
import numpy as np
_r = np.random.RandomState(7)
_LENS = [int(x) for x in _r.randint(5, 60, size={n})]
SEQS = [{{"data": _r.randn(l, 8).astype("float32"), "classes": np.arange(l // 2 + 1, dtype="int32")}} for l in _LENS]
dataset = {{"class": "NumpyDataset", "seqs": SEQS, "seq_ordering": "{ordering}"}}
"""


def numpy_config(
    tmp_path, mapper_body: str, *, n: int = 40, ordering: str = "default", extra: str = "", name: str = "config.py"
) -> str:
    return write_config(
        tmp_path,
        NUMPY_DATA.format(n=n, ordering=ordering) + textwrap.dedent(mapper_body) + textwrap.dedent(extra),
        name=name,
    )


# A config folder whose served fingerprint each of FINGERPRINT_CHANGES changes while the config
# file stays as it is: its seed comes from the environment, its dataset class from a module next to
# it, its data from an npz file, and its mapper imports a helper module when it runs.
CHANGING_CONFIG = """
import os, sys, time
sys.path.insert(0, os.path.dirname(__file__))
seed = int(os.environ.get("PP_SEED", "0"))
dataset = {{"class": "fp_data:Data", "path": os.path.join(os.path.dirname(__file__), "data.npz")}}
heartbeat_interval = 0.2
heartbeat_timeout = 1.0
def map_seq(seq, *, rng, **kwargs):
    import fp_lazy
    if not os.environ.get("REFERENCE_RUN"):
        time.sleep({delay})
    return fp_lazy.apply(seq, rng)
""".replace("REFERENCE_RUN", REFERENCE_RUN)
CHANGING_FILES = {
    "fp_data.py": "from ppserver.datasets.arrays import NumpyDataset\n\n\nclass Data(NumpyDataset):\n    pass\n",
    "fp_lazy.py": "def apply(seq, rng):\n    seq['data'] = seq['data'] * rng.uniform(0.5, 1.5)\n    return seq\n",
}
FINGERPRINT_CHANGES = ("seed from the environment", "dataset module", "lazily imported module", "data file")


def changing_config(tmp_path, n: int = 40, delay: float = 0.0) -> str:
    """CHANGING_CONFIG with its modules and `n` seqs in its npz file; returns the config's path."""
    for name, text in CHANGING_FILES.items():
        with open(os.path.join(str(tmp_path), name), "w") as f:
            f.write(text)
    _changing_data(tmp_path, n)
    return write_config(tmp_path, CHANGING_CONFIG.format(delay=delay))


def _changing_data(tmp_path, n: int) -> None:
    from ppserver.datasets.arrays import save_npz

    r = np.random.RandomState(7)
    save_npz(
        os.path.join(str(tmp_path), "data.npz"), [{"data": r.randn(5 + i % 7, 4).astype("float32")} for i in range(n)]
    )


def change_fingerprint(tmp_path, change: str, n: int = 40) -> Dict[str, str]:
    """Make one of FINGERPRINT_CHANGES to a changing_config folder; returns the environment a server
    started now runs with."""
    if change == "seed from the environment":
        return {"PP_SEED": "5"}
    if change == "data file":
        _changing_data(tmp_path, n + 1)
        return {}
    name = {"dataset module": "fp_data.py", "lazily imported module": "fp_lazy.py"}[change]
    with open(os.path.join(str(tmp_path), name), "a") as f:
        f.write("EDITED = 1\n")  # code, not a comment
    return {}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def run_worker_host(
    config: str,
    connect: str,
    *,
    procs: int = 2,
    extra: Optional[List[str]] = None,
    log_path: Optional[str] = None,
    prefix: Optional[List[str]] = None,
    stdout: Optional[int] = None,
) -> Iterator[subprocess.Popen]:
    """`ppserver worker` as a separate 'host' process; always stopped and reaped. Its stdout is
    discarded unless `stdout` says otherwise (subprocess.PIPE: read it once it is stopped)."""
    argv = (
        (prefix or [])
        + [sys.executable, "-m", "ppserver", "worker", config, "--connect", connect, "--procs", str(procs)]
        + (extra or [])
    )
    log_file = open(log_path, "a") if log_path else None
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL if stdout is None else stdout,
        stderr=log_file,
        cwd=PROC_CWD,
        env=None,
    )
    try:
        yield proc
    finally:
        _reap(proc, [], log_file)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def run_cli(
    *argv: str,
    module: str = "ppserver",
    timeout: float = 60.0,
    cwd: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
) -> subprocess.CompletedProcess:
    """`python -m ppserver ARGV...` (or another module) run to its end, in the repository unless `cwd`
    says otherwise, with `env` added to this process's environment; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd or REPO,
        env=None if env is None else {**os.environ, **env},
    )


def in_threads(fn: Callable[[int], None], ranks: Iterable[int], timeout: float = 120.0) -> None:
    """fn(rank) for every rank at once, each in a thread of its own (as DDP ranks read at once); the
    first exception of any rank is raised here, and a rank still running after `timeout` fails."""
    errors: List[BaseException] = []

    def main(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"a rank still ran after {timeout} s"


def wait_child(pid: int, timeout: float) -> int:
    """The exit code of forked child `pid`; killed (and an AssertionError) if it runs `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the forked child ran on for {timeout} s")
        time.sleep(0.02)


def run_group(argv: List[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """subprocess.run of a program that starts processes of its own (torchrun and its ranks, a
    trainer and its local server): it runs in a session of its own, and on a timeout the whole
    group is killed, so that nothing it started outlives the test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# A RETURNN training of the tests (`python -m returnn`: PyTorch backend, 2 epochs, a DataLoader worker);
# a part of a config to fill in with .format(model=..., log=...), its paths, as the config it is in.
RETURNN_TRAINING = """
backend = "torch"
device = "cpu"
behavior_version = 24
task = "train"
num_epochs = 2
model = {model!r}
log = [{log!r}]
max_seqs = 3
optimizer = {{"class": "adam"}}
learning_rate = 1e-3
torch_dataloader_opts = {{"num_workers": 1}}
"""
# Its model and step (needs torch and returnn.frontend as rf imported): a step writes a line per
# batch to {tags}: the epoch, the sum of |data| and the seq tags (read with returnn_batches).
RETURNN_L2_STEP = """

def get_model(**_kwargs):
    return torch.nn.Linear(8, 2)


def train_step(*, model, extern_data, **_kwargs):
    x = extern_data["data"].raw_tensor
    with open({tags!r}, "a") as f:
        tags = " ".join(str(t) for t in extern_data["seq_tag"].raw_tensor)
        f.write("%d %.4f %s\\n" % (rf.get_run_ctx().epoch, float(x.abs().sum()), tags))
    rf.get_run_ctx().mark_as_loss(name="l2", loss=(model(x) ** 2).mean())
"""


def returnn_batches(tags_path: str) -> List[tuple]:
    """What RETURNN_L2_STEP wrote: (epoch, sum of |data|, [tags]) per batch."""
    with open(tags_path) as f:
        return [(int(epoch), float(total), tags) for epoch, total, *tags in (line.split() for line in f)]


def run_returnn(config: str, cwd: str, *, timeout: float, env: Optional[Dict[str, str]] = None) -> str:
    """`python -m returnn CONFIG` in `cwd` to its end (killed after `timeout`), which must succeed; its
    output, stdout and stderr together. `env`: its whole environment."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "returnn", str(config)],
        cwd=str(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, out[-4000:]
    return out


def error_line(res: subprocess.CompletedProcess, code: int = 2, *, info: bool = False) -> str:
    """The one line a refused command writes to stderr: it exited with `code` and no traceback.
    `info`: log lines of level INFO before it are no part of the error."""
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not (info and " INFO " in ln)]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def is_shared(array) -> bool:
    """The array is a view of shared memory (not of a message's frame)."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return isinstance(array.obj if isinstance(array, memoryview) else array, mmap.mmap)


def pytest_collection_finish(session) -> None:
    """What collection built (modules, test items) lives until the end: frozen, it stays out of
    every later garbage collection (tests/test_shm.py collects after each of its tests)."""
    gc.collect()
    gc.freeze()
