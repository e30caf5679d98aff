"""The benchmarks run by hand, never in the suite: this checks that every name they import from
ppserver and ppclient still exists, so that a module moved or renamed breaks a test, not a bench
run days later."""

from __future__ import annotations

import ast
import glob
import importlib
import importlib.util
import os

import pytest
from conftest import REPO

pytestmark = pytest.mark.unit


def _imports(path: str):
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("ppserver", "ppclient"):
            for alias in node.names:
                yield node.module, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("ppserver", "ppclient"):
                    yield alias.name, None


# the framework adapters import torch and RETURNN, which a unit test may not: their names are read from their source
ADAPTERS = ("ppclient.torch", "ppclient.returnn")


def _defined(module: str):
    """The names `module` (a plain module file) defines or imports at its top level."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    names = set()
    for node in ast.parse(open(spec.origin).read()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "bench", "*.py"))), ids=os.path.basename)
def test_every_name_a_benchmark_imports_exists(path):
    missing = []
    for module, name in _imports(path):
        if module in ADAPTERS:
            if name is not None and name not in _defined(module):
                missing.append(f"{module}.{name}")
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
            continue
        if name is not None and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{module}.{name}")
    assert not missing, f"{os.path.basename(path)} imports what is not there: {missing}"


def test_the_scheduler_bench_plays_every_case_to_a_whole_epoch():
    """bench/scheduler.py checks that each simulated epoch delivered every seq and ended with the
    right count; a scheduler change that breaks its simulation shows here, not on the day it is run."""
    spec = importlib.util.spec_from_file_location("bench_scheduler", os.path.join(REPO, "bench", "scheduler.py"))
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for case in bench.CASES:
        cluster = bench.Cluster(case, seqs=300, workers=3, partitions=2)
        for _ in range(2):  # the second epoch runs on the first one's workers
            _, events = cluster.run_epoch()
            assert cluster.delivered == 300 and events > 300 // 16, (case, events)
