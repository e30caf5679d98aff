"""The `ppserver` command line: its subcommands, their options and help texts (what `--help` prints),
and the config a subcommand runs (CONFIG, or --returnn-config with --dataset)."""

from __future__ import annotations

import argparse
import os
from typing import Optional, Tuple

from ppserver.errors import ConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppserver",
        description="Data postprocessing service for ML training: one dataset in the server, "
        "mappers (map_seq / map_seq_stream) in a pool of worker processes, epochs delivered in order "
        "to ppclient over ZeroMQ.",
    )
    p.add_argument("--version", action="version", version=version())
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
    returnn_options(s, "is served")
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
        default=None,
        metavar="N",
        help="local worker processes (default: num_workers from CONFIG; 0 = remote workers only; 'auto': as many as "
        "the trainer needs, min_workers to max_workers)",
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
    returnn_options(w, "is mapped here")
    w.add_argument("--connect", required=True, metavar="tcp://HOST:PORT", help="the server's control address")
    w.add_argument(
        "--procs",
        default=str(os.cpu_count() or 1),
        metavar="N",
        help="worker processes to start (default: CPU count, %(default)s); 'auto': as many as the server wants, up to "
        "the CPUs this host gives it (its cpuset, at most its cgroup's CPU limit), starting with one",
    )
    w.add_argument("--keys", default=None, metavar="DIR", help="CURVE keys (client pair and server public key)")

    st = sub.add_parser(
        "status",
        help="show a server's state",
        description="Epoch, seqs delivered, seqs/s, workers and queue depths of a running server.",
    )
    st.add_argument("address", metavar="ADDRESS", help="the server's control address, e.g. tcp://127.0.0.1:5555")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument(
        "--story",
        action="append",
        metavar="KEY",
        help="instead, the moves the scheduler kept about KEY, each with the event that caused it: "
        "POS (a seq or batch position), batch:K, partition:P, run:R, lane:R/I or worker:NAME (repeatable)",
    )
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default %(default)s)")
    st.add_argument("--keys", default=None, metavar="DIR", help="CURVE keys")

    k = sub.add_parser(
        "keygen",
        help="write CURVE key pairs",
        description="Write server.key/server.key_secret and client.key/client.key_secret into DIR "
        "and authorise the client key (DIR/authorized/). If DIR already holds any of these files, "
        "nothing is written and the exit code is 2, unless --force. The secret files are 0600 and the "
        "folders it makes 0700 from the start, whatever the umask.",
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


def returnn_options(p: argparse.ArgumentParser, what: str) -> None:
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


def config_source(args: argparse.Namespace) -> Tuple[str, Optional[str]]:
    """(path, RETURNN dataset name or None) from CONFIG or --returnn-config/--dataset; ConfigError if unclear."""
    if args.config is not None and args.returnn_config is not None:
        raise ConfigError("--returnn-config", "give either CONFIG or --returnn-config, not both")
    if args.returnn_config is not None:
        return args.returnn_config, args.dataset or "train"
    if args.dataset is not None:
        raise ConfigError("--dataset", "names a dataset of a RETURNN config: give --returnn-config FILE too")
    if args.config is None:
        raise ConfigError("config", "missing: give CONFIG (a ppserver config) or --returnn-config FILE")
    return args.config, None


def version() -> str:
    from ppclient import __version__, protocol

    return f"ppserver {__version__} (protocol {protocol.PROTOCOL})"
