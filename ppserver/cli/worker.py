"""`ppserver worker`: worker processes on this host for a remote server, started, respawned and
stopped by a supervisor that exits when the server refuses them. With `--procs auto` the server
decides how many run (up to the CPU count): see worker/host.py."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import tempfile
import time
from typing import TYPE_CHECKING, Any, Optional

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
        auto = args.procs == "auto"
        if not auto and not (args.procs.isdigit() and int(args.procs) >= 1):
            raise ConfigError("--procs", f"must be an int >= 1 or 'auto', got {args.procs!r}")
        keys = keyfiles.client_keys(args.keys) if args.keys else None
    except (ConfigError, UsageError) as exc:
        return fail_config("worker", exc)
    # the processes run the config as this host loaded it, also those started again after the file was edited
    fd, snapshot = tempfile.mkstemp(prefix="ppworker-config-")
    with os.fdopen(fd, "wb") as f:
        f.write(cfg.source)
    try:
        return _supervise(args, cfg, os.path.abspath(path), snapshot, returnn_dataset, auto, keys)
    finally:
        os.unlink(snapshot)


def _supervise(
    args: argparse.Namespace,
    cfg: Config,
    path: str,
    snapshot: str,
    returnn_dataset: Optional[str],
    auto: bool,
    keys: Any,
) -> int:
    """Run the pool of worker processes until SIGTERM or SIGINT, or until the server refuses them;
    with --procs auto, as many as the server wants here, up to this host's cores."""
    from ppserver.worker.host import ASK_EVERY_S, HostAsker, host_cpus
    from ppserver.worker.pool import EXIT_REFUSED, ProcessPool, worker_argv
    from ppserver.worker.threads import thread_env

    max_procs = host_cpus()
    pool = ProcessPool(
        lambda i: worker_argv(
            path, args.connect, index=i, keys=args.keys, returnn_dataset=returnn_dataset, config_source=snapshot
        ),
        1 if auto else int(args.procs),
        name="worker",
        env=thread_env(cfg.worker_threads),
    )
    asker = HostAsker(args.connect, keys, max_procs) if auto else None
    stopping = []
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *a: stopping.append(1))
    pool.start()
    how = f"1 of up to {max_procs} (auto)" if auto else str(pool.n)
    log.info("started %s worker processes for %s", how, args.connect)
    asked = 0.0
    try:
        while not stopping:
            pool.poll()
            if pool.refused:
                pool.stop(timeout=2.0)
                log.error("the server refused this host's workers; exiting")
                return EXIT_REFUSED
            if asker is not None and time.monotonic() - asked >= ASK_EVERY_S:
                asked = time.monotonic()
                wanted = asker.ask(pool.pids)
                while wanted is not None and pool.size < wanted and not stopping:
                    log.info("the server wants %d processes here: starting process %d", wanted, pool.add())
            time.sleep(0.1)
        log.info("stopping %d worker processes", pool.alive())
        pool.stop(timeout=4.5)
    finally:
        if asker is not None:
            asker.close()
    return 0
