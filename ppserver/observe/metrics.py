"""Prometheus metrics of a running server: `ppserver serve --metrics ADDR`.

A small HTTP responder serves them from one thread of its own, which never touches the
scheduler: about once a second the I/O thread builds the metric families from plain
counters (stages.py, the reader's, the status) and swaps them in, and a scrape returns the
last set, in prometheus_client's exposition format. Without --metrics none of this is
imported or started.

The responder is one thread with a selector, not a thread per connection: at most
MAX_CONNECTIONS are open (a new one closes the oldest), and each is closed REQUEST_TIMEOUT_S
after it was accepted, answered or not. So peers that open connections and send nothing cost
the server at most MAX_CONNECTIONS + 1 file descriptors and no thread, and cannot take from
the clients, workers and scrapers the descriptors the server needs for them.
"""

from __future__ import annotations

import gzip
import ipaddress
import logging
import re
import selectors
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

from ppclient.protocol import PROTOCOL
from ppclient.throttle import Throttled
from ppserver.errors import ConfigError
from ppserver.observe.stages import MAX_SERIES, StageClock
from ppserver.observe.status import ServerStatus, queue_counts
from ppserver.scheduler.status import Side

log = logging.getLogger("ppserver.metrics")

_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")

MAX_CONNECTIONS = 16  # open metrics connections; one more closes the oldest
REQUEST_TIMEOUT_S = 5.0  # from accept to closed: the request read and the answer sent (a scrape takes ms)
MAX_REQUEST_BYTES = 8192  # request line and headers
BACKLOG = 64
WARN_EVERY_S = 60.0


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
    """The HTTP endpoint (a Responder's thread) and the families it serves."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry
        from prometheus_client.process_collector import ProcessCollector

        self.families: List[Any] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        ProcessCollector(registry=self.registry)
        try:
            self.responder = Responder(host, port, self.render)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
        log.info("metrics on %s", self.url)

    def collect(self) -> Iterator[Any]:
        """Called by the responder's thread at each scrape."""
        return iter(self.families)

    def publish(self, families: List[Any]) -> None:
        self.families = families  # one reference swap: a scrape sees the old set or the new one

    def render(self, path: str, headers: Dict[str, str]) -> Tuple[bytes, List[Tuple[str, str]]]:
        """A scrape's body and headers, as prometheus_client's own server makes them: the format
        the Accept header asks for (text or OpenMetrics), gzip when accepted."""
        from prometheus_client.exposition import choose_encoder

        if path == "/favicon.ico":
            return b"", [("Content-Type", "text/plain")]
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self.registry)
        out = [("Content-Type", content_type)]
        if "gzip" in headers.get("accept-encoding", "").lower():
            body = gzip.compress(body)
            out.append(("Content-Encoding", "gzip"))
        return body, out

    def close(self) -> None:
        self.responder.close()


Render = Callable[[str, Dict[str, str]], Tuple[bytes, List[Tuple[str, str]]]]


class _Conn:
    """One accepted connection: what it sent so far, what is left to send, when it is closed."""

    __slots__ = ("answered", "deadline", "inbox", "outbox", "sock")

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock = sock
        self.deadline = deadline
        self.inbox = b""
        self.outbox = b""
        self.answered = False


class Responder:
    """Answers HTTP GET (and HEAD) requests with `render`'s output, one request per connection,
    from one thread: see the module's docstring for its bounds."""

    def __init__(self, host: str, port: int, render: Render):
        self.render = render
        self.listener = _listen(host, port)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        self.conns: Dict[int, _Conn] = {}
        self.paused_until: Optional[float] = None  # accept failed (no descriptor left): not before then
        self.warnings = Throttled(
            log, "metrics endpoint", WARN_EVERY_S
        )  # a peer that holds connections would fill the log
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="ppserver-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop the thread (it closes every socket on its way out)."""
        self.stopping = True
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(timeout=5.0)
        self.wake_w.close()

    # ---- the thread ---------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            while not self.stopping:
                self._step()
        except Exception:
            log.exception("the metrics endpoint stopped")
        finally:
            for conn in list(self.conns.values()):
                self._drop(conn)
            self.selector.close()
            self.listener.close()
            self.wake_r.close()

    def _step(self) -> None:
        """Wait for sockets (at most until the next deadline), serve them, close the expired."""
        now = time.monotonic()
        wait = min([c.deadline for c in self.conns.values()] + [now + 1.0]) - now
        if self.paused_until is not None:
            wait = min(wait, self.paused_until - now)
        for key, events in self.selector.select(max(wait, 0.0)):
            if key.fileobj is self.listener:
                self._accept()
            elif key.fileobj is self.wake_r:
                self.wake_r.recv(64)
            else:
                self._serve_conn(key.data, events)
        now = time.monotonic()
        for conn in [c for c in self.conns.values() if c.deadline <= now]:
            self._drop(conn)
        if self.paused_until is not None and now >= self.paused_until:
            self.paused_until = None
            self.selector.register(self.listener, selectors.EVENT_READ)

    def _accept(self) -> None:
        """Take waiting connections; past MAX_CONNECTIONS the oldest open one is closed. At most
        MAX_CONNECTIONS at a time: a flood waits in the listen backlog (and past it, is dropped by
        the kernel), not in this thread, which would keep the interpreter from the I/O thread."""
        for _ in range(MAX_CONNECTIONS):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # e.g. no descriptor left: leave them waiting a while, not spinning
                self.warnings.hit(f"cannot accept a metrics connection ({exc.strerror or exc})")
                self.selector.unregister(self.listener)
                self.paused_until = time.monotonic() + 1.0
                return
            if len(self.conns) >= MAX_CONNECTIONS:
                self.warnings.hit(f"{len(self.conns)} metrics connections open: the oldest ones are closed")
                self._drop(min(self.conns.values(), key=lambda c: c.deadline))
            sock.setblocking(False)
            conn = _Conn(sock, time.monotonic() + REQUEST_TIMEOUT_S)
            self.conns[sock.fileno()] = conn
            self.selector.register(sock, selectors.EVENT_READ, conn)

    def _serve_conn(self, conn: _Conn, events: int) -> None:
        """Read or write what the socket is ready for; a connection that fails is closed."""
        try:
            if events & selectors.EVENT_READ:
                self._read(conn)
            if conn.outbox and events & selectors.EVENT_WRITE:
                self._write(conn)
        except OSError:
            self._drop(conn)
        except Exception as exc:  # a bug here must not stop the endpoint
            self.warnings.hit(f"a metrics connection failed: {exc!r}")
            self._drop(conn)

    def _read(self, conn: _Conn) -> None:
        """Read the request; once its headers are in, answer it. After the answer, what comes is
        dropped until the peer closes (closing first could reset the answer on its way)."""
        data = conn.sock.recv(4096)
        if not data:
            self._drop(conn)
            return
        if conn.answered:
            return
        conn.inbox += data
        end = conn.inbox.find(b"\r\n\r\n")
        if end > MAX_REQUEST_BYTES or (end < 0 and len(conn.inbox) > MAX_REQUEST_BYTES):
            self._answer(conn, "431 Request Header Fields Too Large", [], b"")
        elif end >= 0:
            self._answer(conn, *self._respond(conn.inbox[:end]))

    def _respond(self, head: bytes) -> Tuple[str, List[Tuple[str, str]], bytes]:
        """Status, headers and body for a request's head."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return "400 Bad Request", [], b""
        method, target = parts[0], urlsplit(parts[1])
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", [("Allow", "GET, HEAD")], b""
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        try:
            body, extra = self.render(target.path, headers)
        except Exception:
            log.exception("metrics could not be rendered")
            return "500 Internal Server Error", [], b""
        return "200 OK", extra, body if method == "GET" else b""

    def _answer(self, conn: _Conn, status: str, headers: List[Tuple[str, str]], body: bytes) -> None:
        """Send the answer (what the socket does not take now goes when it is writable)."""
        lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers)]
        lines += [f"Content-Length: {len(body)}", "Connection: close", "", ""]
        conn.outbox = "\r\n".join(lines).encode("latin-1") + body
        conn.answered = True
        conn.inbox = b""
        self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except BlockingIOError:
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            conn.sock.shutdown(socket.SHUT_WR)
            self.selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        """Close a connection. One closed already has no descriptor (fileno -1): no other one's
        entry is touched, even if its old descriptor number was given to a new connection."""
        if self.conns.pop(conn.sock.fileno(), None) is not None:
            self.selector.unregister(conn.sock)
        conn.sock.close()


def _listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket at the address (IPv4 or IPv6, as the host resolves)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _family(kind: str, name: str, doc: str, labels: Sequence[str], rows: Iterable[Tuple[Sequence[str], float]]) -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    fam = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=list(labels))
    for values, value in rows:
        fam.add_metric(list(values), value)
    return fam


def families(clock: StageClock, st: ServerStatus) -> List[Any]:
    """Every metric, from the stage clock and the server's status (Server.status)."""
    sched, newest = st.scheduler, st.scheduler.newest
    seconds, seqs = clock.totals()
    reader = clock.reader
    hosts = sorted(clock.hosts.items())
    workers: Dict[str, int] = {}
    for w in sched.workers:
        host = w.host if w.host in workers or len(workers) < MAX_SERIES else "other"
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
            sched.handed_back,
        ),
        _family(
            "counter",
            "ppserver_worker_departures",
            "workers forgotten, by reason",
            ("reason",),
            sorted(((d.value,), n) for d, n in sched.departures.items()),
        ),
        total("ppserver_seqs_skipped", "seqs map_seq skipped (returned None)", sched.seqs_skipped_total),
        total(
            "ppserver_internal_errors",
            "events whose handler in the scheduler raised (each failed its run)",
            sched.internal_errors,
        ),
        total("ppserver_malformed_results", "malformed results dropped (their seqs redone)", sched.malformed_results),
        total("ppserver_malformed_messages", "malformed messages dropped", st.malformed_messages),
        total("ppserver_refused_handshakes", "connections refused for wrong or missing keys", st.refused_handshakes),
        total("ppserver_local_worker_respawns", "local worker processes started again", st.local_worker_respawns),
        _family(
            "gauge",
            "ppserver_queue_seqs",
            "seqs in each queue of the newest run",
            ("queue",),
            [((q,), n) for q, n in sorted(queue_counts(newest).items() if newest is not None else ())],
        ),
        _family(
            "gauge",
            "ppserver_rate_seqs_per_second",
            "seqs delivered per second, rolling",
            (),
            [((), st.progress.rate_seqs_per_sec)],
        ),
        _family(
            "gauge",
            "ppserver_held_back",
            "1 for the side holding the live run back",
            ("side",),
            [((side.value,), 1.0 if side is st.progress.held_back_by else 0.0) for side in Side],
        ),
        _family(
            "gauge",
            "ppserver_workers_wanted",
            "workers the pool wants (num_workers auto: as the trainer needs; above the workers there are: "
            "more hosts would help)",
            (),
            [((), st.pool.wanted)],
        ),
        _family(
            "counter",
            "ppserver_pool_changes",
            "workers the server added (up) or retired (down) to size its pool, by reason",
            ("direction", "reason"),
            [((d, r), n) for d, r, n in st.pool.changes_total],
        ),
    ]
    out[0].add_metric([st.version, str(PROTOCOL)], 1.0)
    if newest is not None:
        out.append(_family("gauge", "ppserver_epoch", "epoch of the newest run", (), [((), newest.epoch)]))
    eta = st.progress.eta_s
    if eta is not None:
        out.append(_family("gauge", "ppserver_eta_seconds", "time left in the newest run's epoch", (), [((), eta)]))
    return out
