"""The layering of docs/architecture.md ("Layers"), checked on every import of every module.

Each module of ppserver and ppclient belongs to one layer; a layer imports only from the layers
it builds on (LAYERS). Imports are read from the source (ast), wherever they stand: at the top,
inside a function, under TYPE_CHECKING. A new edge between layers is a decision: it is made
here, in the table, and in the docs, not by an import.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Dict, FrozenSet, Iterator, List, Set, Tuple

import pytest
from conftest import REPO

pytestmark = pytest.mark.unit

ROOTS = ((Path(REPO), "ppserver"), (Path(REPO) / "client", "ppclient"))

# layer -> the layers it may import from (besides its own)
LAYERS: Dict[str, FrozenSet[str]] = {
    "client": frozenset(),  # ppclient: the client, the protocol, shared memory
    "base": frozenset({"client"}),  # ppserver's errors, exits, log lines
    "mappers": frozenset({"client", "base"}),  # pure functions on seqs
    "datasets": frozenset({"client", "base", "mappers"}),  # templates are written in the mappers' terms
    "config": frozenset({"client", "base", "mappers", "datasets"}),
    "scheduler": frozenset({"client", "base"}),  # pure: no config, no dataset, plain settings
    "transport": frozenset({"client", "base", "scheduler"}),
    "observe": frozenset({"client", "base", "scheduler"}),
    "worker": frozenset({"client", "base", "mappers", "datasets", "config", "transport"}),
    "reference": frozenset({"client", "base", "mappers", "datasets", "config"}),  # the tests' oracle
    "server": frozenset(
        {"client", "base", "mappers", "datasets", "config", "scheduler", "transport", "observe", "worker"}
    ),
    "cli": frozenset(
        {"client", "base", "mappers", "datasets", "config", "scheduler", "transport", "observe", "worker", "server"}
    ),
}

# The one import against the layers, and why: the RETURNN client names a local server by the
# config fingerprint the server computes, where ppserver is installed (in a function; without
# ppserver it goes without).
EXCEPTIONS: Set[Tuple[str, str]] = {
    ("ppclient.returnn", "ppserver.config.returnn"),
    ("ppclient.returnn", "ppserver.config.settings"),
    ("ppclient.returnn", "ppserver.errors"),
}

_PACKAGES = {"ppserver.mappers": "mappers", "ppserver.datasets": "datasets", "ppserver.config": "config"}
_PACKAGES.update({f"ppserver.{p}": p for p in ("scheduler", "transport", "observe", "worker", "server", "cli")})
_MODULES = {
    "ppserver": "base",
    "ppserver.errors": "base",
    "ppserver.exits": "base",
    "ppserver.logs": "base",
    "ppserver.demo_config": "config",  # the demo's config file, a module
    "ppserver.reference": "reference",
    "ppserver.__main__": "cli",
}


def layer(module: str) -> str:
    if module == "ppclient" or module.startswith("ppclient."):
        return "client"
    if module in _MODULES:
        return _MODULES[module]
    for package, name in _PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return name
    raise AssertionError(f"{module} is in no layer: add it to tests/test_layers.py and docs/architecture.md")


def modules() -> Dict[str, Tuple[Path, bool]]:
    """Every module of ppserver and ppclient: name -> (file, is a package's __init__)."""
    out = {}
    for base, top in ROOTS:
        for path in sorted((base / top).rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imports(source: str, module: str, package: bool, known: Set[str]) -> Iterator[Tuple[int, str]]:
    """(line, imported module) for every import in `source`, relative ones resolved; `from m import x`
    names m.x where that is a module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if sub in known else base


def own(name: str) -> bool:
    return name.split(".")[0] in ("ppserver", "ppclient")


def violations() -> List[str]:
    found = modules()
    known = set(found)
    out = []
    for module, (path, package) in found.items():
        mine = layer(module)
        for line, target in imports(path.read_text(), module, package, known):
            if not own(target) or (module, target) in EXCEPTIONS:
                continue
            theirs = layer(target)
            if theirs != mine and theirs not in LAYERS[mine]:
                out.append(f"{os.path.relpath(path, REPO)}:{line}: {mine} imports {target} ({theirs})")
    return out


def test_every_import_follows_the_layers():
    assert violations() == []


def test_the_layers_form_no_circle():
    def reaches(start: str, goal: str, seen: Set[str]) -> bool:
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in LAYERS[start])

    assert [name for name in LAYERS if reaches(name, name, {name})] == []
    assert all(below in LAYERS for allowed in LAYERS.values() for below in allowed)


def test_every_module_is_in_a_layer_and_every_exception_is_still_needed():
    found = modules()
    for module in found:
        layer(module)
    used = set()
    for module, (path, package) in found.items():
        used.update((module, target) for _, target in imports(path.read_text(), module, package, set(found)))
    assert EXCEPTIONS - used == set()


def test_the_docs_table_is_this_one():
    text = (Path(REPO) / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\w+) \| .* \| ([^|]+) \|$", section, re.MULTILINE)[1:]  # (the header row first)
    documented = {
        name: frozenset(n.strip() for n in imports.split(",") if n.strip() != "(none)") for name, imports in rows
    }
    assert documented == LAYERS


def test_the_scan_sees_imports_inside_functions_relative_ones_and_submodules():
    source = (
        "import ppclient\n"
        "from . import session\n"
        "from ..scheduler import core\n"
        "def f():\n"
        "    from ppserver.server.loop import serve\n"
        "if TYPE_CHECKING:\n"
        "    from ppserver.config.table import Config\n"
    )
    known = {"ppserver.worker.session", "ppserver.scheduler.core"}
    got = sorted(name for _, name in imports(source, "ppserver.worker.main", False, known))
    assert got == [
        "ppclient",
        "ppserver.config.table",
        "ppserver.scheduler.core",
        "ppserver.server.loop",
        "ppserver.worker.session",
    ]
    # of these, a worker may not import the scheduler or the server
    assert sorted(layer(name) for name in got if layer(name) not in LAYERS["worker"] | {"worker"}) == [
        "scheduler",
        "server",
    ]


# The scheduler's parts: each works on the state (scheduler/state.py) and the parts handed to it.
SCHEDULER_PARTS = ("requests", "runs", "delivery", "skips", "status", "invariants", "state")
CORE = "ppserver.scheduler.core"


def reaches_core(source: str, module: str, package: bool, known: Set[str]) -> List[str]:
    """The imports in `source` that reach the Scheduler: core, or the package (its __init__ imports core)."""
    return sorted({name for _, name in imports(source, module, package, known) if name in (CORE, "ppserver.scheduler")})


def test_no_part_of_the_scheduler_reaches_back_into_it():
    """Only the package imports core: no module of the scheduler does (a part that needs the
    Scheduler, even for a type, holds the whole instead of the state and the parts it calls)."""
    found = modules()
    known = set(found)
    inside = [m for m in found if m.startswith("ppserver.scheduler.") and m != CORE]
    assert {f"ppserver.scheduler.{part}" for part in SCHEDULER_PARTS} <= set(inside)
    reaching = {}
    for module in inside:
        path, package = found[module]
        reaching[module] = reaches_core(path.read_text(), module, package, known)
    assert {m: names for m, names in reaching.items() if names} == {}
    # the scan sees a type-only import of core, and the package's names
    source = "if TYPE_CHECKING:\n    from ppserver.scheduler.core import Scheduler\n"
    source += "from ppserver.scheduler import Run\n"
    assert reaches_core(source, "ppserver.scheduler.runs", False, known) == ["ppserver.scheduler", CORE]
