"""`ppserver serve`: the server with its local workers; and reading its `ready ADDRESS` line, as the
demo, the tests and the benchmarks do."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from typing import List, Optional, Union

from ppserver.cli.output import fail_config, ready_stream, stdout_to_stderr
from ppserver.cli.parser import config_source


def run(args: argparse.Namespace) -> int:
    from ppclient import UsageError, endpoints, keyfiles
    from ppserver.config.settings import load
    from ppserver.config.table import AUTO
    from ppserver.errors import ConfigError, Stopped
    from ppserver.logs import setup_logging
    from ppserver.observe.metrics import parse_address
    from ppserver.server.loop import serve, stop_on_signals
    from ppserver.server.owners import OwnerWatch
    from ppserver.server.pool_size import local_limits

    ready = ready_stream()
    stdout_to_stderr()
    setup_logging()
    stop_on_signals()  # before the owner watch starts: a stop it sends during the start still tidies
    # first and last: a trainer that dies while the config loads ends this process too, which then
    # removes the folder, also after a start that failed
    watch = OwnerWatch(args.owners, args.bind) if args.owners else None
    if watch is not None:
        watch.start()
    try:
        endpoints.check(args.bind, "--bind")
        if args.worker_bind:
            endpoints.check(args.worker_bind, "--worker-bind")
        metrics = parse_address(args.metrics) if args.metrics is not None else None
        if args.keys:
            keyfiles.server_keys(args.keys)
        cfg = load(*config_source(args))
        asked = cfg.num_workers if args.workers is None else _workers(args.workers)
        # partitions follow the config, not --workers, so outputs never depend on the worker count
        cfg.stream_partitions = cfg.partitions
        elastic, local_max = local_limits(cfg, os.cpu_count()) if asked == AUTO else (None, 0)
        workers = min(cfg.min_workers, local_max) if asked == AUTO else int(asked)
        cfg.num_workers = max(workers, 1)
        return serve(
            cfg,
            bind=args.bind,
            worker_bind=args.worker_bind,
            workers=workers,
            keys=args.keys,
            insecure=args.insecure,
            metrics=metrics,
            ready=ready,
            watch=watch,
            elastic=elastic,
            local_max=local_max,
        )
    except (ConfigError, UsageError) as exc:
        return fail_config("serve", exc)
    except OSError as exc:
        print(f"ppserver serve: error: {exc}", file=sys.stderr)
        return 1
    except Stopped as exc:
        logging.getLogger("ppserver").info("stopped by %s before serving", exc)
        return 0
    finally:
        if watch is not None:
            watch.close()


def _workers(text: str) -> Union[int, str]:
    """--workers: a count >= 0, or 'auto'."""
    from ppserver.config.table import AUTO
    from ppserver.errors import ConfigError

    if text == AUTO:
        return AUTO
    if not text.isdigit():
        raise ConfigError("--workers", f"must be an int >= 0 or 'auto', got {text!r}")
    return int(text)


def wait_ready(proc: subprocess.Popen, timeout: float, skipped: Optional[List[str]] = None) -> str:
    """Read the server's stdout until its 'ready ADDRESS' line; raise if it exits or stalls.
    Lines before it (a server prints none) are added to `skipped` if given."""
    import selectors

    assert proc.stdout is not None, "start the server with stdout=subprocess.PIPE"
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(deadline - time.monotonic(), 0)):
                break
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited with code {proc.wait()} before it was ready")
            if line.startswith("ready "):
                return line.split()[1]
            if skipped is not None:
                skipped.append(line)
    finally:
        sel.close()
    raise RuntimeError(f"server not ready within {timeout:g} s")
