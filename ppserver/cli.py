"""The `ppserver` command: serve, worker, status, keygen, demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import List, Optional, TextIO, Tuple

EXIT_CONFIG = 2

log = logging.getLogger("ppserver.cli")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppserver",
        description="Data postprocessing service for ML training: one dataset in the server, "
        "mappers (map_seq / map_seq_stream) in a pool of worker processes, epochs delivered in order "
        "to ppclient over ZeroMQ.",
    )
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    s = sub.add_parser(
        "serve",
        help="run the server with local workers",
        description="Load CONFIG, open its dataset once, start local worker processes and "
        "serve epochs. Prints 'ready ADDRESS' on stdout once it accepts requests, and nothing else there: "
        "the log and any other output (the config's, the dataset's) go to stderr. "
        "SIGTERM or SIGINT stops it and its workers.",
    )
    s.add_argument(
        "config", metavar="CONFIG", nargs="?", help="Python config file (dataset, map_seq or map_seq_stream, ...)"
    )
    _returnn_options(s, "is served")
    s.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        help="control address for clients and workers (default %(default)s; port 0 picks a free port)",
    )
    s.add_argument(
        "--worker-bind",
        default=None,
        metavar="ADDR",
        help="address for the worker socket (default: the --bind host with a free port)",
    )
    s.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="local worker processes (default: num_workers from CONFIG; 0 = remote workers only)",
    )
    s.add_argument("--keys", default=None, metavar="DIR", help="CURVE keys from `ppserver keygen DIR`")
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --bind without keys (traffic unencrypted, peers unauthenticated)",
    )
    s.add_argument(
        "--metrics",
        default=None,
        metavar="ADDR",
        help="serve Prometheus metrics over HTTP at HOST:PORT (:PORT: every interface), e.g. 127.0.0.1:9100",
    )
    s.add_argument(
        "--owners",
        default=None,
        metavar="DIR",
        help="stop once no process registered in DIR lives any more: how the servers that ppclient starts "
        "for a training (no address given) end with it",
    )

    w = sub.add_parser(
        "worker",
        help="run worker processes on this host for a remote server",
        description="Start N worker processes that connect to a running server (or wait for it). "
        "SIGTERM hands back their work and exits within 5 s. Exit code 2: refused by the server "
        "(protocol or config mismatch). Prints nothing on stdout: the log and any other output go to stderr.",
    )
    w.add_argument("config", metavar="CONFIG", nargs="?", help="the same config file the server runs")
    _returnn_options(w, "is mapped here")
    w.add_argument("--connect", required=True, metavar="tcp://HOST:PORT", help="the server's control address")
    w.add_argument(
        "--procs",
        type=int,
        default=os.cpu_count() or 1,
        metavar="N",
        help="worker processes to start (default: CPU count, %(default)s)",
    )
    w.add_argument("--keys", default=None, metavar="DIR", help="CURVE keys (client pair and server public key)")

    st = sub.add_parser(
        "status",
        help="show a server's state",
        description="Epoch, seqs delivered, seqs/s, workers and queue depths of a running server.",
    )
    st.add_argument("address", metavar="ADDRESS", help="the server's control address, e.g. tcp://127.0.0.1:5555")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default %(default)s)")
    st.add_argument("--keys", default=None, metavar="DIR", help="CURVE keys")

    k = sub.add_parser(
        "keygen",
        help="write CURVE key pairs",
        description="Write server.key/server.key_secret and client.key/client.key_secret into DIR "
        "and authorise the client key (DIR/authorized/). If DIR already holds any of these files, "
        "nothing is written and the exit code is 2, unless --force.",
    )
    k.add_argument("dir", metavar="DIR", help="the keys directory (made if missing)")
    k.add_argument(
        "--force",
        action="store_true",
        help="replace the keys DIR already holds (every worker and client using the old keys is then refused; "
        "other authorised keys in DIR/authorized/ stay)",
    )

    d = sub.add_parser(
        "demo",
        help="run a short demo end to end",
        description="Start a server with local workers on synthetic speech-like data and a "
        "SpecAugment-style mapper, pull 2 epochs through ppclient, print seqs/s and MB/s, stop.",
    )
    d.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    d.add_argument(
        "--log",
        metavar="FILE",
        default=None,
        help="write the server's and workers' logs to FILE and keep it (default: a temporary file, "
        "removed when the demo ends without an error)",
    )
    return p


def _returnn_options(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--returnn-config",
        default=None,
        metavar="FILE",
        help="instead of CONFIG: a RETURNN config file, loaded as RETURNN loads it; its dataset dict named by "
        f"--dataset (a PostprocessingDataset's, or ppclient.returnn.ServerDataset's with those keys) {what}",
    )
    p.add_argument(
        "--dataset",
        default=None,
        metavar="NAME",
        help="with --returnn-config: the dataset's name in it: train, dev, eval or a key of eval_datasets "
        "(default: train)",
    )


def _config_source(args) -> Tuple[str, Optional[str]]:
    """(path, RETURNN dataset name or None) from CONFIG or --returnn-config/--dataset; ConfigError if unclear."""
    from ppserver.errors import ConfigError

    if args.config is not None and args.returnn_config is not None:
        raise ConfigError("--returnn-config", "give either CONFIG or --returnn-config, not both")
    if args.returnn_config is not None:
        return args.returnn_config, args.dataset or "train"
    if args.dataset is not None:
        raise ConfigError("--dataset", "names a dataset of a RETURNN config: give --returnn-config FILE too")
    if args.config is None:
        raise ConfigError("config", "missing: give CONFIG (a ppserver config) or --returnn-config FILE")
    return args.config, None


def _version() -> str:
    from ppclient import __version__, protocol

    return f"ppserver {__version__} (protocol {protocol.PROTOCOL})"


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    return {"serve": _serve, "worker": _worker, "status": _status, "keygen": _keygen, "demo": _demo}[args.command](args)


def stdout_to_stderr() -> None:
    """From here on, everything this process and its children write to stdout goes to stderr
    (the log): prints of the config and of the dataset (RETURNN's among them), of the threads
    that read it and of the processes they start. stdout carries nothing a supervisor would
    have to parse around or drain."""
    sys.stdout.flush()
    try:
        os.dup2(2, 1)  # C code and child processes writing to descriptor 1
    except OSError:
        return  # no stderr to send it to: leave stdout as it is
    sys.stdout = sys.stderr  # Python code: unbuffered, in order with the log lines


def ready_stream() -> TextIO:
    """The real stdout, kept for the one `ready ADDRESS` line (call before stdout_to_stderr)."""
    try:
        return os.fdopen(os.dup(1), "w", buffering=1)  # os.dup: not inherited by child processes
    except OSError:
        return sys.stdout  # stdout is closed: printing `ready` fails as it did before


def _fail_config(command: str, exc: Exception) -> int:
    """Exit 2 with one line, also for a ConfigError (e.g. a dataset's own) whose message spans lines."""
    message = " ".join(str(exc).split())
    print(f"ppserver {command}: error: {message}", file=sys.stderr)
    return EXIT_CONFIG


def _serve(args) -> int:
    from ppclient import UsageError, endpoints, keyfiles
    from ppserver.config.settings import load
    from ppserver.errors import ConfigError
    from ppserver.observe.metrics import parse_address
    from ppserver.server.loop import serve, setup_logging

    ready = ready_stream()
    stdout_to_stderr()
    setup_logging()
    try:
        endpoints.check(args.bind, "--bind")
        if args.worker_bind:
            endpoints.check(args.worker_bind, "--worker-bind")
        metrics = parse_address(args.metrics) if args.metrics is not None else None
        if args.keys:
            keyfiles.server_keys(args.keys)
        cfg = load(*_config_source(args))
        workers = cfg.num_workers if args.workers is None else args.workers
        if workers < 0:
            raise ConfigError("--workers", f"must be >= 0, got {workers}")
        # partitions follow the config, not --workers, so outputs never depend on the worker count
        cfg.stream_partitions = cfg.partitions
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
            owners=args.owners,
        )
    except (ConfigError, UsageError) as exc:
        return _fail_config("serve", exc)
    except OSError as exc:
        print(f"ppserver serve: error: {exc}", file=sys.stderr)
        return 1


def _worker(args) -> int:
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
        path, returnn_dataset = _config_source(args)
        cfg = load(path, returnn_dataset)
        if args.procs < 1:
            raise ConfigError("--procs", f"must be >= 1, got {args.procs}")
    except (ConfigError, UsageError) as exc:
        return _fail_config("worker", exc)
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


def _status(args) -> int:
    from ppclient import Client, Error, UsageError

    try:
        with Client(args.address, timeout=args.timeout, keys=args.keys) as c:
            st = c.status()
    except UsageError as exc:
        print(f"ppserver status: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Error as exc:
        print(f"ppserver status: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(format_status(st))
    return 0


def format_status(st) -> str:
    q = st.get("queues") or {}
    lines = [
        f"server      {st.get('address')}  (workers connect to {st.get('worker_address')}), up {st.get('uptime_s')} s",
        f"epoch       {st.get('epoch')}  state {st.get('state')}  "
        f"delivered {st.get('seqs_delivered')}/{st.get('num_seqs') if st.get('num_seqs') is not None else '?'}"
        f"  {st.get('seqs_per_sec')} seqs/s",
        *_progress_lines(st),
        f"queues      waiting {q.get('waiting_for_worker', 0)}  in flight {q.get('in_flight', 0)}  "
        f"reorder {q.get('reorder_buffer', 0)}  client credit {q.get('client_credit', 0)}",
        f"workers     {st.get('workers_alive')} alive",
    ]
    if st.get("waiting_for"):
        lines.append(f"waiting for {st['waiting_for']}")
    if st.get("error"):
        lines.append(f"error       {st['error']}")
    job = st.get("job")
    if job:
        epochs = ", ".join(map(str, job.get("epochs", []))) or "none"
        lines.append(
            f"job         {job['name']!r}  world_size {job['world_size']}  drop_last {job['drop_last']}  "
            f"{job['clients']} live clients  epochs {epochs}"
        )
        for r in st.get("ranks", []):
            size = "?" if r["shard_size"] is None else r["shard_size"]
            heard = "" if r["last_heard_s"] is None else f"  heard {r['last_heard_s']:.1f} s ago"
            lines.append(
                f"  rank {r['rank']:<3} epoch {r['epoch']} (run {r['run']}{', solo' if r['solo'] else ''})  "
                f"position {r['position']}/{size}  {r['seqs_per_sec']} seqs/s"
                f"{'  done' if r['done'] else ''}{heard}"
            )
    if st.get("workers"):
        lines.append(f"  {'host':<20} {'pid':>7} {'done':>8} {'in flight':>9} {'last hb':>8}")
        for w in st["workers"]:
            lines.append(
                f"  {w['host'][:20]:<20} {w['pid']:>7} {w['seqs_done']:>8} {w['in_flight']:>9} "
                f"{w['last_heartbeat_s']:>7.1f}s"
            )
    return "\n".join(lines)


def _progress_lines(st) -> List[str]:
    """Rolling rate, ETA and holdup, and the mean time per seq in each stage (see README)."""
    from ppserver.observe.progress import format_eta

    if "rate_seqs_per_sec" not in st:
        return []  # a server without stage timings
    held = f"  held back by the {st['held_back_by']}" if st.get("held_back_by") else ""
    eta = f"  ETA {format_eta(st['eta_s'])}" if st.get("eta_s") is not None else ""
    lines = [f"progress    {st['rate_seqs_per_sec']} seqs/s (last {st.get('rate_window_s', 0):g} s){eta}{held}"]
    stages = [f"{name} {ms:.2f}" for name, ms in (st.get("stage_ms") or {}).items() if ms is not None]
    if stages:
        lines.append(f"stages      ms per seq: {'  '.join(stages)}")
    return lines


def _keygen(args) -> int:
    from ppclient import UsageError
    from ppclient.keyfiles import keygen

    try:
        server, client = keygen(args.dir, force=args.force)
    except UsageError as exc:
        return _fail_config("keygen", exc)
    print(f"wrote {server} (+ secret) and {client} (+ secret); authorised {client}")
    return 0


DEMO_PLAIN_EVERY_S = 1.0  # progress lines when stdout is not a terminal


def _demo(args) -> int:
    """The server's and workers' logs go to a file, so that they never break the progress line
    (rewritten in place on a terminal, plain lines about once a second otherwise). A temporary
    log file is removed at a clean exit and kept when the demo fails."""
    import tempfile

    from ppclient import Client, Error
    from ppserver.worker.pool import stop_process

    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_config.py")
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
