"""Prometheus metrics of a running server: `ppserver serve --metrics ADDR`.

prometheus_client serves them over HTTP from its own thread, which never touches the
scheduler: about once a second the I/O thread builds the metric families from plain
counters (stages.py, the reader's, the status) and swaps them in, and a scrape returns the
last set. Without --metrics none of this is imported or started.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from typing import Any, Dict, Iterable, Iterator, List, Sequence, Tuple

from ppclient.protocol import PROTOCOL

from .errors import ConfigError
from .progress import SIDES
from .stages import MAX_SERIES, StageClock

log = logging.getLogger("ppserver.metrics")

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")


def parse_address(text: str) -> Tuple[str, int]:
    """`HOST:PORT`, `[IPV6]:PORT`, or `:PORT` for every interface; ConfigError names --metrics."""
    bad = ConfigError("--metrics", f"expected HOST:PORT or :PORT (e.g. 127.0.0.1:9100), got {text!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise bad
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad from None
    elif host and not _HOSTNAME.match(host):
        raise bad
    if not 0 < int(port) < 65536:
        raise ConfigError("--metrics", f"port must be 1 to 65535, got {text!r}")
    return host or "0.0.0.0", int(port)


class Exporter:
    """The HTTP endpoint (prometheus_client's thread) and the families it serves."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, start_http_server
        from prometheus_client.process_collector import ProcessCollector

        self.families: List[Any] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        try:
            started = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.httpd = started[0] if isinstance(started, tuple) else None  # older versions return nothing
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
        log.info("metrics on %s", self.url)

    def collect(self) -> Iterator[Any]:
        """Called by prometheus_client's thread at each scrape."""
        return iter(self.families)

    def publish(self, families: List[Any]) -> None:
        self.families = families  # one reference swap: a scrape sees the old set or the new one

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


def _family(kind: str, name: str, doc: str, labels: Sequence[str], rows: Iterable[Tuple[Sequence[str], float]]) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=list(labels))
    for values, value in rows:
        fam.add_metric(list(values), value)
    return fam


def families(clock: StageClock, st: Dict[str, Any]) -> List[Any]:
    """Every metric, from the stage clock and a status dict (Server.status)."""
    seconds, seqs = clock.totals()
    reader = clock.reader
    hosts = sorted(clock.hosts.items())
    workers: Dict[str, int] = {}
    for w in st.get("workers", []):
        host = w["host"] if w["host"] in workers or len(workers) < MAX_SERIES else "other"
        workers[host] = workers.get(host, 0) + 1
    delivered = sorted(clock.delivered.items())

    def total(name: str, doc: str, value: float) -> Any:
        return _family("counter", name, doc, (), [((), value)])

    out = [
        _family("gauge", "ppserver_info", "version and protocol", ("version", "protocol"), []),
        _family(
            "counter",
            "ppserver_seqs_delivered",
            "seqs sent to clients",
            ("job", "rank"),
            [(key, v[0]) for key, v in delivered],
        ),
        _family(
            "counter",
            "ppserver_bytes_delivered",
            "array bytes sent to clients",
            ("job", "rank"),
            [(key, v[1]) for key, v in delivered],
        ),
        _family(
            "counter",
            "ppserver_stage_seconds",
            "seconds seqs spent in each stage, summed over seqs (transfer: approximate)",
            ("stage",),
            [((stage,), value) for stage, value in seconds.items()],
        ),
        _family(
            "counter",
            "ppserver_stage_seqs",
            "seqs that passed each stage (rate(seconds) / rate(seqs): mean time per seq)",
            ("stage",),
            [((stage,), value) for stage, value in seqs.items()],
        ),
        _family(
            "counter",
            "ppserver_dataset_seconds",
            "seconds the reader thread spent inside each dataset call",
            ("call",),
            [((call,), value) for call, value in reader.seconds.items()],
        ),
        _family(
            "counter",
            "ppserver_dataset_calls",
            "dataset calls that returned",
            ("call",),
            [((call,), value) for call, value in reader.calls.items()],
        ),
        _family(
            "counter",
            "ppserver_worker_results",
            "results received from the workers of each host",
            ("host",),
            [((h,), v[0]) for h, v in hosts],
        ),
        _family(
            "counter",
            "ppserver_worker_seconds",
            "task sent until result received, summed over seqs (map_seq), per host",
            ("host",),
            [((h,), v[1]) for h, v in hosts],
        ),
        _family(
            "counter",
            "ppserver_mapper_seconds",
            "seconds inside the mappers, as the workers of each host report",
            ("host",),
            [((h,), v[2]) for h, v in hosts],
        ),
        _family(
            "counter",
            "ppserver_mapper_seqs",
            "seqs the mappers returned, as the workers of each host report",
            ("host",),
            [((h,), v[3]) for h, v in hosts],
        ),
        _family("gauge", "ppserver_workers", "connected workers", ("host",), [((h,), n) for h, n in workers.items()]),
        total(
            "ppserver_reassigned",
            "seqs and stream partitions taken from departed workers and redone",
            st["handed_back"],
        ),
        _family(
            "counter",
            "ppserver_worker_departures",
            "workers forgotten, by reason",
            ("reason",),
            [((reason,), n) for reason, n in sorted(st["departures"].items())],
        ),
        total("ppserver_malformed_results", "malformed results dropped (their seqs redone)", st["malformed_results"]),
        total("ppserver_malformed_messages", "malformed messages dropped", st["malformed_messages"]),
        total("ppserver_refused_handshakes", "connections refused for wrong or missing keys", st["refused_handshakes"]),
        total("ppserver_local_worker_respawns", "local worker processes started again", st["local_worker_respawns"]),
        _family(
            "gauge",
            "ppserver_queue_seqs",
            "seqs in each queue of the newest run",
            ("queue",),
            [((q,), n) for q, n in sorted((st.get("queues") or {}).items())],
        ),
        _family(
            "gauge",
            "ppserver_rate_seqs_per_second",
            "seqs delivered per second, rolling",
            (),
            [((), st["rate_seqs_per_sec"])],
        ),
        _family(
            "gauge",
            "ppserver_held_back",
            "1 for the side holding the live run back",
            ("side",),
            [((side,), 1.0 if side == st.get("held_back_by") else 0.0) for side in SIDES],
        ),
    ]
    out[0].add_metric([str(st.get("version", "")), str(PROTOCOL)], 1.0)
    if st.get("epoch") is not None:
        out.append(_family("gauge", "ppserver_epoch", "epoch of the newest run", (), [((), st["epoch"])]))
    if st.get("eta_s") is not None:
        out.append(
            _family("gauge", "ppserver_eta_seconds", "time left in the newest run's epoch", (), [((), st["eta_s"])])
        )
    return out
