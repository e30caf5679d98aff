"""The README's set-up on a fresh copy: `make.py demo` installs the runtime alone and runs the demo."""

from __future__ import annotations

import os

import pytest
from conftest import REPO

OPTIONAL = ("torch", "returnn", "lhotse", "mypy", "ruff")  # what the test extra brings, and the demo must not


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_the_demo_installs_only_the_runtime(tmp_path):
    """`python3 make.py demo` on a fresh copy: a venv with the runtime alone (no PyTorch, RETURNN or
    linters), and the demo runs in it."""
    import shutil
    import subprocess
    import sys

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    copy = tmp_path / "fresh"
    for name in tracked.split():
        if os.path.exists(os.path.join(REPO, name)):
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), copy / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    demo = subprocess.run(
        [sys.executable, "make.py", "demo", "--epochs", "1"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "seqs/s" in demo.stdout
    py = str(copy / ".venv" / "bin" / "python")
    found = subprocess.run(
        [
            py,
            "-c",
            "import importlib.util as u; print([m for m in ('torch', 'returnn', 'mypy', 'ruff') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert found.stdout.strip() == "[]", found.stdout + found.stderr
