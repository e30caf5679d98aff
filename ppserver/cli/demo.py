"""`ppserver demo`: a server with local workers on synthetic data, two epochs pulled through ppclient
with their rates shown, then everything stopped."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from ppserver.cli.output import EXIT_CONFIG
from ppserver.cli.serve import wait_ready

DEMO_PLAIN_EVERY_S = 1.0  # progress lines when stdout is not a terminal


def run(args: argparse.Namespace) -> int:
    """The server's and workers' logs go to a file, so that they never break the progress line
    (rewritten in place on a terminal, plain lines about once a second otherwise). A temporary
    log file is removed at a clean exit and kept when the demo fails."""
    import tempfile

    from ppclient import Client, Error
    from ppserver.worker.pool import stop_process

    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_config.py")
    if args.log:
        log_path, keep = args.log, "kept"
        try:
            log_file = open(log_path, "w")
        except OSError as exc:
            print(f"ppserver demo: error: cannot write --log {log_path}: {exc.strerror}", file=sys.stderr)
            return EXIT_CONFIG
    else:
        fd, log_path = tempfile.mkstemp(prefix="ppserver-demo-", suffix=".log")
        keep = "removed at the end unless the demo fails"
        log_file = os.fdopen(fd, "w")
    with log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ppserver", "serve", config, "--bind", "tcp://127.0.0.1:0"],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
        )
    print(f"demo: server and worker logs go to {log_path} ({keep})", flush=True)
    show = _DemoProgress(sys.stdout.isatty())
    failed = True
    try:
        address = wait_ready(proc, timeout=60)
        print(f"demo: server ready at {address}", flush=True)
        with Client(address, timeout=30) as client:
            info = client.info()
            keys = ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in info["data_keys"].items())
            print(f"demo: {info['num_seqs']} seqs per epoch; keys: {keys}", flush=True)
            for epoch in range(1, args.epochs + 1):
                start = time.monotonic()
                nbytes = n = 0
                it = client.epoch(epoch)
                total = len(it)
                for seq in it:
                    n += 1
                    nbytes += sum(v.nbytes for k, v in seq.items() if hasattr(v, "nbytes"))
                    show.update(epoch, n, total, nbytes, time.monotonic() - start)
                el = time.monotonic() - start
                show.done(
                    f"demo: epoch {epoch}: {n} seqs in {el:.2f} s: {n / el:.1f} seqs/s, {nbytes / el / 1e6:.1f} MB/s"
                )
        print("demo: done", flush=True)
        failed = False
        return 0
    except (RuntimeError, Error) as exc:
        show.done("")
        print(f"demo: error: {exc} (the server's log: {log_path})", file=sys.stderr, flush=True)
        return 1
    finally:
        stop_process(proc, timeout=10)
        if not failed and not args.log:
            os.unlink(log_path)


class _DemoProgress:
    """One epoch's progress: rewritten in place on a terminal, a plain line now and then elsewhere."""

    def __init__(self, tty: bool):
        self.tty = tty
        self.shown_at = 0.0  # elapsed seconds of the last line shown
        self.width = 0

    def update(self, epoch: int, n: int, total: int, nbytes: int, elapsed: float) -> None:
        if self.tty and n % 20 and n != total:
            return
        if not self.tty and (elapsed - self.shown_at < DEMO_PLAIN_EVERY_S or n == total):
            return
        self.shown_at = elapsed
        el = max(elapsed, 1e-9)
        text = f"demo: epoch {epoch}: {n}/{total} seqs  {n / el:8.1f} seqs/s  {nbytes / el / 1e6:7.1f} MB/s"
        if self.tty:
            print(f"\r{text}", end="", flush=True)
            self.width = len(text)
        else:
            print(text, flush=True)

    def done(self, text: str) -> None:
        """The epoch's last line (it replaces the progress line on a terminal; "": just end it)."""
        if self.tty and self.width:
            print(f"\r{text}{' ' * max(self.width - len(text), 0)}", flush=True)
        elif text:
            print(text, flush=True)
        self.shown_at = 0.0
        self.width = 0
