"""CURVE key files: where each side's keys live and how they are read.

``ppserver keygen DIR`` writes ``server.key``/``server.key_secret`` and
``client.key``/``client.key_secret`` and authorises the client key (``DIR/authorized/``); it
refuses to replace keys DIR already holds unless forced.
The server needs its secret key and the authorised public keys; workers and clients need
the client pair and the server's public key. Every function raises UsageError with the
path when a file is missing or unreadable, before any socket exists.
"""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass
from typing import List, Tuple

from .errors import UsageError

SERVER_KEY = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_KEY = "client.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED = "authorized"


@dataclass(frozen=True)
class ClientKeys:
    """What a connecting peer (client or worker) presents and whom it trusts."""

    public: bytes
    secret: bytes
    server_public: bytes

    def apply(self, sock) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server_public


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized: Tuple[bytes, ...]

    def apply(self, sock) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_server = True


def _load(directory: str, name: str, *, secret: bool) -> Tuple[bytes, bytes]:
    import zmq.auth

    path = os.path.join(directory, name)
    if not os.path.isdir(directory):
        raise UsageError(f"keys directory {directory!r} does not exist (make keys with `ppserver keygen DIR`)")
    if not os.path.isfile(path):
        raise UsageError(f"key file {path} is missing (make keys with `ppserver keygen {directory}`)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except Exception as exc:  # unreadable or not a certificate
        raise UsageError(f"key file {path} is not a valid key: {exc}") from None
    if secret and not secret_key:
        raise UsageError(f"key file {path} holds no secret key")
    return public, secret_key or b""


def client_keys(directory: str) -> ClientKeys:
    public, secret = _load(directory, CLIENT_SECRET, secret=True)
    server_public, _ = _load(directory, SERVER_KEY, secret=False)
    return ClientKeys(public, secret, server_public)


def server_keys(directory: str) -> ServerKeys:
    public, secret = _load(directory, SERVER_SECRET, secret=True)
    return ServerKeys(public, secret, tuple(authorized_keys(directory)))


def authorized_keys(directory: str) -> List[bytes]:
    """Public keys in DIR/authorized/, or, when that folder is absent (a flat directory such as a
    Kubernetes Secret), every *.key in DIR except the server's own."""
    folder = os.path.join(directory, AUTHORIZED)
    if os.path.isdir(folder):
        paths = sorted(glob.glob(os.path.join(folder, "*.key")))
    else:
        folder = directory
        paths = [p for p in sorted(glob.glob(os.path.join(directory, "*.key"))) if os.path.basename(p) != SERVER_KEY]
    found = [_load(os.path.dirname(p), os.path.basename(p), secret=False)[0] for p in paths]
    if not found:
        raise UsageError(f"no authorised public keys (*.key) in {folder}")
    return found


def existing_keys(directory: str) -> List[str]:
    """The files keygen would write that DIR already holds (relative to DIR): replacing them
    locks out every worker and client deployed with them."""
    names = [SERVER_KEY, SERVER_SECRET, CLIENT_KEY, CLIENT_SECRET, os.path.join(AUTHORIZED, CLIENT_KEY)]
    return [name for name in names if os.path.lexists(os.path.join(directory, name))]


def keygen(directory: str, *, force: bool = False) -> Tuple[str, str]:
    """Write a server and a client key pair; the client public key is authorised. Keys DIR
    already holds are kept (UsageError naming them) unless `force`: replacing them locks out
    every deployed peer. A DIR that cannot be made or written is a UsageError too, so that the
    command says why in one line."""
    found = [] if force else existing_keys(directory)
    if found:
        raise UsageError(
            f"{directory} already holds keys: {', '.join(found)}; --force replaces them "
            "(every worker and client using them is then refused)"
        )
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"cannot make keys directory {directory}: it is a file")
    try:
        _write_keys(directory)
    except OSError as exc:
        where = "" if exc.filename in (None, directory) else f" ({exc.filename})"
        raise UsageError(f"cannot make keys directory {directory}: {exc.strerror}{where}") from None
    return os.path.join(directory, SERVER_KEY), os.path.join(directory, CLIENT_KEY)


def _write_keys(directory: str) -> None:
    """Both pairs, the authorised copy of the client key, and secrets readable by their owner only."""
    import zmq.auth

    auth_dir = os.path.join(directory, AUTHORIZED)
    os.makedirs(auth_dir, exist_ok=True)
    zmq.auth.create_certificates(directory, "server")
    zmq.auth.create_certificates(directory, "client")
    shutil.copy(os.path.join(directory, CLIENT_KEY), os.path.join(auth_dir, CLIENT_KEY))
    for name in (SERVER_SECRET, CLIENT_SECRET):
        os.chmod(os.path.join(directory, name), 0o600)
