"""The markers tell the truth: a `unit` test starts no process, opens no socket and imports neither
RETURNN nor PyTorch (tests/conftest.py's guard fails it where it does), a test that starts a process
says so, every test is `unit` or names what it needs, and no module of unit tests imports RETURNN
or PyTorch when it is collected."""

from __future__ import annotations

import glob
import importlib
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
from typing import List

import conftest
import pytest
import zmq
from conftest import HEAVY, REPO, ImpureTest


class FakeItem:
    """As much of a pytest item as the collection rule and the guard look at."""

    def __init__(self, nodeid: str, *markers: str):
        self.nodeid = nodeid
        self.markers = [getattr(pytest.mark, m) for m in markers]

    def iter_markers(self):
        return iter(m.mark for m in self.markers)

    def add_marker(self, marker) -> None:
        self.markers.append(marker)


@pytest.mark.unit
def test_every_test_is_unit_or_names_what_it_needs_and_never_both():
    conftest.pytest_collection_modifyitems(None, [FakeItem("a", "unit"), FakeItem("b", "processes", "returnn")])
    with pytest.raises(pytest.UsageError, match=r"none of the markers unit, processes.*\n  t::bare") as info:
        conftest.pytest_collection_modifyitems(None, [FakeItem("t::bare"), FakeItem("t::ok", "sockets")])
    assert "t::ok" not in str(info.value)
    with pytest.raises(
        pytest.UsageError, match=r"marked `unit` and with what they need:\n  t::both \(processes, unit\)"
    ):
        conftest.pytest_collection_modifyitems(None, [FakeItem("t::both", "unit", "processes")])


@pytest.mark.unit
def test_the_guard_refuses_what_the_markers_do_not_admit(monkeypatch):
    """Guards of made-up tests in place of this one's: each refusal comes before the process, socket
    or import is made, so that this unit test makes none of them."""

    def guard(*markers: str) -> conftest._Guard:
        g = conftest._Guard(FakeItem("t", *markers))  # type: ignore[arg-type]
        monkeypatch.setattr(conftest, "_guard", g)
        return g

    g = guard("unit")
    for attempt, what in (
        (lambda: subprocess.run(["true"], timeout=10), r"subprocess\.Popen in a test marked `unit` .* `processes`"),
        (lambda: os.system("true"), r"os\.system in a test marked `unit`"),
        (lambda: socket.socket(), r"socket\.socket in a test marked `unit`"),
        (lambda: socket.create_connection(("127.0.0.1", 9), timeout=1), r"socket\.socket in a test marked `unit`"),
        (lambda: zmq.Context(), r"zmq\.Context in a test marked `unit` .* `sockets` or `processes`"),
        (lambda: __import__("torch"), r"import torch in a test marked `unit`: .* \(`returnn`, `torch`\)"),
        (lambda: importlib.import_module("returnn.datasets"), r"import returnn\.datasets in a test marked `unit`"),
    ):
        with pytest.raises(ImpureTest, match=what):
            attempt()
    assert len(g.violations) == 7
    g = guard("sockets", "torch")
    with pytest.raises(ImpureTest, match=r"subprocess\.Popen in a test not marked `processes`"):
        subprocess.run(["true"], timeout=10)
    for kind in ("socket", "import"):  # admitted (asked of the guard only: this test opens no socket)
        g.check(kind, "x")
    guard("returnn")
    with pytest.raises(ImpureTest, match=r"zmq\.Context in a test marked neither `sockets` nor `processes`"):
        zmq.Context()
    g = guard("processes")
    for kind in ("process", "socket", "import"):
        g.check(kind, "x")
    assert not g.violations

    # a thread left running by an earlier test is not this test's doing; one it starts is
    go = threading.Event()
    seen: List[str] = []

    def check() -> None:
        go.wait(10)
        try:
            conftest._guard.check("socket", "socket.socket")  # type: ignore[union-attr]
            seen.append("admitted")
        except ImpureTest:
            seen.append("refused")

    earlier = threading.Thread(target=check)
    earlier.start()
    g = guard("unit")
    later = threading.Thread(target=check)
    later.start()
    go.set()
    for t in (earlier, later):
        t.join(10)
    assert sorted(seen) == ["admitted", "refused"] and len(g.violations) == 1


IMPURE = """
import socket
import subprocess
import threading

import pytest


@pytest.mark.unit
def test_pure():
    assert sum(range(4)) == 6


@pytest.mark.unit
def test_runs_a_process():
    subprocess.run(["true"], timeout=10)


@pytest.mark.unit
def test_catches_the_refusal():
    try:
        subprocess.run(["true"], timeout=10)
    except Exception:
        pass


@pytest.mark.unit
def test_a_thread_opens_a_socket():
    t = threading.Thread(target=lambda: socket.socket().close())
    t.start()
    t.join(10)


@pytest.mark.unit
def test_imports_returnn():
    import returnn  # noqa: F401


@pytest.fixture
def child():
    return subprocess.run(["true"], timeout=10).returncode


@pytest.mark.unit
def test_a_fixture_runs_a_process(child):
    assert child == 0


@pytest.mark.sockets
def test_says_sockets_but_runs_a_process():
    subprocess.run(["true"], timeout=10)


@pytest.mark.processes
def test_says_processes():
    assert subprocess.run(["true"], timeout=10).returncode == 0
"""


@pytest.mark.processes
def test_pytest_fails_a_unit_test_that_is_not_pure(tmp_path):
    """End to end, as `pytest` runs the suite: with this suite's conftest, each impure test fails
    (even one that catches the refusal, or whose thread or fixture is impure), the others pass."""
    for name in ("conftest.py", "netns.py"):
        shutil.copy(os.path.join(REPO, "tests", name), tmp_path / name)
    (tmp_path / "test_impure.py").write_text(IMPURE)
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "test_impure.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    failed = sorted(re.findall(r"^(?:FAILED|ERROR) test_impure.py::(\w+)", res.stdout, re.M))
    assert failed == [
        "test_a_fixture_runs_a_process",
        "test_a_thread_opens_a_socket",
        "test_catches_the_refusal",
        "test_imports_returnn",
        "test_runs_a_process",
        "test_says_sockets_but_runs_a_process",
    ], res.stdout[-3000:]
    assert re.search(r"^5 failed, 2 passed, .*1 error", res.stdout, re.M), res.stdout[-3000:]  # (the fixture's)
    assert "mark it `processes` instead" in res.stdout and "not marked `processes`" in res.stdout


def unit_modules() -> List[str]:
    """The test modules that hold unit tests."""
    found = []
    for path in sorted(glob.glob(os.path.join(REPO, "tests", "test_*.py"))):
        with open(path) as f:
            if re.search(r"pytest\.mark\.unit\b", f.read()):
                found.append(os.path.basename(path)[:-3])
    return found


@pytest.mark.processes
def test_no_module_of_unit_tests_imports_returnn_or_torch_when_collected():
    """As `pytest -m unit` collects them, in a new interpreter: conftest, then each module of unit
    tests; none may bring RETURNN or PyTorch (the first that does is named)."""
    modules = unit_modules()
    assert {"test_protocol", "test_scheduler", "test_markers"} <= set(modules), modules
    code = textwrap.dedent(
        f"""
        import importlib, sys
        sys.path.insert(0, {os.path.join(REPO, "tests")!r})
        def heavy():
            return sorted({{m.split(".")[0] for m in sys.modules}} & {set(HEAVY)!r})
        for name in ["conftest"] + {modules!r}:
            importlib.import_module(name)
            if heavy():
                print(name, "imports", *heavy())
                break
        else:
            print("none")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["none"], res.stdout
