"""`ppserver worker`: worker processes on this host for a remote server, started, respawned and
stopped by a supervisor that exits when the server refuses them."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

from ppserver.cli.output import fail_config, stdout_to_stderr
from ppserver.cli.parser import config_source

log = logging.getLogger("ppserver.cli")


def run(args: argparse.Namespace) -> int:
    from ppclient import UsageError, endpoints, keyfiles
    from ppserver.config.settings import load
    from ppserver.errors import ConfigError
    from ppserver.server.loop import setup_logging
    from ppserver.worker.pool import EXIT_REFUSED, ProcessPool, worker_argv
    from ppserver.worker.threads import thread_env

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
    config = os.path.abspath(path)
    pool = ProcessPool(
        lambda i: worker_argv(config, args.connect, index=i, keys=args.keys, returnn_dataset=returnn_dataset),
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
