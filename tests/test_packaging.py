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


def test_ppserver_has_the_version_of_its_ppclient():
    import ppserver

    assert ppserver.__version__ == ppclient.__version__
    with open(os.path.join(REPO, "client", "ppclient", "_version.py")) as f:
        assert f'__version__ = "{ppserver.__version__}"' in f.read()  # the one place it is written
