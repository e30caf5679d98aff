"""CURVE encryption and authentication for sockets that leave the machine.

With a keys directory (written by `ppserver keygen DIR`), servers encrypt every socket and
accept only peers whose public key is in DIR/authorized/; workers and clients present
DIR/client.key_secret and trust DIR/server.key. Without keys, the server may bind only
loopback addresses unless told --insecure.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import zmq

log = logging.getLogger("ppserver.security")

SERVER_KEY = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_KEY = "client.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED = "authorized"


def keygen(directory: str) -> Tuple[str, str]:
    """Write a server and a client key pair; the client public key is authorised."""
    import shutil

    import zmq.auth

    os.makedirs(directory, exist_ok=True)
    auth_dir = os.path.join(directory, AUTHORIZED)
    os.makedirs(auth_dir, exist_ok=True)
    zmq.auth.create_certificates(directory, "server")
    zmq.auth.create_certificates(directory, "client")
    shutil.copy(os.path.join(directory, CLIENT_KEY), os.path.join(auth_dir, CLIENT_KEY))
    for name in (SERVER_SECRET, CLIENT_SECRET):
        os.chmod(os.path.join(directory, name), 0o600)
    return os.path.join(directory, SERVER_KEY), os.path.join(directory, CLIENT_KEY)


def _load(directory: str, name: str):
    import zmq.auth

    path = os.path.join(directory, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"key file {path} is missing (make keys with `ppserver keygen {directory}`)")
    return zmq.auth.load_certificate(path)


def client_side(sock: zmq.Socket, keys: Optional[str]) -> None:
    """Make a connecting socket (worker or client) speak CURVE with the server's key."""
    if not keys:
        return
    public, secret = _load(keys, CLIENT_SECRET)
    server_public, _ = _load(keys, SERVER_KEY)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public


def server_side(sock: zmq.Socket, keys: Optional[str]) -> None:
    """Make a binding socket a CURVE server (authentication is done by the Authenticator)."""
    if not keys:
        return
    public, secret = _load(keys, SERVER_SECRET)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


class _KeyRing:
    """The authorised client public keys; every refusal is logged."""

    def __init__(self, keys):
        self.keys = set(keys)

    def callback(self, domain, client_key) -> bool:
        if client_key in self.keys:
            return True
        log.warning("refused a connection: CURVE client key %s is not authorised", client_key.decode()[:16] + "...")
        return False


def authorized_keys(keys: str):
    """Public keys in KEYS/authorized/, or, when that folder is absent (a flat directory such as a
    Kubernetes Secret), every *.key in KEYS except the server's own."""
    import glob

    import zmq.auth

    folder = os.path.join(keys, AUTHORIZED)
    paths = sorted(glob.glob(os.path.join(folder, "*.key")))
    if not os.path.isdir(folder):
        folder = keys
        paths = [p for p in sorted(glob.glob(os.path.join(keys, "*.key"))) if os.path.basename(p) != SERVER_KEY]
    found = [zmq.auth.load_certificate(p)[0] for p in paths]
    if not found:
        raise FileNotFoundError(f"no authorised public keys (*.key) in {folder}")
    return found


def start_authenticator(ctx: zmq.Context, keys: Optional[str]):
    """Accept only clients and workers whose public key is authorised; refusals are logged."""
    if not keys:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    ring = _KeyRing(authorized_keys(keys))
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("ppserver.auth"))
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=ring)
    return auth


def is_loopback(endpoint: str) -> bool:
    host = endpoint.partition("://")[2].rpartition(":")[0].strip("[]")
    return endpoint.startswith(("ipc://", "inproc://")) or host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
