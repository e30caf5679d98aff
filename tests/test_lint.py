"""The code is clean by the project's own rules: `ruff check`, `ruff format --check` and mypy, as
configured in pyproject.toml (all three come with the `test` extra). A tool that is not installed
skips its test, naming what is missing. mypy keeps its cache in .mypy_cache, so a run after the
first one checks only what changed.
"""

from __future__ import annotations

import importlib.util
from typing import List

import pytest
from conftest import run_cli

pytestmark = pytest.mark.processes

TIMEOUT_S = 240  # mypy on a cold cache, on a busy machine


def run_tool(module: str, args: List[str]) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (it comes with the test extra: pip install -e '.[test]')")
    proc = run_cli(*args, module=module, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{module} {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-6000:]}"


def test_ruff_check():
    run_tool("ruff", ["check", "--no-fix", "."])


def test_ruff_format():
    run_tool("ruff", ["format", "--check", "."])


def test_mypy():
    run_tool("mypy", [])  # the files and options are in pyproject.toml
