"""CURVE key files: where each side's keys live and how they are read.

``ppserver keygen DIR`` writes ``server.key``/``server.key_secret`` and
``client.key``/``client.key_secret`` and authorises the client key (``DIR/authorized/``); it
refuses to replace keys DIR already holds unless forced. The folders it makes are 0700 and the
secret files 0600 from their first byte, whatever the umask.
The server needs its secret key and the authorised public keys; workers and clients need
the client pair and the server's public key. Every function raises UsageError with the
path when a file is missing or unreadable, before any socket exists.
"""

from __future__ import annotations

import datetime
import glob
import os
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


SECRET_MODE = 0o600  # a secret key file: its owner's only
PUBLIC_MODE = 0o644
FOLDER_MODE = 0o700  # a folder keygen makes


def _write_keys(directory: str) -> None:
    """Both pairs and the authorised copy of the client key. Each file is made anew (a file it
    replaces is removed first, never written into: a descriptor another user holds on it would
    read the new key) with its mode from the start, so a secret is never readable by others,
    not even while it is written; the folders it makes are its owner's only."""
    import zmq

    _make_folder(directory)
    _make_folder(os.path.join(directory, AUTHORIZED))
    now = datetime.datetime.now()
    for name in ("server", "client"):
        public, secret = (key.decode("ascii") for key in zmq.curve_keypair())
        _write_new(os.path.join(directory, name + ".key"), _certificate(now, public), PUBLIC_MODE)
        _write_new(os.path.join(directory, name + ".key_secret"), _certificate(now, public, secret), SECRET_MODE)
        if name == "client":
            _write_new(os.path.join(directory, AUTHORIZED, CLIENT_KEY), _certificate(now, public), PUBLIC_MODE)


def _make_folder(path: str) -> None:
    """A folder made here is 0700 (its parents as os.makedirs makes them); one that exists is kept."""
    if os.path.isdir(path):
        return
    os.makedirs(path, mode=FOLDER_MODE)
    os.chmod(path, FOLDER_MODE)  # (the umask may have taken the owner's bits: never more than 0700)


def _write_new(path: str, text: str, mode: int) -> None:
    """`text` in a file made anew at `path` with `mode` (O_EXCL: not through a link, not into a
    file another process holds open), exactly that mode whatever the umask."""
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        os.fchmod(fd, mode)  # (the umask only takes bits away: never more than `mode`)
        f.write(text)


def _certificate(now: datetime.datetime, public: str, secret: str = "") -> str:
    """A ZeroMQ certificate, as zmq.auth writes and reads it."""
    kind = "**Secret** Certificate\n#   DO NOT PROVIDE THIS FILE TO OTHER USERS" if secret else "Public Certificate"
    lines = [f"#   ****  Generated on {now} by ppserver keygen  ****", f"#   ZeroMQ CURVE {kind}", ""]
    lines += ["metadata", "curve", f'    public-key = "{public}"']
    if secret:
        lines.append(f'    secret-key = "{secret}"')
    return "\n".join(lines) + "\n"
