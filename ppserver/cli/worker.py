"""`ppserver worker`: worker processes on this host for a remote server, started, respawned and
stopped by a supervisor that exits when the server refuses them."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile
import time
from typing import TYPE_CHECKING, Optional

from ppserver.cli.output import fail_config, stdout_to_stderr
from ppserver.cli.parser import config_source

if TYPE_CHECKING:
    from ppserver.config.table import Config

log = logging.getLogger("ppserver.cli")


def run(args: argparse.Namespace) -> int:
    from ppclient import UsageError, endpoints, keyfiles
    from ppserver.config.settings import load
    from ppserver.errors import ConfigError
    from ppserver.logs import setup_logging

    stdout_to_stderr()  # a worker host prints nothing on stdout
    setup_logging("ppworker-host")
    try:
        endpoints.check(args.connect, "--connect")
        if args.keys:
            keyfiles.client_keys(args.keys)
        path, returnn_dataset = config_source(args)
        cfg = load(path, returnn_dataset)
        if args.procs < 1:
            raise ConfigError("--procs", f"must be >= 1, got {args.procs}")
    except (ConfigError, UsageError) as exc:
        return fail_config("worker", exc)
    # the processes run the config as this host loaded it, also those started again after the file was edited
    fd, snapshot = tempfile.mkstemp(prefix="ppworker-config-")
    with os.fdopen(fd, "wb") as f:
        f.write(cfg.source)
    try:
        return _supervise(args, cfg, os.path.abspath(path), snapshot, returnn_dataset)
    finally:
        os.unlink(snapshot)


def _supervise(args: argparse.Namespace, cfg: Config, path: str, snapshot: str, returnn_dataset: Optional[str]) -> int:
    """Run the pool of worker processes until SIGTERM or SIGINT, or until the server refuses them."""
    from ppserver.worker.pool import EXIT_REFUSED, ProcessPool, worker_argv
    from ppserver.worker.threads import thread_env

    pool = ProcessPool(
        lambda i: worker_argv(
            path, args.connect, index=i, keys=args.keys, returnn_dataset=returnn_dataset, config_source=snapshot
        ),
        args.procs,
        name="worker",
        env=thread_env(cfg.worker_threads),
    )
    stopping = []
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *a: stopping.append(1))
    pool.start()
    log.info("started %d worker processes for %s", args.procs, args.connect)
    while not stopping:
        pool.poll()
        if pool.refused:
            pool.stop(timeout=2.0)
            log.error("the server refused this host's workers; exiting")
            return EXIT_REFUSED
        time.sleep(0.1)
    log.info("stopping %d worker processes", pool.alive())
    pool.stop(timeout=4.5)
    return 0
