"""ZeroMQ endpoints as users write them: checking, wildcards and loopback.

One place for the rules, used by the client, the workers and the server, so a typo such
as ``127.0.0.1:5555`` is one clear error everywhere instead of a socket that never connects.
"""

from __future__ import annotations

import os
import socket
from typing import Tuple

from .errors import UsageError

WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
# A Unix socket's path holds 107 bytes (sockaddr_un); a longer one cannot be bound: such a socket
# falls back to loopback TCP, or lives where its path fits.
MAX_IPC_PATH = 100
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")


def check(endpoint: object, what: str = "address") -> str:
    """``tcp://HOST:PORT`` (PORT 0-65535) or ``ipc://PATH``; raises UsageError naming `what`."""
    what = f"option {what!r}" if what.startswith("-") else what
    if not isinstance(endpoint, str):
        raise UsageError(f"{what}: expected a string such as tcp://HOST:PORT, got {type(endpoint).__name__}")
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return endpoint
    proto, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if proto != "tcp" or not sep or not colon or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{what}: expected tcp://HOST:PORT with PORT 0-65535 (or ipc://PATH), got {endpoint!r}")
    return endpoint


def ipc_fits(path: str) -> bool:
    """Whether a Unix socket can be bound at `path` (its bytes fit sockaddr_un, with room to spare)."""
    return len(os.fsencode(path)) <= MAX_IPC_PATH


def host_port(endpoint: str) -> Tuple[str, str]:
    """('HOST', 'PORT') of a tcp endpoint."""
    host, _, port = endpoint.partition("://")[2].rpartition(":")
    return host, port


def is_wildcard(endpoint: str) -> bool:
    return endpoint.startswith("tcp://") and host_port(endpoint)[0] in WILDCARD_HOSTS


def is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = host_port(endpoint)[0]
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def why_silent(endpoint: str, wait_s: float = 1.0) -> str:
    """Why nothing answered at `endpoint`, as far as the operating system tells (ZeroMQ does not:
    it connects in the background and tries again): for a ServerUnavailable message."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if path.startswith("@"):  # a Linux abstract socket: no file to look for
            return ""
        return "" if os.path.exists(path) else f"no socket file at {path}: nothing serves there"
    if not endpoint.startswith("tcp://"):
        return ""
    host, port = host_port(endpoint)
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=wait_s):
            pass
    except ConnectionRefusedError:
        return f"nothing listens on {host}:{port} (connection refused)"
    except socket.gaierror:
        return f"host {host!r} is not found"
    except OSError as exc:
        return f"{host}:{port} does not take connections ({exc.strerror or exc})"
    return (
        f"{host}:{port} takes connections but did not answer as a ppserver (another program, "
        "a server that is stuck, or CURVE keys that do not match the server's)"
    )


def reachable(endpoint: str, via: str) -> str:
    """A bound endpoint as a peer can connect to it: a wildcard host becomes the host of `via`
    (the address the peer already reached), or 127.0.0.1."""
    if not is_wildcard(endpoint):
        return endpoint
    _, port = host_port(endpoint)
    host = host_port(via)[0] if via.startswith("tcp://") and not is_wildcard(via) else "127.0.0.1"
    return f"tcp://{host}:{port}"


def direct_bind(server: str, directory: str, name: str) -> str:
    """Where a client binds the socket workers send its results to, given the server's address:
    beside an ipc server, an ipc path in `directory`; beside a loopback server, loopback; else the
    local address this host reaches the server from (so the socket listens on that interface
    only), any free port."""
    if server.startswith("ipc://"):
        return f"ipc://{directory}/{name}"
    if is_loopback(server):
        return "tcp://127.0.0.1:*"
    return f"tcp://{local_address_toward(host_port(server)[0])}:*"


def local_address_toward(host: str) -> str:
    """This host's address on the interface that routes to `host` (no packet is sent)."""
    import socket

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host.strip("[]"), 9))
        except OSError:
            return "127.0.0.1"
        address = s.getsockname()[0]
    return f"[{address}]" if family == socket.AF_INET6 else address
