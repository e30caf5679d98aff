#!/usr/bin/env python3
"""Set-up and everyday tasks with nothing but Python 3.10+ and pip.

python3 make.py demo    # create .venv if missing, install, run `ppserver demo`
python3 make.py test    # create .venv if missing, install, run the test suite
python3 make.py bench   # run the throughput benchmark (by hand; prints ratios)
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(ROOT, ".venv")
PY = os.path.join(VENV, "bin", "python")
STAMP = os.path.join(VENV, ".installed")


def _inputs_hash(extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for name in ("pyproject.toml", os.path.join("client", "pyproject.toml")):
        with open(os.path.join(ROOT, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _installed() -> list[str]:
    """The stamp's lines: one hash per extra set installed into this .venv."""
    if not os.path.exists(STAMP):
        return []
    with open(STAMP) as f:
        return f.read().split()


def ensure_venv(extra: str = "") -> None:
    """Create .venv and install ppclient and ppserver in it; `extra` names ppserver's extra ("test").

    The demo needs only the runtime (numpy, pyzmq, msgpack, prometheus_client): the test extra
    (PyTorch, RETURNN, lhotse, linters) comes with the first `make.py test`.
    """
    if not os.path.exists(PY):
        print(f"creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    want = _inputs_hash(extra)
    done = _installed()
    # a venv with the test extra serves the demo too
    if want in done or (not extra and _inputs_hash("test") in done):
        return
    if extra:
        print(f"installing ppserver[{extra}] into {VENV}", flush=True)
    subprocess.run([PY, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=False)
    # ppclient first: ppserver depends on it, and it lives in ./client
    target = f"{ROOT}[{extra}]" if extra else ROOT
    subprocess.run([PY, "-m", "pip", "install", "-q", "-e", os.path.join(ROOT, "client"), "-e", target], check=True)
    with open(STAMP, "w") as f:
        f.write("\n".join([*[d for d in done if d != want], want]) + "\n")


def main(argv: list[str]) -> int:
    task = argv[0] if argv else "help"
    rest = argv[1:]
    if task not in ("demo", "test", "bench"):
        print(__doc__)
        return 0 if task == "help" else 2
    ensure_venv("" if task == "demo" else "test")
    if task == "demo":
        cmd = [PY, "-m", "ppserver", "demo", *rest]
    elif task == "test":
        # two test processes (by file: a file's fixtures stay in one), unless the arguments say otherwise
        chosen = any(a.startswith(("-n", "--numprocesses")) for a in rest)
        spread = [] if chosen else ["-n", "2", "--dist", "loadfile"]
        cmd = [PY, "-m", "pytest", "-q", *spread, *rest]
    else:
        cmd = [PY, os.path.join(ROOT, "bench", "throughput.py"), *rest]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
