"""Packaging: ppserver requires the ppclient release of its own version (they share the protocol)."""

from __future__ import annotations

import os

import pytest
from conftest import REPO

import ppclient

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

pytestmark = pytest.mark.unit


def test_ppserver_requires_the_ppclient_of_its_version():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert [d for d in dependencies if d.startswith("ppclient")] == [f"ppclient=={ppclient.__version__}"]
